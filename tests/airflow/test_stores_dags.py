"""Several stores in Airflow (docs/stores.md): with `stores` configured the DAG files make one deliver DAG per
store on its own connection and pool, maintenance runs per store, and topic watchers, lease consumers and the
enqueue operator pick the connection of the topic's store. Two fresh databases on the shared cluster stand for
two stores: the DAGs only need the URLs to differ. With no stores configured nothing changes
(test_airflow_dag_integrity.py and test_airflow_dag_runs.py, unchanged, check that)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from delaywheel import Settings
from delaywheel.dev.local_airflow import as_url
from delaywheel.routing import Router, Stores
from tests.helpers import deliveries, fresh_database, run_dag

pytestmark = pytest.mark.airflow

ROOT = Path(__file__).resolve().parents[2]
LEVELS = "1s 5s"

PARSE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1])
deliver = {d.dag_id: d for d in bag.dags.values() if d.dag_id.startswith("delaywheel_deliver")}
print(json.dumps({
    "errors": {k: str(v) for k, v in bag.import_errors.items()},
    "deliver": {i: sorted({(t.delaywheel_conn_id, t.pool) for t in d.tasks if hasattr(t, "delaywheel_conn_id")})
                for i, d in deliver.items()},
    "publish_pools": {i: d.get_task("publish_topic_events").pool for i, d in deliver.items()},
    "maintenance": sorted(t.task_id for t in bag.dags["delaywheel_maintenance"].tasks),
    "maintenance_conns": sorted({t.op_args[0] for t in bag.dags["delaywheel_maintenance"].tasks}),
    "shop_args": [bag.dags["shop_place_orders"].get_task("place_orders").application_args,
                  bag.dags["shop_reconcile"].get_task("reconcile").application_args],
    "store_fields": [d for d in ("delaywheel_redeliver", "delaywheel_lateness_quality") if "store" in bag.dags[d].params],
    "watchers": [(w.name, w.trigger.delaywheel_conn_id) for a in
                 bag.dags["delaywheel_consumer_template"].timetable.asset_condition.objects for w in a.watchers],
}))
"""


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listening socket nothing should connect to while DAGs are parsed."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


