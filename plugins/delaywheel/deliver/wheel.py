"""The timing wheel: any due time up to `wheel_max_delay`, delivered no sooner than its exact time.

Cursor rule (TimerCheckpoint, the newest entry of `wheel_cursor`): every row with (deliver_at, id) <= cursor and
xid < horizon_xid is delivered or cancelled. A pass first delivers *stragglers* — rows for times the
cursor already passed, whose transactions committed after the last pass — then the due range after
the cursor, reading only rows below the commit horizon (xmin), then appends the next entry with horizon_xid = xmin.
Rows moved by the roll get the roller's xid, so they are stragglers or ahead of the cursor: never lost.

The cursor is appended, never updated (migrations/021): an updated row keeps one dead version per pass while any
transaction in the cluster is old, and every read of it walked them all. The newest entry is the first in the
primary key read backwards, so the pass's one read of it costs the same few buffers however old that transaction.
"""

from __future__ import annotations

import contextlib
from datetime import datetime

import psycopg
from psycopg import errors, sql

from delaywheel.config import Settings
from delaywheel.db import COMMIT_HORIZON, QUEUE_PLAN
from delaywheel.deliver.levels import TOPIC_SUMMARY, take_lane, topic_spans
from delaywheel.deliver.setaside import POISON, record
from delaywheel.locks import WHEEL_LOCK
from delaywheel.partitions import DAY, HOUR, PartitionCache, floor_to
from delaywheel.pending import not_cancelled, segment_messages, wheel_head
from delaywheel.types import PassResult

MAX_ID = 2**63 - 1
# The cursor as the last pass left it (migrations/021: the first entry of the primary key read backwards).
CURSOR = (
    "SELECT pass, cursor_at, cursor_id, horizon_xid::text, delivered FROM delaywheel.wheel_cursor"
    " ORDER BY pass DESC LIMIT 1"
)
# The pass that appends entry n, n a multiple of TRIM_EVERY, deletes entries [n - 2 * TRIM_EVERY, n - TRIM_EVERY):
# every block once, the newest never, and by a bounded range (one open at its low end would walk every entry an old
# transaction still keeps on disk). The log holds 1,000-2,000 entries, and more only while such a transaction lasts.
TRIM_EVERY = 1000

# Wheel rows `d` into the topics, except the cancelled. {rows}: the stragglers, or the due batch.
_MOVE = sql.SQL("""
INSERT INTO delaywheel.topic_messages
    (topic, message_id, origin, key, tags, properties, body, is_json, deliver_at, delivered_at)
SELECT topic, id, 'wheel', key, tags, properties, body, is_json, deliver_at,
       coalesce(%(injected)s::timestamptz, clock_timestamp())
FROM ({rows}) d
WHERE {not_cancelled}
ORDER BY deliver_at, id
""")
_STRAGGLERS = sql.SQL("""
    SELECT * FROM delaywheel.wheel
    WHERE xid >= %(horizon)s::xid8 AND xid < %(xmin)s::xid8 AND deliver_at <= %(cursor_at)s
      AND (deliver_at, id) <= (%(cursor_at)s, %(cursor_id)s)
""")
_DUE = sql.SQL("""
    SELECT * FROM delaywheel.wheel
    WHERE deliver_at >= %(cursor_at)s AND (deliver_at, id) > (%(cursor_at)s, %(cursor_id)s)
      AND deliver_at <= %(now)s AND xid < %(xmin)s::xid8
    ORDER BY deliver_at, id
    LIMIT %(limit)s
""")
# The pass's two moves, each reporting what it wrote (TOPIC_SUMMARY): the stragglers, then the due batch.
_MOVE_STRAGGLERS = (
    sql.SQL("""
WITH
-- rows behind the cursor whose transactions committed after the last pass, into the topics
moved AS ({move} RETURNING topic, queue_offset, xid)
SELECT (SELECT count(*) FROM moved), ({summary})
""")
    .format(move=_MOVE.format(rows=_STRAGGLERS, not_cancelled=not_cancelled("d")), summary=sql.SQL(TOPIC_SUMMARY))
    .as_string()
)
_MOVE_DUE = (
    sql.SQL("""
WITH
-- the due batch after the cursor, in (deliver_at, id) order
due AS ({due}),
-- into the topics
moved AS ({move} RETURNING topic, queue_offset, xid)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM due),
       (SELECT deliver_at FROM due ORDER BY deliver_at DESC, id DESC LIMIT 1),
       (SELECT id FROM due ORDER BY deliver_at DESC, id DESC LIMIT 1), ({summary})
""")
    .format(
        due=_DUE,
        move=_MOVE.format(rows=sql.SQL("SELECT * FROM due"), not_cancelled=not_cancelled("d")),
        summary=sql.SQL(TOPIC_SUMMARY),
    )
    .as_string()
)
# The head after a pass, from the cursor entry it appended (pending.wheel_head: sensors read it from wheel_state).
_HEAD_AFTER = wheel_head(
    sql.Placeholder("at"),
    sql.Placeholder("id"),
    sql.SQL("{}::xid8").format(sql.Placeholder("xmin")),
    sql.SQL("{}::timestamptz").format(sql.Placeholder("clock")),
).as_string()
# The lane's lock (tried by the pass, waited for by the set-aside step), with the commit horizon and the clock.
_LOCK = sql.SQL("SELECT {lock}(%s, %s), {horizon}::text, coalesce(%s::timestamptz, clock_timestamp())")
_TRY_LOCK = _LOCK.format(lock=sql.SQL("pg_try_advisory_xact_lock"), horizon=sql.SQL(COMMIT_HORIZON)).as_string()
_WAIT_LOCK = _LOCK.format(lock=sql.SQL("pg_advisory_xact_lock"), horizon=sql.SQL(COMMIT_HORIZON)).as_string()
_HORIZON_AND_CLOCK = (
    sql.SQL("SELECT {horizon}::text, coalesce(%s::timestamptz, clock_timestamp())")
    .format(horizon=sql.SQL(COMMIT_HORIZON))
    .as_string()
)
_QUEUE_PLAN = sql.SQL("SELECT {}").format(sql.SQL(QUEUE_PLAN)).as_string()

