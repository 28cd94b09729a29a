"""No transaction of the store's own creates a partition while it holds or waits for another table.

Creating a partition locks its parent ACCESS EXCLUSIVE until the creator commits. CI (2026-11-27) deadlocked on a
fresh database: a level pass had created the day's topic partition inside its transaction and waited to read
level_segments, behind `prepare`, which had created an hour of level_segments in its transaction and waited for the
topic partitions' creation lock the pass held. Each test below stops one of those transactions where it waits (a
second connection holds what it needs) and checks, in pg_locks, that it holds no partition creation: each would have
failed before the fix (`PartitionCache.without_ddl`; `Store.prepare` committing each partition on its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta

import psycopg
import pytest

from delaywheel import Message, Store
from delaywheel.partitions import WIDTH, floor_to
from tests.helpers import wait_for_lock

# The locks of a backend that creating a partition takes: its parent's ACCESS EXCLUSIVE, and the per-parent
# advisory lock of delaywheel.ensure_partition (one bigint key: hashtext of 'delaywheel.partition.' || parent).
_CREATION_LOCKS = """
SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
WHERE l.pid = %(pid)s AND l.granted AND l.mode = 'AccessExclusiveLock' AND c.relname = ANY(%(parents)s)
UNION ALL
SELECT p.parent FROM pg_locks l
JOIN unnest(%(parents)s::text[]) p(parent)
  ON l.objid::bigint = hashtext('delaywheel.partition.' || p.parent)::bigint & 4294967295
WHERE l.pid = %(pid)s AND l.granted AND l.locktype = 'advisory' AND l.objsubid = 1
"""


def creating(watch: psycopg.Connection, pid: int) -> list[str]:
    """The parents `pid` holds a partition creation on (none, when it creates each in a transaction of its own)."""
    rows = watch.execute(_CREATION_LOCKS, {"pid": pid, "parents": list(WIDTH)}).fetchall()
    return sorted({r[0] for r in rows})


def partition_exists(watch: psycopg.Connection, parent: str, at: datetime) -> bool:
    lo = floor_to(at, WIDTH[parent])
    row = watch.execute("SELECT delaywheel.partition_named(%s, %s) IS NOT NULL", (parent, lo)).fetchone()
    return bool(row and row[0])


@contextmanager
def held(url: str, statement: str) -> Iterator[None]:
    """`statement` run in a transaction of a connection of its own, kept open for the block."""
    with psycopg.connect(url) as holder:
        holder.execute(statement)
        yield
        holder.rollback()


def blocked(pool: ThreadPoolExecutor, store: Store, call: Callable[[], object], watch: psycopg.Connection) -> Future:
    """`call` on the pool's thread, returned once the store's connection waits for a lock."""
    pid = store.conn.info.backend_pid  # (the connection opened here, not by both threads at once)
    running = pool.submit(call)
    wait_for_lock(watch, pid, "the call", 60)
    return running


@pytest.mark.parametrize("lane", [1, None], ids=["level", "wheel"])
def test_a_pass_creates_the_days_topic_partition_before_its_transaction(
    db_url: str, store: Store, t0: datetime, lane: int | None
) -> None:
    store.send(
        "orders", {"n": 1}, delay_level=1 if lane else None, delay=None if lane else timedelta(minutes=5), now=t0
    )
    due = t0 + timedelta(days=1)  # a day with no topic partition yet
    with (
        ThreadPoolExecutor(1) as pool,
        psycopg.connect(db_url, autocommit=True) as watch,
        held(db_url, "LOCK delaywheel.cancellations"),  # the pass waits to read them
    ):
        assert not partition_exists(watch, "topic_messages", due)
        pass_ = (lambda: store.deliver_level(1, now=due)) if lane else (lambda: store.advance_wheel(now=due))
        running = blocked(pool, store, pass_, watch)
        assert creating(watch, store.conn.info.backend_pid) == []  # was ['topic_messages']
        assert partition_exists(watch, "topic_messages", due)  # created and committed before the pass
    running.result(30)
    assert store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone() == (1,)


def test_prepare_holds_no_new_partition_while_it_waits_to_create_another(
    db_url: str, store: Store, t0: datetime
) -> None:
    with (
        ThreadPoolExecutor(1) as pool,
        psycopg.connect(db_url, autocommit=True) as watch,
        held(db_url, "SELECT pg_advisory_xact_lock(hashtext('delaywheel.partition.topic_messages'))"),
    ):
        running = blocked(pool, store, lambda: store.prepare(now=t0), watch)  # waits to create the topic partition
        assert creating(watch, store.conn.info.backend_pid) == []  # was ['level_segments']
        assert all(partition_exists(watch, "level_segments", t0 + timedelta(hours=h)) for h in range(3))
    running.result(30)
    with psycopg.connect(db_url, autocommit=True) as watch:
        assert partition_exists(watch, "topic_messages", t0)
        assert partition_exists(watch, "topic_messages", t0 + timedelta(days=1))


def test_a_send_creates_each_partition_in_a_transaction_of_its_own(db_url: str, store: Store, t0: datetime) -> None:
    batch = [Message("orders", {"n": 1}), Message("orders", {"n": 2}, delay_level=3)]  # direct, then a level
    with (
        ThreadPoolExecutor(1) as pool,
        psycopg.connect(db_url, autocommit=True) as watch,
        held(db_url, "LOCK delaywheel.level_segments"),  # the send waits to create the level's partition
    ):
        running = blocked(pool, store, lambda: store.send_many(batch, now=t0), watch)
        # only the level partition's creation, in a transaction of its own; was also the topic's, created in the send's
        assert creating(watch, store.conn.info.backend_pid) == ["level_segments"]
        assert partition_exists(watch, "topic_messages", t0)
    running.result(30)
    rows = store.conn.execute(
        "SELECT (SELECT count(*) FROM delaywheel.topic_messages), (SELECT count(*) FROM delaywheel.level_queue)"
    ).fetchone()
    assert rows == (1, 1)  # the write went again once the partitions were there, and wrote each message once
