"""Every DAG in dags/ parses cleanly, cheaply, and without touching the store or Spark.

Parsing happens in a fresh interpreter through Airflow's own DagBag (as the DAG processor does), with the
store's URL and the `delaywheel_default` connection pointing at a local socket we listen on: a DAG file
that connected to the database at parse time would show up as a connection on that socket. The time
budget is Airflow's own (`dagbag_import_timeout`): a slower file is reported as an import error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from delaywheel import parse_levels

pytestmark = pytest.mark.airflow

ROOT = Path(__file__).resolve().parents[2]
IMPORT_BUDGET_S = 30

PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
from airflow.serialization.serialized_objects import DagSerialization
bag = DagBag(dag_folder=sys.argv[1])
deliver = bag.dags.get("delaywheel_deliver")
print(json.dumps({
    "errors": {k: str(v) for k, v in bag.import_errors.items()},
    "dags": {d.dag_id: [t.task_id for t in d.tasks] for d in bag.dags.values()},
    "levels": {t.task_id: t.level for t in deliver.tasks if hasattr(t, "level")} if deliver else {},
    "consumer_assets": [a.uri for a in bag.dags["delaywheel_consumer_template"].timetable.asset_condition.objects],
    "spark_loaded": "pyspark" in sys.modules,
    # the deliver DAG's top level as the grid lists it (serialized, sorted by Airflow's grid order)
    "grid": [n.label for n in DagSerialization.from_dict(DagSerialization.to_dict(deliver))
             .task_group.topological_sort()] if deliver else [],
}))
"""


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listening socket nothing should connect to."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


def parse_dags(airflow_db: dict[str, str], trap: socket.socket, **env: str) -> dict:
    port = trap.getsockname()[1]
    url = f"postgresql://postgres@127.0.0.1:{port}/nowhere"
    full = {
        **os.environ,
        **airflow_db,
        "DELAYWHEEL_DATABASE_URL": url,
        "AIRFLOW_CONN_DELAYWHEEL_DEFAULT": url,
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": str(IMPORT_BUDGET_S),
        **env,
    }
    out = subprocess.run(
        [sys.executable, "-c", PARSE, str(ROOT / "dags")],
        env=full,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    with pytest.raises(TimeoutError):
        trap.accept()  # nothing connected to the "database" while parsing
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_dag_imports_without_touching_the_store_or_spark(airflow_db: dict[str, str], trap: socket.socket) -> None:
    result = parse_dags(airflow_db, trap)
    assert result["errors"] == {}
    assert {"delaywheel_deliver", "delaywheel_maintenance", "delaywheel_consumer_template"} <= set(result["dags"])
    assert not result["spark_loaded"]
    default = len(parse_levels("1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"))
    assert result["dags"]["delaywheel_deliver"] == [f"deliver_level_{n}" for n in range(1, default + 1)] + [
        "advance_wheel",
        "publish_topic_events",
    ]
    assert result["levels"] == {f"deliver_level_{n}": n for n in range(1, default + 1)}
    # the topic's Asset or its group's retry topic's (consumer_schedule): retries wake the consumer too
    assert result["consumer_assets"] == [
        "delaywheel://topics/orders",
        "delaywheel://topics/%25RETRY%25orders-template",
    ]
    # the grid lists the lanes in level order (level 2 before level 10), under their tasks' display names
    assert result["grid"][:3] == ["level 1 (1s)", "level 2 (5s)", "level 3 (10s)"]
    assert result["grid"][9:] == [
        "level 10 (6m)",
        "level 11 (7m)",
        "level 12 (8m)",
        "level 13 (9m)",
        "level 14 (10m)",
        "level 15 (20m)",
        "level 16 (30m)",
        "level 17 (1h)",
        "level 18 (2h)",
        "timing wheel",
        "publish_topic_events",
    ]


def test_one_deliver_task_for_every_lane_and_a_wrong_value_named(
    airflow_db: dict[str, str], trap: socket.socket
) -> None:
    """`[delaywheel] deliver_tasks = one` makes one deliver task a run; any other value than per_lane or one fails
    the deliver DAG's import, naming the value, and leaves the other DAGs alone."""
    result = parse_dags(airflow_db, trap, AIRFLOW__DELAYWHEEL__DELIVER_TASKS="one")
    assert result["errors"] == {}
    assert result["dags"]["delaywheel_deliver"] == ["deliver_all_lanes", "publish_topic_events"]
    result = parse_dags(airflow_db, trap, AIRFLOW__DELAYWHEEL__DELIVER_TASKS="all")
    ((path, error),) = result["errors"].items()
    assert path.endswith("delaywheel_deliver.py")
    assert "deliver_tasks must be 'per_lane' or 'one', not 'all'" in error
    assert "delaywheel_deliver" not in result["dags"] and "delaywheel_maintenance" in result["dags"]


@pytest.mark.parametrize("variable", ["DELAYWHEEL_LEVELS", "AIRFLOW__DELAYWHEEL__LEVELS"])
def test_deliver_tasks_follow_a_custom_level_table(
    airflow_db: dict[str, str], trap: socket.socket, variable: str
) -> None:
    result = parse_dags(airflow_db, trap, **{variable: "2s 90s 3h"})
    assert result["errors"] == {}
    assert result["dags"]["delaywheel_deliver"] == [
        "deliver_level_1",
        "deliver_level_2",
        "deliver_level_3",
        "advance_wheel",
        "publish_topic_events",
    ]


IMPORTS_OF_DAG = """
import importlib.util, json, sys
import airflow.sdk  # the DAG processor imports the Airflow modules a file names before it parses the file
spec = importlib.util.spec_from_file_location("dag_file", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
heavy = ("psycopg", "pglast", "pyarrow", "delaywheel.store", "airflow.providers.postgres.hooks.postgres")
print(json.dumps([m for m in heavy if m in sys.modules]))
"""
LIGHT_DAGS = (
    "delaywheel_deliver",
    "delaywheel_maintenance",
    "delaywheel_consumer_lease_template",
    "consumer_template",
    "delaywheel_bulk_enqueue",
    "delaywheel_redeliver",
    "delaywheel_lateness_quality",
    "delaywheel_group_seek",
)


@pytest.mark.parametrize("dag_file", LIGHT_DAGS)
def test_dag_files_import_no_driver_and_no_store(
    airflow_db: dict[str, str], trap: socket.socket, dag_file: str
) -> None:
    """The DAG processor parses every file every 30 s: the library's DAG files import neither psycopg, pglast,
    pyarrow, the store nor the postgres provider to do it (their tasks import them when they run). With them, a
    parse in a process that had not loaded them cost 0.28-0.39 s of CPU a file (`bench.dag_parse`)."""
    url = f"postgresql://postgres@127.0.0.1:{trap.getsockname()[1]}/nowhere"
    env = {**os.environ, **airflow_db, "DELAYWHEEL_DATABASE_URL": url, "AIRFLOW_CONN_DELAYWHEEL_DEFAULT": url}
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS_OF_DAG, str(ROOT / "dags" / f"{dag_file}.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