_ALL = ("id", "topic", "key", "tags", "properties", "body", "is_json", "due")


def _roll_block(block: str, only: sql.Composable) -> sql.Composed:
    """A far block's messages (`only` those) into the near wheel (the roll); `block`: its partition's name."""
    return sql.SQL("""
INSERT INTO delaywheel.wheel (id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at)
SELECT m.id, m.topic, m.key, m.tags, m.properties::jsonb, m.body, m.is_json, m.due AT TIME ZONE 'UTC', s.enqueued_at
FROM {block} s, {messages}
{only}
""").format(block=sql.Identifier("delaywheel", block), messages=segment_messages(*_ALL), only=only)


# After a roll failed on a row it cannot deliver: the same, without the rows set aside (setaside.py).
_NOT_SET_ASIDE = sql.SQL("WHERE NOT EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id)")
# The far blocks' messages the roll would move that cannot be delivered.
_FAR_UNDELIVERABLE = sql.SQL("""
SELECT m.id, 'wheel', NULL::smallint, m.topic, m.key, m.due AT TIME ZONE 'UTC', u.reason, u.detail, m.tags,
       m.properties, m.body, m.is_json, 0
FROM delaywheel.wheel_far_segments s, {messages},
     LATERAL delaywheel.undeliverable(m.topic, m.body, m.is_json, m.properties) u
WHERE s.block < %(target)s AND u.reason IS NOT NULL
""").format(messages=segment_messages(*_ALL))
# The rows a wheel pass would read ({rows}: its stragglers, or its due batch) that cannot be delivered and are not
# cancelled.
_UNDELIVERABLE = sql.SQL("""
SELECT d.id, 'wheel', NULL::smallint, d.topic, d.key, d.deliver_at, u.reason, u.detail, d.tags, d.properties::text,
       d.body, d.is_json, 0
FROM ({rows}) d, LATERAL delaywheel.undeliverable(d.topic, d.body, d.is_json, d.properties::text) u
WHERE u.reason IS NOT NULL AND {not_cancelled}
""")
_UNDELIVERABLE_STRAGGLERS = _UNDELIVERABLE.format(rows=_STRAGGLERS, not_cancelled=not_cancelled("d"))
_UNDELIVERABLE_DUE = _UNDELIVERABLE.format(rows=_DUE, not_cancelled=not_cancelled("d"))


