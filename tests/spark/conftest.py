"""One SparkSession (local mode) for the whole test run: starting Spark costs tens of seconds here.
The jobs in spark/ are scripts, so their folder goes on sys.path and they are imported by module name."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SPARK_DIR = Path(__file__).resolve().parents[2] / "plugins" / "delaywheel" / "spark"
sys.path.insert(0, str(SPARK_DIR))
os.environ.setdefault("DELAYWHEEL_SHUFFLE_PARTITIONS", "2")


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    import sparkjob

    os.environ.setdefault("DELAYWHEEL_SPARK_MASTER", "local[2]")
    session = sparkjob.session("delaywheel tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    # py4j logs "Closing down clientserver connection" from __del__ at exit, after pytest closed its streams
    logging.getLogger("py4j").setLevel(logging.WARNING)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/spark/" in str(item.fspath):
            item.add_marker(pytest.mark.spark)
