"""The Spark DAGs under `dag.test()`: SparkSubmitOperator on `spark_default` = local[*], the store from
`delaywheel_default`, the jobs' effects checked in the store; a broken lateness contract fails the task.
Each DAG runs to success once with a realistic parameter set given as the trigger form sends it (every field,
an empty optional one as null), so the templates' rendering of null is covered. The task log holds the jobs'
progress lines and hardly any Spark INFO line (Spark logs at WARN unless DELAYWHEEL_SPARK_LOG_LEVEL asks).
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
    ours = {"delaywheel_bulk_enqueue.py", "delaywheel_redeliver.py", "delaywheel_lateness_quality.py", "shop_orders.py"}
    assert not {k: v for k, v in bag.import_errors.items() if Path(k).name in ours}
    return bag.dags


SPARK_INFO = re.compile(r"^.*\d\d/\d\d/\d\d \d\d:\d\d:\d\d INFO ", re.MULTILINE)  # log4j2.properties' pattern
MAX_SPARK_INFO_LINES = 5  # Spark's default INFO logging gave ~250 a job


def form_conf(dag: Any, **fields: Any) -> dict[str, Any]:
    """The conf the trigger form sends: every field, with its default unless given; an empty field is null."""
    conf = {name: None if value == "" else value for name, value in dag.params.dump().items()}
    conf.update(fields)
    return conf


def _state(dag: Any, **conf: Any) -> str:
    return str(dag.test(run_conf=form_conf(dag, **conf)).state)


def _spark_info_lines(out: str) -> list[str]:
    return SPARK_INFO.findall(out)


def test_bulk_enqueue_dag(
    dags: dict[str, Any],
    store: Store,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DELAYWHEEL_INPUT_ROOTS", str(tmp_path))  # inputs are read only under an input root
    path = tmp_path / "timers.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "body", "delay_level"])
        writer.writerows([[f"o{i}", json.dumps({"order": i}), str(3 + i % 5)] for i in range(40)])
        writer.writerow(["o-bad", "{}", "not-a-level"])

    assert _state(dags["delaywheel_bulk_enqueue"], input=str(path), topic="orders") == "success"

    # the task log has each partition's closing progress line (progress.Progress, from the Spark job's stderr)
    out = capfd.readouterr().out
    done = re.findall(r"bulk enqueue, partition \d+: ([\d,]+) rows, .*?, done", out)
    assert done and sum(int(n.replace(",", "")) for n in done) == 41, done
    assert len(_spark_info_lines(out)) <= MAX_SPARK_INFO_LINES, _spark_info_lines(out)
    assert store.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone() == (40,)
    assert store.conn.execute("SELECT row_number, reason FROM delaywheel.quarantine").fetchall() == [(41, "bad_level")]


def test_redeliver_dag_catches_up(dags: dict[str, Any], store: Store, capfd: pytest.CaptureFixture[str]) -> None:
    past = store.clock() - timedelta(hours=3)  # every level (up to 2 h) is overdue
    store.send_many([Message("orders", {"i": i}, delay_level=1 + i % 18, key=f"c{i}") for i in range(90)], now=past)

    assert _state(dags["delaywheel_redeliver"], mode="catch-up") == "success"

    # every lane's closing progress line is in the task log (progress.Progress, from the Spark job's stderr)
    out = capfd.readouterr().out
    done = dict(re.findall(r"catch-up, (level \d+|wheel): ([\d,]+) delivered, .*?, done", out))
    assert len(_spark_info_lines(out)) <= MAX_SPARK_INFO_LINES, _spark_info_lines(out)
    assert set(done) == {f"level {n}" for n in range(1, 19)} | {"wheel"}
    assert sum(int(n.replace(",", "")) for n in done.values()) == 90

    assert store.conn.execute(
        "SELECT count(DISTINCT message_id), count(*) FROM delaywheel.topic_messages"
    ).fetchone() == (90, 90)


def test_lateness_dag_passes_then_fails_on_a_broken_contract(
    dags: dict[str, Any],
    store: Store,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    enqueued = store.clock() - timedelta(minutes=10)  # inside the default window: the last 15 minutes, settled
    store.send_many([Message("orders", {"i": i}, delay_level=2, key=f"q{i}") for i in range(20)], now=enqueued)
    store.deliver_due(now=enqueued + timedelta(seconds=6))
    dag = dags["delaywheel_lateness_quality"]

    # the form's defaults (start, end and report_dir empty: null), with per-lane limits
    assert _state(dag, p99_ms="default=5000,2=3000,wheel=2000") == "success"
    out = capfd.readouterr().out
    assert len(_spark_info_lines(out)) <= MAX_SPARK_INFO_LINES, _spark_info_lines(out)

    store.conn.execute(
        "UPDATE delaywheel.topic_messages SET delivered_at = deliver_at - interval '2 s' WHERE key = 'q7'"
    )
    monkeypatch.setenv("DELAYWHEEL_SPARK_LOG_LEVEL", "info")  # asked for: Spark's INFO lines are back
    assert _state(dag, report_dir=str(tmp_path)) == "failed"
    out = capfd.readouterr().out
    assert len(_spark_info_lines(out)) > 50
    assert re.search(r"INFO JettyUtils: Start Jetty 127\.0\.0\.1:\d+ for SparkUI", out), "the UI listens on loopback"

    saved = store.conn.execute(
        "SELECT success, failed, report_path FROM delaywheel.validation_results ORDER BY id"
    ).fetchall()
    assert [(s, f) for s, f, _ in saved] == [(True, []), (False, ["zero_early_deliveries"])]
    assert Path(saved[0][2]).parent != tmp_path and Path(saved[1][2]).parent == tmp_path


@pytest.mark.usefixtures("shop_schema")  # the shop's own line in the test's database
def test_shop_place_orders_then_reconcile_dags(dags: dict[str, Any], store: Store) -> None:
    from delaywheel_shop import orders

    orders.reset(store, stock_per_sku=1000)
    assert _state(dags["shop_place_orders"], orders=120, timeout="30m", period="1s", first_id=1) == "success"

    assert store.conn.execute("SELECT count(*) FROM shop.orders").fetchone() == (120,)
    stats = store.stats()  # each order's timeout message, pending (due in 30 minutes)
    assert stats["wheel"]["pending"] + sum(level["backlog"] for level in stats["levels"]) == 120

    store.cancel_matching(keys=[orders.timer_key(7), orders.timer_key(8)], reason="lost (simulated)")
    assert _state(dags["shop_reconcile"]) == "success"  # no params: its job arguments are fixed
    assert store.conn.execute(
        "SELECT missing, created, stale, cancelled FROM delaywheel.reconcile_runs"
    ).fetchall() == [(2, 2, 0, 0)]


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


@pytest.mark.parametrize(
    ("dag_id", "job", "conf", "expected"),
    [
        ("delaywheel_redeliver", "redeliver", {}, {"mode": "catch-up", "batch": 50_000, "delay_seconds": None}),
        (
            "delaywheel_redeliver",
            "redeliver",
            {
                "mode": "reconcile",
                "table": "shop.orders",
                "key_column": "order_id",
                "predicate": "status = 'pending'",
                "topic": "order.timeout",
                "delay_seconds": "90",
            },
            {"table": "shop.orders", "due_column": None, "delay_seconds": 90.0},
        ),
        (
            "delaywheel_bulk_enqueue",
            "bulk_enqueue",
            {"input": "orders.csv"},
            {"input": "orders.csv", "source_url": None, "partitions": None, "chunk": 50_000, "parquet_reader": "auto"},
        ),
        (
            "delaywheel_bulk_enqueue",
            "bulk_enqueue",
            {"query": "SELECT 1", "source_url": "postgresql://shop@db/shop", "partitions": "6"},
            {"input": None, "source_url": "postgresql://shop@db/shop", "partitions": 6},
        ),
        ("delaywheel_lateness_quality", "lateness_quality", {}, {"start": None, "window_minutes": 15.0}),
        (
            "delaywheel_lateness_quality",
            "lateness_quality",  # as the form sends empty fields: null
            {"start": None, "end": None, "report_dir": None},
            {"start": None, "end": None, "report_dir": None},
        ),
        (
            "delaywheel_lateness_quality",
            "lateness_quality",
            {"start": "2026-01-01T00:00", "end": "2026-01-01T01:00:00+02:00", "report_dir": "/tmp/r"},
            {"report_dir": "/tmp/r", "window_minutes": 15.0},
        ),
    ],
)
def test_every_job_argument_is_a_run_parameter(
    dags: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    dag_id: str,
    job: str,
    conf: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    parser = _job_parser(job, monkeypatch)
    argv = _job_argv(dags[dag_id], conf)

    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert set(argv[::2]) == options - {"--help", "--requested-by", "--now"}  # --now: tests inject the clock
    parsed = vars(parser.parse_args(argv))
    assert {k: parsed[k] for k in expected} == expected


def test_reconcile_needs_a_due_column_or_a_delay(dags: dict[str, Any]) -> None:
    reconcile = {
        "mode": "reconcile",
        "table": "shop.orders",
        "key_column": "order_id",
        "predicate": "true",
        "topic": "order.timeout",
    }
    redeliver = importlib.import_module("redeliver")
    for conf in (reconcile, {**reconcile, "due_column": "deadline", "delay_seconds": "90"}):
        with pytest.raises(SystemExit):
            redeliver.main(_job_argv(dags["delaywheel_redeliver"], conf))


@pytest.mark.parametrize(("master", "loopback"), [("local[2]", True), ("spark://spark-master:7077", False)])
def test_a_local_spark_listens_on_loopback_only(
    dags: dict[str, Any], monkeypatch: pytest.MonkeyPatch, master: str, loopback: bool
) -> None:
    """SPARK_LOCAL_IP (where Spark binds its driver and UI) is 127.0.0.1 for a local master only: a cluster's
    executors must reach the driver. The JVM logs at WARN through spark/log4j2.properties either way."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": master}))
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(SparkSubmitOperator, "execute", lambda self, context: seen.append(dict(self.env_vars)))
    task = copy.deepcopy(dags["delaywheel_lateness_quality"].get_task("lateness_quality"))
    task.execute({})
    assert (seen[0].get("SPARK_LOCAL_IP") == "127.0.0.1") is loopback
    assert task.conf["spark.driver.extraJavaOptions"].endswith("spark/log4j2.properties")