def roll(conn: psycopg.Connection, settings: Settings, cache: PartitionCache, now: datetime | None = None) -> int:
    """Move far blocks that entered the near window into the fine wheel; returns rows moved. A row that cannot be
    delivered is set aside (setaside.py) instead of stopping the roll, hence every wheel pass."""
    try:
        return _roll(conn, settings, cache, now, sql.SQL(""))
    except POISON:
        if not _set_aside_far(conn, settings, cache, now):
            raise  # nothing the store can name: the roll fails, as before, rather than skip a row
    return _roll(conn, settings, cache, now, _NOT_SET_ASIDE)


def _roll_target(clock: datetime, settings: Settings) -> datetime:
    return floor_to(clock + settings.wheel_near_window, DAY) + DAY


def _set_aside_far(conn: psycopg.Connection, settings: Settings, cache: PartitionCache, now: datetime | None) -> int:
    """Set aside the messages of the far blocks the roll moves that cannot be delivered; returns how many."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WHEEL_LOCK)
        row = conn.execute("SELECT coalesce(%s::timestamptz, clock_timestamp())", (now,)).fetchone()
        assert row is not None
        bad = conn.execute(_FAR_UNDELIVERABLE, {"target": _roll_target(row[0], settings)}).fetchall()
        return record(conn, cache, bad)


def _roll(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, now: datetime | None, only: sql.Composable
) -> int:
    moved = 0
    clock, near_until = conn.execute(  # type: ignore[misc]
        "SELECT coalesce(%s::timestamptz, clock_timestamp()), near_until FROM delaywheel.wheel_roll", (now,)
    ).fetchone()
    target = _roll_target(clock, settings)
    if near_until >= target:  # nothing to roll (the common case): skip the locking transaction below
        return 0
    with conn.transaction():
        locked = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", WHEEL_LOCK).fetchone()
        # a producer still in its transaction (it holds wheel_roll's row FOR KEY SHARE, through wheel_state, or a
        # far block): roll next pass
        conn.execute("SET LOCAL lock_timeout = '5s'")
        state = conn.execute("SELECT near_until FROM delaywheel.wheel_roll FOR UPDATE").fetchone()
        if not locked or not locked[0] or state is None or state[0] >= target:
            return 0
        # Creating and dropping partitions takes ACCESS EXCLUSIVE on the parents: take it first, in the order
        # producers lock them (wheel, then wheel_far_segments). Taken later, after a far block's lock, it deadlocks
        # with a producer that holds the parent and waits for the block (seen in bench/airflow_lateness).
        conn.execute(
            "SELECT delaywheel.lock_partition('wheel'); SELECT delaywheel.lock_partition('wheel_far_segments')"
        )
        start = max(floor_to(clock, HOUR), state[0])
        hours = int((target - start) / HOUR) if target > start else 0
        cache.ensure(conn, "wheel", [start + HOUR * i for i in range(hours)])
        blocks = conn.execute(
            "SELECT name, lo, hi FROM delaywheel.partitions WHERE parent = 'wheel_far_segments' AND lo < %s ORDER BY lo",
            (target,),
        ).fetchall()
        for name, lo, hi in blocks:
            conn.execute("SELECT delaywheel.lock_partition('wheel_far_segments', %s)", (lo,))  # migrations/017
            cache.ensure(conn, "wheel", [lo + HOUR * i for i in range(int((hi - lo) / HOUR))])
            cur = conn.execute(_roll_block(name, only))
            moved += cur.rowcount
            conn.execute("SELECT delaywheel.drop_partition('wheel_far_segments', %s)", (lo,))
            cache.forget("wheel_far_segments", lo)
        conn.execute("UPDATE delaywheel.wheel_roll SET near_until = %s", (target,))
    return moved


def advance_wheel(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    *,
    now: datetime | None = None,
    limit: int = 5000,
) -> PassResult:
    """One pass over the wheel; see the module docstring for the guarantees. A row the pass cannot deliver is set
    aside (setaside.py) and the pass runs again: the wheel never stops on it."""
    with contextlib.suppress(errors.LockNotAvailable):  # a producer holds a far block: roll next pass
        roll(conn, settings, cache, now)
    for _ in range(3):  # more rows may turn up in the next try's batch (a newer horizon)
        try:
            return _advance(conn, cache, now, limit)
        except POISON:
            if not _set_aside_due(conn, cache, now, limit):
                raise  # nothing the store can name: the lane stops, as before, rather than skip a row
    return _advance(conn, cache, now, limit)


def _set_aside_due(conn: psycopg.Connection, cache: PartitionCache, now: datetime | None, limit: int) -> int:
    """Set aside the rows the next pass reads that cannot be delivered (own transaction, under the wheel's lock);
    returns how many (not counting those already cancelled, which the pass skips anyway)."""
    with conn.transaction():
        row = conn.execute(_WAIT_LOCK, (*WHEEL_LOCK, now)).fetchone()
        assert row is not None
        _, xmin, clock = row
        state = conn.execute(CURSOR).fetchone()
        assert state is not None
        _, cursor_at, cursor_id, horizon, _ = state
        params = {
            "now": clock,
            "xmin": str(max(int(xmin), int(horizon))),
            "horizon": horizon,
            "cursor_at": cursor_at,
            "cursor_id": cursor_id,
            "limit": limit,
        }
        bad = conn.execute(_UNDELIVERABLE_STRAGGLERS, params).fetchall()
        conn.execute(_QUEUE_PLAN)  # as the pass plans its due batch (after its stragglers)
        bad += conn.execute(_UNDELIVERABLE_DUE, params).fetchall()
        return record(conn, cache, bad)


def _advance(conn: psycopg.Connection, cache: PartitionCache, now: datetime | None, limit: int) -> PassResult:
    with conn.transaction():
        row = conn.execute(_TRY_LOCK, (*WHEEL_LOCK, now)).fetchone()
        assert row is not None
        locked, xmin, clock = row
        if not locked:
            if not take_lane(conn, WHEEL_LOCK):
                return PassResult(0, 0, None, busy=True)
            xmin, clock = conn.execute(_HORIZON_AND_CLOCK, (now,)).fetchone()  # type: ignore[misc]
        # Read once, after the lock: the previous holder's entry is visible to this statement's snapshot. Nothing
        # locks it (producers lock wheel_roll's row, not the cursor): the entry this pass appends is keyed by the
        # one read here, so a second pass that read the same entry could not commit.
        state = conn.execute(CURSOR).fetchone()
        assert state is not None
        entry, cursor_at, cursor_id, horizon, total = state
        # The horizon only moves forward. Every xid below the stored horizon had ended when it was taken, so
        # the larger of the two is still a valid horizon; taking a smaller one (the commit horizon can dip, see
        # db.COMMIT_HORIZON) would make rows already delivered by the due step look like stragglers again.
        xmin = str(max(int(xmin), int(horizon)))
        if clock < cursor_at:  # an injected clock went backwards: deliver nothing rather than early
            return PassResult(0, 0, cursor_at)
        cache.ensure(conn, "topic_messages", [clock])
        params = {
            "injected": now,
            "now": clock,
            "xmin": xmin,
            "horizon": horizon,
            "cursor_at": cursor_at,
            "cursor_id": cursor_id,
            "limit": limit,
        }
        stragglers, straggled = conn.execute(_MOVE_STRAGGLERS, params).fetchone()  # type: ignore[misc]
        # After the stragglers: they have no index in due order, and priced-out sorting would make the planner
        # walk the whole due index up to the cursor to avoid sorting them.
        conn.execute(_QUEUE_PLAN)
        moved, due_count, last_at, last_id, summary = conn.execute(_MOVE_DUE, params).fetchone()  # type: ignore[misc]
        full = due_count == limit
        new_at, new_id = (last_at, last_id) if full else (clock, MAX_ID)
        delivered = stragglers + moved
        conn.execute(
            "INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered)"
            " VALUES (%s, %s, %s, %s::xid8, %s)",
            (entry + 1, new_at, new_id, xmin, total + delivered),
        )
        if (entry + 1) % TRIM_EVERY == 0:
            conn.execute(
                "DELETE FROM delaywheel.wheel_cursor WHERE pass >= %s AND pass < %s",
                (entry + 1 - 2 * TRIM_EVERY, entry + 1 - TRIM_EVERY),
            )
        head = (
            (clock,)
            if full
            else conn.execute(  # full: more is due now, the caller looks again at once
                _HEAD_AFTER,
                {"at": new_at, "id": new_id, "clock": clock, "xmin": xmin},
            ).fetchone()
        )
    topics = topic_spans(straggled)  # stragglers were written first, in the same transaction
    for topic, span in topic_spans(summary).items():
        topics[topic] = topics[topic].merge(span) if topic in topics else span
    return PassResult(delivered, due_count - moved, head[0] if head else None, more=full, topics=topics)
