"""The runtime cannot destroy what is not drained (issue 65, item 5): as the runtime login, the partition helpers
refuse a partition that still holds undelivered timers, cancellations still needed or topic rows a group has not read,
and NULL bounds; what retire and the roll drop still goes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from delaywheel import Settings, Store
from delaywheel.dev import embedded
from delaywheel.locks import WHEEL_LOCK
from delaywheel.migrate import OWNER_ROLE, migrate
from delaywheel.produce.validation import Message

T0 = datetime(2030, 1, 1, tzinfo=UTC)
PARENTS = ["level_segments", "wheel", "wheel_far_segments", "topic_messages", "cancellations"]


@pytest.fixture(scope="module")
def roles(server_url: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        embedded.create_roles(conn)


@pytest.fixture
def runtime(server_url: str, roles: None) -> Iterator[str]:
    """A fresh database migrated by the owner's login; yields the runtime login's URL."""
    name = f"dwdrained_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
        conn.execute(f"GRANT CREATE ON DATABASE {name} TO {OWNER_ROLE}")
    migrate(make_conninfo(server_url, dbname=name, user=embedded.OWNER_LOGIN))
    yield make_conninfo(server_url, dbname=name, user=embedded.RUNTIME_LOGIN)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _drop(url: str, parent: str, lo: datetime) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT delaywheel.drop_partition(%s, %s)", (parent, lo)).fetchone()
    return bool(row and row[0])


def _refused(url: str, parent: str, lo: datetime, reason: str) -> None:
    with pytest.raises(errors.ObjectInUse, match=reason) as refused:
        _drop(url, parent, lo)
    assert refused.value.diag.message_hint and "drained" in refused.value.diag.message_hint


def _count(store: Store, table: str) -> int:
    row = store.conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("delaywheel", table))).fetchone()
    assert row is not None
    return int(row[0])


def test_pending_level_segments_are_not_dropped(runtime: str) -> None:
    with Store(runtime, Settings()) as store:
        store.send_many([Message("orders", {"i": i}, delay_level=18) for i in range(100)], now=T0)
        store.conn.commit()
        _refused(runtime, "level_segments", T0, "level's deliverer has not passed")
        assert _count(store, "level_queue") == 100
        assert store.deliver_level(18, now=T0 + timedelta(hours=2)).delivered == 100
        store.conn.commit()
    assert _drop(runtime, "level_segments", T0)  # drained: it goes


def test_pending_near_and_far_timers_are_not_dropped(runtime: str) -> None:
    with Store(runtime, Settings()) as store:
        store.send_many([Message("orders", {"i": i}, delay=timedelta(hours=2)) for i in range(10)], now=T0)
        store.send_many([Message("orders", {"i": i}, delay=timedelta(days=10)) for i in range(100)], now=T0)
        store.conn.commit()
        _refused(runtime, "wheel", T0, "wheel's cursor has not passed")
        _refused(runtime, "wheel_far_segments", T0 + timedelta(days=10), "roll has not moved")
        assert (_count(store, "wheel"), _count(store, "wheel_far")) == (10, 100)
        delivered = 0
        while (result := store.advance_wheel(now=T0 + timedelta(days=11))).delivered or result.more:
            delivered += result.delivered
        store.conn.commit()
        assert delivered == 110  # the roll dropped the far block it had moved
        assert store.conn.execute(
            "SELECT count(*) FROM delaywheel.partitions WHERE parent = 'wheel_far_segments'"
        ).fetchone() == (0,)


def test_cancellations_still_needed_are_not_dropped(runtime: str) -> None:
    with Store(runtime, Settings()) as store:
        store.send("orders", b"x", delay=timedelta(hours=3), key="timeout", now=T0)
        assert [r.outcome for r in store.cancel(key="timeout")] == ["cancelled"]
        store.conn.commit()
        _refused(runtime, "cancellations", T0, "still pending")
        assert _count(store, "cancellations") == 1
        assert store.advance_wheel(now=T0 + timedelta(hours=4)).delivered == 0  # still cancelled
        store.conn.commit()
    assert _drop(runtime, "cancellations", T0)  # the message passed: no longer needed


def test_unread_topic_rows_are_not_dropped(runtime: str) -> None:
    with Store(runtime, Settings()) as store:
        store.send_many([Message("orders", {"i": i}) for i in range(2)], now=T0)  # delivered at once
        store.conn.commit()
        _refused(runtime, "topic_messages", T0, "no consumer group has read topic 'orders'")
        batch = store.pull("orders", "g", 1)
        assert store.ack(batch).acked == 1
        _refused(runtime, "topic_messages", T0, "consumer group g on orders has not read")
        assert _count(store, "topic_messages") == 2
        assert store.ack(store.pull("orders", "g", 10)).acked == 1
        store.conn.commit()
    assert _drop(runtime, "topic_messages", T0)  # every group read it


def test_topic_rows_past_the_retention_floor_go_unread(runtime: str) -> None:
    """Retention drops topic rows whether read or not: a partition that ended longer ago than the database's floor
    (the owner's to set, 7 days) goes with rows no group has read, counted for each group that reads the topic."""
    old = datetime(2020, 1, 1, tzinfo=UTC)
    with psycopg.connect(runtime, autocommit=True) as conn:
        conn.execute("SELECT delaywheel.ensure_partition('topic_messages', %s, %s)", (old, old + timedelta(days=1)))
        conn.execute(
            "INSERT INTO delaywheel.topic_messages (topic, message_id, origin, body, is_json, deliver_at, delivered_at)"
            " VALUES ('orders', 1, 'direct', 'x', false, %s, %s), ('audit', 2, 'direct', 'x', false, %s, %s)",
            (old, old, old, old),
        )
        conn.execute(  # read nothing, in any of its queues
            "INSERT INTO delaywheel.consumer_offsets (grp, topic, qid) SELECT 'g', 'orders', q FROM generate_series(0, 15) q"
        )
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("UPDATE delaywheel.retention_floor SET topic_messages = interval '0'")
    assert _drop(runtime, "topic_messages", old)
    with psycopg.connect(runtime, autocommit=True) as conn:
        assert conn.execute("SELECT grp, topic, dropped, last_partition FROM delaywheel.retired_unread").fetchall() == [
            ("g", "orders", 1, "topic_messages_p20200101t0000")
        ]


def test_retire_leaves_what_the_database_refuses(runtime: str) -> None:
    """retire past its retention on an injected clock: the topic day no group has read stays (within the database's
    floor), the rest goes, and retire reports no error."""
    with Store(runtime, Settings()) as store:
        store.send("orders", b"x", delay_level=1, now=T0)
        assert store.deliver_level(1, now=T0 + timedelta(seconds=1)).delivered == 1
        store.conn.commit()
        retired = store.retire(now=T0 + timedelta(days=30))
        assert {r.parent for r in retired} == {"level_segments"}
        assert _count(store, "topic_messages") == 1


@pytest.mark.parametrize("parent", PARENTS)
def test_null_bounds_are_refused(runtime: str, parent: str) -> None:
    with psycopg.connect(runtime, autocommit=True) as conn:
        for statement in (
            "SELECT delaywheel.drop_partition(%s, NULL)",
            "SELECT delaywheel.lock_partition(%s)",
            "SELECT delaywheel.lock_partition(%s, NULL, true)",
        ):
            with pytest.raises(errors.InvalidParameterValue, match="not NULL"):
                conn.execute(statement, (parent,))


def test_only_the_rolls_lane_lock_holder_locks_the_wheels_parents(runtime: str) -> None:
    with psycopg.connect(runtime) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WHEEL_LOCK)
        assert conn.execute("SELECT delaywheel.lock_partition('wheel')").fetchone() == (True,)
        assert conn.execute("SELECT delaywheel.lock_partition('wheel_far_segments')").fetchone() == (True,)
        with pytest.raises(errors.InvalidParameterValue):
            conn.execute("SELECT delaywheel.lock_partition('topic_messages')")
