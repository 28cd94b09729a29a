"""The wheel's cursor under an old transaction (issue 19, item 2; migrations/021): every pass appends an entry instead of
updating one row, so reading the cursor costs the same few buffers after thousands of passes while a transaction
keeps every entry on disk; the log is trimmed by the passes; the runtime may append and trim, never rewrite."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import errors

from delaywheel import Store
from delaywheel.deliver import wheel
from delaywheel.deliver.wheel import CURSOR, TRIM_EVERY
from delaywheel.migrate import RUNTIME_ROLE
from delaywheel.produce.validation import Message
from tests.helpers import deliveries, syncs, traced

PASSES = 2 * TRIM_EVERY + 300  # two trims, and entries past the last one
# The newest entry through the primary key read backwards: the index's root and rightmost leaf, one heap page.
CURSOR_BUFFERS = 3
# The view under the old name: wheel_roll's one page, and each of its five cursor columns read as CURSOR is.
STATE_BUFFERS = 1 + 5 * CURSOR_BUFFERS


def buffers(conn: psycopg.Connection, query: str) -> int:
    """Shared buffers (hit or read) one execution of `query` touched."""
    row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}").fetchone()  # type: ignore[arg-type]
    assert row is not None
    plan = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def test_the_cursor_read_stays_bounded_under_an_old_transaction(db_url: str) -> None:
    """A REPEATABLE READ transaction stays open in the store's database (a report, a dump) while the wheel passes
    PASSES times on the real clock, some passes delivering. It has no xid, so it holds no delivery back
    (db.COMMIT_HORIZON), but nothing deleted or updated after its snapshot can be removed; an xid anywhere in the
    cluster (Airflow's metadata) does the same to every pass's own pruning. Before migrations/021 the cursor row then held
    one dead version per pass, and each read walked them all."""
    with Store(db_url) as store, psycopg.connect(db_url) as old:
        old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        seen = old.execute("SELECT cursor_at, cursor_id FROM delaywheel.wheel_state").fetchone()
        first = store.conn.execute(CURSOR).fetchone()
        assert first is not None and first[0] == 0  # the entry migrations/021 copied from the old row
        sent = []
        for i in range(PASSES):
            if i % 100 == 0:  # due at once: one of the next passes delivers it
                sent += store.send_many([Message("cursor.test", b"x", delay=timedelta(milliseconds=1))])
            store.advance_wheel()
        after = store.conn.execute(CURSOR).fetchone()
        assert after is not None and after[0] == PASSES
        live = store.conn.execute("SELECT min(pass), count(*) FROM delaywheel.wheel_cursor").fetchone()
        assert live == (TRIM_EVERY, PASSES - TRIM_EVERY + 1)  # a block trimmed by the passes themselves

        # the reads a pass and the cursor's readers make touch the same few buffers as on a fresh store
        assert buffers(store.conn, CURSOR) <= CURSOR_BUFFERS
        assert buffers(store.conn, "SELECT * FROM delaywheel.wheel_state") <= STATE_BUFFERS
        assert buffers(store.conn, "SELECT near_until FROM delaywheel.wheel_roll") == 1

        # ... although the trimmed entries are all still on disk (VACUUM may not remove one of them), and the old
        # snapshot still reads the cursor it read
        assert old.execute("SELECT cursor_at, cursor_id FROM delaywheel.wheel_state").fetchone() == seen
        notices: list[str] = []
        store.conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        store.conn.execute("VACUUM (VERBOSE) delaywheel.wheel_cursor")
        kept = [int(m.group(1)) for m in map(re.compile(r"(\d+) are dead but not yet removable").search, notices) if m]
        assert kept and kept[0] >= TRIM_EVERY
        old.rollback()

        assert sorted(m for m, *_ in deliveries(store, "cursor.test")) == sorted(sent)  # once each


def test_a_second_pass_from_the_same_cursor_cannot_commit(db_url: str) -> None:
    """The entry a pass appends is keyed by the one it read: a pass that read a cursor another pass has since
    moved (which the wheel's lock prevents) fails on the key, so it cannot deliver what the other delivered."""
    with Store(db_url) as store, psycopg.connect(db_url) as racer:
        entry = racer.execute(CURSOR).fetchone()
        assert entry is not None
        store.advance_wheel()
        with pytest.raises(errors.UniqueViolation):
            racer.execute(
                "INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered)"
                " VALUES (%s, %s, %s, %s::xid8, %s)",
                (entry[0] + 1, *entry[1:]),
            )


def test_the_runtime_appends_and_trims_but_never_rewrites(db_url: str) -> None:
    """Least privilege (migrations/017, migrations/021): the runtime appends entries and deletes old ones; it may not rewrite one
    or empty the log wholesale, and it row-locks the roll's row through the view as producers do."""
    with Store(db_url) as store:
        store.advance_wheel()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(f"SET ROLE {RUNTIME_ROLE}")
        for statement in ("UPDATE delaywheel.wheel_cursor SET cursor_id = 0", "TRUNCATE delaywheel.wheel_cursor"):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)  # type: ignore[arg-type]
        assert conn.execute("DELETE FROM delaywheel.wheel_cursor WHERE pass >= 0 AND pass < 1").rowcount == 1
        assert conn.execute("SELECT near_until FROM delaywheel.wheel_state FOR KEY SHARE").fetchone() is not None


def test_a_wheel_pass_is_one_round_trip(store: Store) -> None:
    """Each round trip costs the deliverer and its server process a wake-up, which waits for a CPU on a busy machine.
    A pass that delivers is one CALL (migrations/028: lock, cursor, moves, next entry, COMMIT and head), one Sync, with
    the head within an hour of the cursor or beyond it. The roll's look at `wheel_roll` is not one of them while the
    `near_until` it last read covers the roll's target (it was one more, before every pass)."""
    store.send_many([Message("t", {"n": 1}, delay=timedelta(milliseconds=50))])
    time.sleep(0.2)
    assert store.advance_wheel().delivered == 1  # creates the topic's partition,
    store.advance_wheel()  # which the next pass sees committed: from here on, a pass's common case

    def round_trips(pending: timedelta) -> int:
        """Syncs of a pass that delivers 3 timers, with one more due `pending` later."""
        store.send("t", {"n": "later"}, delay=pending)
        ids = store.send_many([Message("t", {"n": i}, delay=timedelta(milliseconds=50)) for i in range(3)])
        time.sleep(0.2)
        result, lines = traced(store.conn, store.advance_wheel)
        assert result.delivered == 3 and sorted(m[0] for m in deliveries(store, "t"))[-3:] == sorted(ids)
        assert result.next_due is not None and result.next_due > datetime.now(UTC) + pending - timedelta(seconds=5)
        return syncs(lines)

    assert round_trips(wheel.HEAD_WINDOW * 3) == 1  # nothing due within the first look's hour
    assert round_trips(timedelta(minutes=30)) == 1  # the first look finds the head


def test_a_wheel_pass_inside_the_callers_transaction_commits_with_it(store: Store) -> None:
    """On a connection already in a transaction the pass runs in a savepoint, with the same CALL committing nothing:
    what it delivered is the caller's to commit or roll back."""
    ids = store.send_many([Message("t", {"n": i}, delay=timedelta(milliseconds=50)) for i in range(2)])
    time.sleep(0.2)
    with store.conn.transaction(force_rollback=True):
        assert store.advance_wheel().delivered == 2
        assert len(deliveries(store, "t")) == 2
    assert deliveries(store, "t") == []  # rolled back with the caller's transaction
    with store.conn.transaction():
        assert store.advance_wheel().delivered == 2
    assert sorted(m[0] for m in deliveries(store, "t")) == sorted(ids)


def test_a_pass_on_a_day_without_its_topic_partition_creates_it_outside_the_pass_or_in_the_callers_transaction(
    store: Store, t0: datetime
) -> None:
    """The procedure returns before its moves when the clock's day has no topic partition (migrations/028): a Store's
    pass creates it in a transaction of its own and passes again; inside the caller's transaction the partition is
    made there, and goes with the caller's rollback."""
    day = t0 + timedelta(days=40)  # no topic partition yet
    mid = store.send("t", {"n": 1}, deliver_at=day + timedelta(seconds=1), now=day)

    def topic_partition() -> bool:
        row = store.conn.execute("SELECT delaywheel.partition_named('topic_messages', %s) IS NOT NULL", (day,))
        return bool(row.fetchone()[0])  # type: ignore[index]

    with store.conn.transaction(force_rollback=True):
        assert store.advance_wheel(now=day + timedelta(seconds=2)).delivered == 1
        assert topic_partition()
    assert not topic_partition()  # rolled back with the caller's transaction, the delivery with it
    assert store.advance_wheel(now=day + timedelta(seconds=2)).delivered == 1
    assert topic_partition() and [m[0] for m in deliveries(store, "t")] == [mid]
