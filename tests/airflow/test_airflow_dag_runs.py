"""`dag.test()` runs of the shipped DAGs against the real PostgreSQL: delaywheel_deliver delivers real
messages exactly once and records one Asset event per topic with the batch's positions; the consumer
template then pulls those messages by consumer group and acks them; maintenance runs; the group seek form moves a
group's offset, recorded, or fails saying why.

DAGs come from dags/ (the DAG bundle dag.test() syncs), with a two-level table so the run stays short.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from delaywheel import Settings, Store
from tests.helpers import deliveries, run_dag

pytestmark = pytest.mark.airflow

LEVELS = "1s 5s"


def parse(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    """The shipped DAGs, parsed with the short level table and `env` (Airflow reads its environment at each get)."""
    monkeypatch.setenv("DELAYWHEEL_LEVELS", LEVELS)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    assert bag.import_errors == {}
    return bag.dags


@pytest.fixture
def dags(store_connection: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    return parse(monkeypatch)


@pytest.fixture
def one_task_dags(store_connection: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The DAGs with `[delaywheel] deliver_tasks = one`."""
    return parse(monkeypatch, AIRFLOW__DELAYWHEEL__DELIVER_TASKS="one")


def asset_events(run_id: str) -> list[tuple[str, dict[str, Any]]]:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetModel.uri, AssetEvent.extra)
            .join(AssetEvent.asset)
            .where(AssetEvent.source_dag_id == "delaywheel_deliver", AssetEvent.source_run_id == run_id)
        ).all()
    return [(uri, dict(extra)) for uri, extra in rows]


def test_deliver_then_consume(dags: dict[str, Any], db_url: str) -> None:
    deliver = dags["delaywheel_deliver"]
    assert [t.task_id for t in deliver.tasks] == [
        "deliver_level_1",
        "deliver_level_2",
        "advance_wheel",
        "publish_topic_events",
    ]
    with Store(db_url, Settings(levels=Settings().levels[:2])) as store:
        now = store.clock()
        sent = [
            store.send("orders", {"n": n}, delay_level=1 + n % 2, now=now - timedelta(seconds=6)) for n in range(40)
        ]
        sent += [store.send("pay|ments", n, delay_level=2, now=now - timedelta(seconds=6)) for n in range(5)]
        sent += [store.send("orders", {"n": n}, delay=timedelta(seconds=1)) for n in range(40, 50)]  # the wheel
        store.prepare()  # rolls the wheel's near window forward, as the maintenance DAG does

        run_id, states, values = run_dag(deliver, lease_seconds=30, until_idle=True)

        assert set(states.values()) == {"success"}
        delivered = deliveries(store)
        assert Counter(d[0] for d in delivered) == Counter(sent)  # each message exactly once
        assert all(d[2] >= d[1] for d in delivered)  # never early
        assert sum(v["delivered"] for task, v in values.items() if task != "publish_topic_events") == len(sent)
        events = asset_events(run_id)
        by_uri = Counter()
        for uri, extra in events:
            by_uri[uri] += extra["count"]
            assert extra["first_offset"] <= extra["last_offset"]
        assert by_uri == {"delaywheel://topics/orders": 50, "delaywheel://topics/pay%7Cments": 5}
        # one event per topic for the whole run, naming the lanes it came from
        assert sorted((e["topic"], e["lanes"]) for _, e in events) == [
            ("orders", ["level 1", "level 2", "wheel"]),
            ("pay|ments", ["level 2"]),
        ]

        _, states, values = run_dag(dags["delaywheel_consumer_template"])
        assert states == {"consume": "success"}
        assert values["consume"]["consumed"] == 50 and values["consume"]["failed"] == 0
        acked = store.conn.execute(
            "SELECT sum(acked)::int FROM delaywheel.consumer_offsets WHERE grp = 'orders-template' AND topic = 'orders'"
        ).fetchone()
        assert acked == (50,)
        _, _, values = run_dag(dags["delaywheel_consumer_template"])
        assert values["consume"]["consumed"] == 0  # acked: nothing is read twice


