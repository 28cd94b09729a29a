"""The three Spark DAGs under `dag.test()`: SparkSubmitOperator on `spark_default` = local[*], the store from
`delaywheel_default`, the jobs' effects checked in the store; a broken lateness contract fails the task.
Every job argument is a run parameter: checked against the jobs' own parsers, without starting Spark."""

from __future__ import annotations

import argparse
import copy
import csv
import importlib
import json
import os
import re
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


def test_bulk_enqueue_dag(dags: dict[str, Any], store: Store, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "timers.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "body", "delay_level"])
        writer.writerows([[f"o{i}", json.dumps({"order": i}), str(3 + i % 5)] for i in range(40)])
        writer.writerow(["o-bad", "{}", "not-a-level"])

    assert _state(dags["delaywheel_bulk_enqueue"], input=str(path), topic="orders") == "success"

    # the task log has each partition's closing progress line (progress.Progress, from the Spark job's stderr)
    done = re.findall(r"bulk enqueue, partition \d+: ([\d,]+) rows, .*?, done", capfd.readouterr().out)
    assert done and sum(int(n.replace(",", "")) for n in done) == 41, done
    assert store.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone() == (40,)
    assert store.conn.execute("SELECT row_number, reason FROM delaywheel.quarantine").fetchall() == [(41, "bad_level")]


def test_redeliver_dag_catches_up(dags: dict[str, Any], store: Store, capfd: pytest.CaptureFixture[str]) -> None:
    past = store.clock() - timedelta(hours=3)  # every level (up to 2 h) is overdue
    store.send_many([Message("orders", {"i": i}, delay_level=1 + i % 18, key=f"c{i}") for i in range(90)], now=past)

    assert _state(dags["delaywheel_redeliver"], mode="catch-up") == "success"

    # every lane's closing progress line is in the task log (progress.Progress, from the Spark job's stderr)
    done = dict(re.findall(r"catch-up, (level \d+|wheel): ([\d,]+) delivered, .*?, done", capfd.readouterr().out))
    assert set(done) == {f"level {n}" for n in range(1, 19)} | {"wheel"}
    assert sum(int(n.replace(",", "")) for n in done.values()) == 90

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


class _Parsed(Exception):
    pass


def _job_parser(job: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The job's own argument parser, caught when `main` parses (before any Spark session starts)."""
    caught: list[argparse.ArgumentParser] = []

    def catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        caught.append(self)
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(_Parsed):
            importlib.import_module(job).main([])
    return caught[0]


def _job_argv(dag: Any, conf: dict[str, Any]) -> list[str]:
    """The job arguments the DAG's task renders for a run with `conf` (params validated as a trigger would)."""
    params = copy.deepcopy(dag.params)
    params.update(conf)
    values, env = params.validate(), dag.get_template_env()
    (task,) = dag.tasks
    pairs = dict(zip(task.application_args[::2], task.application_args[1::2], strict=True))
    argv = ["--db-url", "postgresql://nowhere/x"]  # --db-url and --requested-by come from the connection, the run
    for flag, template in pairs.items():
        if flag not in ("--db-url", "--requested-by"):
            argv += [flag, env.from_string(template).render(params=values)]
    return argv


@pytest.mark.parametrize(("dag_id", "job", "conf", "expected"), [
    ("delaywheel_redeliver", "redeliver", {}, {"mode": "catch-up", "batch": 50_000, "delay_seconds": None}),
    ("delaywheel_redeliver", "redeliver",
     {"mode": "reconcile", "table": "shop.orders", "key_column": "order_id", "predicate": "status = 'pending'",
      "topic": "order.timeout", "delay_seconds": "90"},
     {"table": "shop.orders", "due_column": None, "delay_seconds": 90.0}),
    ("delaywheel_bulk_enqueue", "bulk_enqueue", {"input": "orders.csv"},
     {"input": "orders.csv", "source_url": None, "partitions": None, "chunk": 50_000, "parquet_reader": "auto"}),
    ("delaywheel_bulk_enqueue", "bulk_enqueue",
     {"query": "SELECT 1", "source_url": "postgresql://shop@db/shop", "partitions": "6"},
     {"input": None, "source_url": "postgresql://shop@db/shop", "partitions": 6}),
    ("delaywheel_lateness_quality", "lateness_quality", {}, {"start": None, "window_minutes": 15.0}),
])
def test_every_job_argument_is_a_run_parameter(dags: dict[str, Any], monkeypatch: pytest.MonkeyPatch, dag_id: str,
                                               job: str, conf: dict[str, Any], expected: dict[str, Any]) -> None:
    parser = _job_parser(job, monkeypatch)
    argv = _job_argv(dags[dag_id], conf)

    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert set(argv[::2]) == options - {"--help", "--requested-by", "--now"}  # --now: tests inject the clock
    parsed = vars(parser.parse_args(argv))
    assert {k: parsed[k] for k in expected} == expected


def test_reconcile_needs_a_due_column_or_a_delay(dags: dict[str, Any]) -> None:
    reconcile = {"mode": "reconcile", "table": "shop.orders", "key_column": "order_id", "predicate": "true",
                 "topic": "order.timeout"}
    redeliver = importlib.import_module("redeliver")
    for conf in (reconcile, {**reconcile, "due_column": "deadline", "delay_seconds": "90"}):
        with pytest.raises(SystemExit):
            redeliver.main(_job_argv(dags["delaywheel_redeliver"], conf))
