"""The three Spark DAGs under `dag.test()`: SparkSubmitOperator on `spark_default` = local[*], the store from
`delaywheel_default`, the jobs' effects checked in the store; a broken lateness contract fails the task."""

from __future__ import annotations

import csv
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from delaywheel import Message, Store

pytestmark = pytest.mark.airflow


@pytest.fixture
def dags(store_connection: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # spark-submit
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    ours = {"delaywheel_bulk_enqueue.py", "delaywheel_redeliver.py", "delaywheel_lateness_quality.py"}
    assert not {k: v for k, v in bag.import_errors.items() if Path(k).name in ours}
    return bag.dags


def _state(dag: Any, **conf: Any) -> str:
    return str(dag.test(run_conf=conf or None).state)


def test_bulk_enqueue_dag(dags: dict[str, Any], store: Store, tmp_path: Path) -> None:
    path = tmp_path / "timers.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "body", "delay_level"])
        writer.writerows([[f"o{i}", json.dumps({"order": i}), str(3 + i % 5)] for i in range(40)])
        writer.writerow(["o-bad", "{}", "not-a-level"])

    assert _state(dags["delaywheel_bulk_enqueue"], input=str(path), topic="orders") == "success"

    assert store.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone() == (40,)
    assert store.conn.execute("SELECT row_number, reason FROM delaywheel.quarantine").fetchall() == [(41, "bad_level")]


def test_redeliver_dag_catches_up(dags: dict[str, Any], store: Store) -> None:
    past = store.clock() - timedelta(hours=3)  # every level (up to 2 h) is overdue
    store.send_many([Message("orders", {"i": i}, delay_level=1 + i % 18, key=f"c{i}") for i in range(90)], now=past)

    assert _state(dags["delaywheel_redeliver"], mode="catch-up") == "success"

    assert store.conn.execute("SELECT count(DISTINCT message_id), count(*) FROM delaywheel.topic_messages"
                              ).fetchone() == (90, 90)


def test_lateness_dag_fails_on_a_broken_contract(dags: dict[str, Any], store: Store, tmp_path: Path) -> None:
    enqueued = store.clock() - timedelta(minutes=10)  # inside the default window: the last 15 minutes, settled
    store.send_many([Message("orders", {"i": i}, delay_level=2, key=f"q{i}") for i in range(20)], now=enqueued)
    store.deliver_due(now=enqueued + timedelta(seconds=6))
    store.conn.execute("UPDATE delaywheel.topic_messages SET delivered_at = deliver_at - interval '2 s'"
                       " WHERE key = 'q7'")

    assert _state(dags["delaywheel_lateness_quality"], report_dir=str(tmp_path)) == "failed"

    saved = store.conn.execute("SELECT success, failed, report_path FROM delaywheel.validation_results").fetchall()
    assert [(s, f) for s, f, _ in saved] == [(False, ["zero_early_deliveries"])]
    assert Path(saved[0][2]).parent == tmp_path