def test_one_deliver_task_serves_every_lane(one_task_dags: dict[str, Any], db_url: str) -> None:
    """`deliver_tasks = one`: a run is one task that delivers every level and the wheel, each message once and
    none early, and the run's Asset events name its lane `every lane`."""
    deliver = one_task_dags["delaywheel_deliver"]
    assert [t.task_id for t in deliver.tasks] == ["deliver_all_lanes", "publish_topic_events"]
    with Store(db_url, Settings(levels=Settings().levels[:2])) as store:
        now = store.clock()
        sent = [store.send("orders", n, delay_level=1 + n % 2, now=now - timedelta(seconds=6)) for n in range(20)]
        sent += [store.send("orders", n, delay=timedelta(seconds=1)) for n in range(20, 30)]  # the wheel
        store.prepare()

        run_id, states, values = run_dag(deliver, lease_seconds=30, until_idle=True)

        assert set(states.values()) == {"success"}
        delivered = deliveries(store)
        assert Counter(d[0] for d in delivered) == Counter(sent)
        assert all(d[2] >= d[1] for d in delivered)
        assert values["deliver_all_lanes"]["per_lane"] == {"level 1": 10, "level 2": 10, "wheel": 10}
        ((uri, extra),) = asset_events(run_id)
        assert (uri, extra["count"], extra["lanes"]) == ("delaywheel://topics/orders", 30, ["every lane"])


def test_maintenance(dags: dict[str, Any], db_url: str) -> None:
    _, states, values = run_dag(dags["delaywheel_maintenance"])
    assert set(states.values()) == {"success"}
    tables = {row["table"] for row in values["table_sizes"]}
    assert {"level_segments", "wheel_far_segments", "topic_messages", "level_checkpoint", "wheel_cursor"} <= tables
    assert isinstance(values["vacuum"], list) and isinstance(values["retire"], list)
    assert values["summarize"] >= 0


def test_group_seek_form(dags: dict[str, Any], db_url: str) -> None:
    """`delaywheel_group_seek` as its trigger form sends it (empty fields as null): a rewind to the earliest message
    and a skip by offset, each recorded with who asked; a contradictory form fails the task and moves nothing."""
    seek = dags["delaywheel_group_seek"]
    with Store(db_url) as store:
        ids = [store.send("orders", {"n": n}) for n in range(4)]
        store.ack(store.pull("orders", "g"))
        form = {"topic": "orders", "group": "g", "to_time": None, "to_offset": None, "by": None}

        _, states, values = run_dag(seek, **{**form, "to": "earliest", "by": "ops: rewind"})
        assert states == {"seek": "success"}
        assert (values["seek"]["target"], values["seek"]["by"]) == ("earliest", "ops: rewind")
        assert pulled(store) == ids

        offset = pulled(store, 2)
        _, states, values = run_dag(seek, **{**form, "to": "offset", "to_offset": offset})
        assert states == {"seek": "success"}
        assert values["seek"]["by"].startswith("dag_test (Airflow delaywheel_group_seek, ")  # the triggering user
        assert pulled(store) == ids[2:]

        _, states, _ = run_dag(seek, **{**form, "to": "earliest", "to_offset": offset})
        assert states == {"seek": "failed"}
        assert pulled(store) == ids[2:]
        recorded = store.conn.execute("SELECT target FROM delaywheel.group_seeks WHERE qid = 0 ORDER BY id").fetchall()
        assert recorded == [("earliest",), (f"offset {offset}",)]  # a row per queue: every queue moved


def pulled(store: Store, at: int | None = None) -> Any:
    """The ids the group would be handed now (or the `at`th's queue_offset); the pull's queues given back at once."""
    batch = store.pull("orders", "g")
    store.release(batch)
    return [m.message_id for m in batch.messages] if at is None else batch.messages[at].queue_offset