def test_one_deliver_dag_per_store_on_its_connection_and_pool(airflow_db: dict[str, str], trap: socket.socket) -> None:
    port = trap.getsockname()[1]
    urls = {name: f"postgresql://postgres@127.0.0.1:{port}/{name}" for name in ("a", "b")}
    routes = "orders=b"  # the consumer template's topic: its watcher follows the route
    env = {
        **os.environ,
        **airflow_db,
        "DELAYWHEEL_STORES": ",".join(f"{n}={u}" for n, u in urls.items()),
        "DELAYWHEEL_ROUTES": routes,
        "DELAYWHEEL_LEVELS": LEVELS,
    }
    out = subprocess.run(
        [sys.executable, "-c", PARSE, str(ROOT / "dags")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    with pytest.raises(TimeoutError):
        trap.accept()  # parsing connected to no store
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["deliver"] == {
        "delaywheel_deliver_a": [["delaywheel_a", "delaywheel_deliver_a"]],
        "delaywheel_deliver_b": [["delaywheel_b", "delaywheel_deliver_b"]],
    }
    assert result["publish_pools"] == {
        "delaywheel_deliver_a": "delaywheel_deliver_a",
        "delaywheel_deliver_b": "delaywheel_deliver_b",
    }
    steps = ["prepare", "retire", "summarize", "table_sizes", "vacuum"]
    assert result["maintenance"] == sorted(f"store_{s}.{step}" for s in ("a", "b") for step in steps)
    assert result["maintenance_conns"] == ["delaywheel_a", "delaywheel_b"]
    # the topic's on its route's store; the group's retry topic's on every store (each store's ack writes its own)
    assert result["watchers"] == [
        ["delaywheel_topic_orders_b", "delaywheel_b"],
        ["delaywheel_topic_%25RETRY%25orders-template_a", "delaywheel_a"],
        ["delaywheel_topic_%25RETRY%25orders-template_b", "delaywheel_b"],
    ]
    # the shop's Spark jobs work on the store of its timeouts' topic; the store jobs' forms have a store field
    shop_store = Router(["a", "b"]).store_for("shop.order-timeout")
    for args in result["shop_args"]:
        assert "--db-url" not in args and args[args.index("--store") + 1] == shop_store
    assert result["store_fields"] == ["delaywheel_redeliver", "delaywheel_lateness_quality"]


def test_watchers_and_consumers_follow_the_topic_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from delaywheel.airflow.hooks import topic_conn_ids
    from delaywheel.airflow.operators import topic_asset
    from delaywheel.airflow.triggers import TopicMessagesTrigger

    assert topic_conn_ids("orders") == ("delaywheel_default",)  # no stores: as always
    assert [w.trigger.delaywheel_conn_id for w in topic_asset("orders").watchers] == ["delaywheel_default"]
    assert topic_asset("orders").watchers[0].name == "delaywheel_topic_orders"
    monkeypatch.setenv("DELAYWHEEL_STORES", "a=postgresql://h/a,b=postgresql://h/b")
    monkeypatch.setenv("DELAYWHEEL_ROUTES", "orders=a>b,audit=a")
    assert topic_conn_ids("orders") == ("delaywheel_b", "delaywheel_a")  # moving: the current store first
    assert [(w.name, w.trigger.delaywheel_conn_id) for w in topic_asset("orders").watchers] == [
        ("delaywheel_topic_orders_b", "delaywheel_b"),
        ("delaywheel_topic_orders_a", "delaywheel_a"),
    ]
    assert TopicMessagesTrigger("audit").delaywheel_conn_id == "delaywheel_a"
    assert TopicMessagesTrigger("audit", "delaywheel_other").delaywheel_conn_id == "delaywheel_other"  # explicit wins
    hashed = Router(["a", "b"]).store_for("payments")
    assert topic_conn_ids("payments") == (f"delaywheel_{hashed}",)
    assert set(topic_conn_ids("%DLQ%billing")) == {"delaywheel_a", "delaywheel_b"}  # every store's retry ladder


@pytest.fixture
def two_stores(
    airflow_db: dict[str, str], server_url: str, template_db: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """Stores a and b (two fresh databases), configured as DELAYWHEEL_STORES with connections delaywheel_a/_b."""
    with fresh_database(server_url, template_db) as a, fresh_database(server_url, template_db) as b:
        urls = {"a": as_url(a), "b": as_url(b)}
        monkeypatch.setenv("DELAYWHEEL_STORES", ",".join(f"{n}={u}" for n, u in urls.items()))
        monkeypatch.setenv("DELAYWHEEL_LEVELS", LEVELS)
        for name, url in urls.items():
            monkeypatch.setenv(f"AIRFLOW_CONN_DELAYWHEEL_{name.upper()}", url)
        yield urls


def topics_by_store(router: Router) -> dict[str, str]:
    """One topic the hash sends to each store."""
    found: dict[str, str] = {}
    for n in range(100):
        found.setdefault(router.store_for(f"topic{n}"), f"topic{n}")
    return found


def test_each_store_deliver_dag_delivers_its_store(two_stores: dict[str, str]) -> None:
    from airflow.dag_processing.dagbag import DagBag

    from delaywheel.airflow.operators import ConsumeOperator, EnqueueOperator

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    assert "delaywheel_deliver" not in bag.dags
    settings = Settings(levels=Settings().levels[:2])
    with Stores(two_stores.items(), settings) as stores:
        topic = topics_by_store(stores.router)
        assert set(topic) == {"a", "b"}
        now = stores.store("a").clock()
        sent: dict[str, list[int]] = {"a": [], "b": []}
        for n in range(30):
            name = "ab"[n % 2]
            sent[name].append(stores.send(topic[name], {"n": n}, delay_level=1 + n % 2, now=now - timedelta(seconds=6)))
        # the enqueue operator with no connection given routes by topic, on each store's connection
        ids = EnqueueOperator(
            task_id="enqueue", messages=[{"topic": topic["a"], "body": 1}, {"topic": topic["b"], "body": 2}]
        ).execute({})  # type: ignore[arg-type]
        sent["a"].append(ids[0])
        sent["b"].append(ids[1])
        for name in ("a", "b"):
            _, states, values = run_dag(bag.dags[f"delaywheel_deliver_{name}"], lease_seconds=30, until_idle=True)
            assert set(states.values()) == {"success"}
            published = values["publish_topic_events"]  # its lanes' deliveries (the enqueued one went straight in)
            assert list(published) == [topic[name]] and published[topic[name]]["count"] == len(sent[name]) - 1
            delivered = deliveries(stores.store(name))
            assert Counter(d[0] for d in delivered) == Counter(sent[name])  # each of its messages exactly once
            assert {d[3] for d in delivered} == {topic[name]}
        # a lease consumer with no connection given reads the topic's store
        for name in ("a", "b"):
            handled: list[Any] = []
            result = ConsumeOperator(
                task_id="consume",
                topic=topic[name],
                group="g",
                lease_seconds=30,
                until_idle=True,
                apply_function_batch=handled.extend,
            ).execute({})  # type: ignore[arg-type]
            assert result["acked"] == len(sent[name]) and sorted(m.message_id for m in handled) == sorted(sent[name])
