"""Per-level delivery (RocketMQ 4.x's DeliverDelayedMessageTimerTask, one level per call).

A pass runs in one transaction: it takes the level's advisory lock (a second deliverer of the same
level waits up to LANE_WAIT for it, then gets `busy`; cancels never hold it for long, see cancel.py), reads the head of the level's queue in (xid, id) order below
the commit horizon, moves the due prefix into the topics and advances the checkpoint. A crash before
COMMIT leaves queue, topics and checkpoint as they were; after COMMIT, all three have moved.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors, sql

from delaywheel.db import COMMIT_HORIZON, PASS_PLAN, QUEUE_PLAN, in_own_transaction
from delaywheel.deliver.setaside import POISON, record
from delaywheel.locks import LEVEL_LOCK
from delaywheel.partitions import PartitionCache
from delaywheel.pending import LEVEL_HEAD, not_cancelled, segment_messages
from delaywheel.produce.producer import TOPIC_CHANNEL
from delaywheel.types import PassResult, TopicSpan

# How long a pass that finds its lane's lock taken waits for it before it reports `busy`. A cancel takes the lock
# shared and lets it go in the same statement (cancel.await_passes: waiting for the pass in flight), but PostgreSQL
# grants a waiting request when the holder releases, before the waiter's process runs: on a busy machine the cancel
# then holds it until it is scheduled, which took over 20 ms on two shared cores (2 busy passes in ~4,000). While a
# pass waits, later cancels queue behind it (no shared request is granted past a waiting exclusive one), so a stream
# of them cannot starve it. Another deliverer of the lane holds the lock for a whole pass: this one then waits for
# that pass and runs its own, or reports busy after this long.
LANE_WAIT = "250ms"


def take_lane(conn: psycopg.Connection, lock: tuple[int, int]) -> bool:
    """After `pg_try_advisory_xact_lock(lock)` failed in the caller's transaction: wait up to LANE_WAIT for it (in a
    savepoint, so a timeout leaves the transaction usable); True once held."""
    row = conn.execute("SELECT current_setting('lock_timeout')").fetchone()
    assert row is not None
    before = row[0]
    try:
        with conn.transaction():
            conn.execute("SELECT set_config('lock_timeout', %s, true)", (LANE_WAIT,))
            conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", lock)
    except errors.LockNotAvailable:
        return False
    conn.execute("SELECT set_config('lock_timeout', %s, true)", (before,))  # as it was, for the rest of the pass
    return True


_HORIZON_AND_CLOCK = (
    sql.SQL("SELECT {horizon}::text, coalesce(%s::timestamptz, clock_timestamp())")
    .format(horizon=sql.SQL(COMMIT_HORIZON))
    .as_string()
)


def open_pass(
    conn: psycopg.Connection,
    own: bool,
    try_lock: str,
    lock: tuple[int, int],
    now: datetime | None,
    cursor: str,
    cursor_params: tuple[object, ...] = (),
) -> tuple[str, datetime, tuple[Any, ...], bool] | None:
    """A level pass's first round trip: BEGIN when `own`, the lane's lock tried (`try_lock`
    with `lock` and `now`; its first columns the lock, the commit horizon and the clock), then the lane's cursor
    (`cursor`), read after the lock is held. If another holds the lock, wait for it (take_lane) and read the horizon,
    the clock and the cursor again. Returns (horizon, clock, cursor row, whether it waited), or None if the lane stays
    busy (the transaction rolled back when `own`)."""
    with conn.pipeline():
        if own:
            conn.execute("BEGIN")
        locking = conn.execute(try_lock, (*lock, now))
        reading = conn.execute(cursor, cursor_params)
    row = locking.fetchone()
    assert row is not None
    locked, xmin, clock = row[:3]
    if not locked:
        if not take_lane(conn, lock):
            if own:
                conn.execute("ROLLBACK")
            return None
        xmin, clock = conn.execute(_HORIZON_AND_CLOCK, (now,)).fetchone()  # type: ignore[misc]
        reading = conn.execute(cursor, cursor_params)
    state = reading.fetchone()
    assert state is not None
    return xmin, clock, state, not locked


# Per topic, what the `moved` CTE (RETURNING topic, queue_offset, xid) wrote: {topic: [count, xid, first, last]}.
# It also NOTIFYs each topic to the topic watchers (sent at COMMIT, when the rows become readable), so every
# statement that reports what it wrote into topics tells them too; PostgreSQL keeps the volatile column.
TOPIC_SUMMARY = (
    sql.SQL("""
    SELECT coalesce(jsonb_object_agg(topic, jsonb_build_array(n, x, lo, hi)), '{{}}'::jsonb)
    FROM (SELECT topic, count(*) AS n, min(xid::text) AS x, min(queue_offset) AS lo, max(queue_offset) AS hi,
                 pg_notify({channel}, topic) AS notified
          FROM moved GROUP BY topic) s
""")
    .format(channel=sql.Literal(TOPIC_CHANNEL))
    .as_string()
)


def topic_spans(summary: dict[str, list]) -> dict[str, TopicSpan]:
    """TOPIC_SUMMARY's value as spans (one pass is one transaction: one xid per topic)."""
    return {t: TopicSpan(int(n), (x, int(lo)), (x, int(hi))) for t, (n, x, lo, hi) in summary.items()}


# A level's queue in (xid, id) order: its segments in (xid, id_last) order, each one's messages in id order
# (migrations/011). Sorting is priced out for the pass (QUEUE_PLAN), so the planner walks the FIFO index, unnests one
# segment at a time and stops at the LIMIT: a pass reads its batch plus at most one partly passed segment.
# `s` is the segment, `m` one of its messages; what a pass reads is this plus its select list.
_BATCH_AFTER_CURSOR = sql.SQL("""
        FROM delaywheel.level_segments s, {messages}
        WHERE s.level = %(level)s AND (s.xid, s.id_last) > (%(cxid)s::xid8, %(cid)s) AND s.xid < %(xmin)s::xid8
          AND (s.xid, m.id) > (%(cxid)s::xid8, %(cid)s)
        ORDER BY s.xid, s.id_last, m.id
        LIMIT %(limit)s
""").format(messages=segment_messages("id", "topic", "key", "tags", "properties", "body", "is_json"))


def _deliver(properties: sql.Composable) -> str:
    """The pass's one statement, with `properties` as the expression that reads a message's properties."""
    return (
        sql.SQL("""
WITH
-- the batch after the checkpoint, and whether it is due up to each row (FIFO: the due prefix is what moves)
batch AS (
    SELECT q.*, bool_and(q.deliver_at <= %(now)s) OVER (ORDER BY q.xid, q.id_last, q.id) AS due
    FROM (
        SELECT s.xid, s.id_last, m.id, s.level, m.topic, m.key, m.tags, {properties}, m.body, m.is_json,
               s.reconsume_times, s.deliver_at
{batch}    ) q
),
-- the due prefix: the checkpoint moves past all of it
due AS (SELECT * FROM batch WHERE due),
-- into the topics, except the cancelled
moved AS (
    INSERT INTO delaywheel.topic_messages
        (topic, message_id, origin, level, key, tags, properties, body, is_json, reconsume_times,
         deliver_at, delivered_at)
    SELECT topic, id, 'level', level, key, tags, properties, body, is_json, reconsume_times,
           deliver_at, coalesce(%(injected)s::timestamptz, clock_timestamp())
    FROM due d
    WHERE {not_cancelled}
    ORDER BY xid, id_last, id
    RETURNING topic, queue_offset, xid
),
-- the checkpoint past the due prefix (its row made by the level's first delivery); untouched when nothing was due
advanced AS (
    INSERT INTO delaywheel.level_checkpoint AS c (level, cursor_xid, cursor_id, delivered, updated_at)
    SELECT %(level)s, xid, id, (SELECT count(*) FROM moved), clock_timestamp()
    FROM (SELECT xid, id FROM due ORDER BY xid DESC, id_last DESC, id DESC LIMIT 1) last
    ON CONFLICT (level) DO UPDATE SET cursor_xid = excluded.cursor_xid, cursor_id = excluded.cursor_id,
        delivered = c.delivered + excluded.delivered, updated_at = excluded.updated_at
)
SELECT (SELECT count(*) FROM moved),
       (SELECT count(*) FROM due),
       (SELECT count(*) FROM batch),
       ({topic_summary})
""")
        .format(
            properties=properties,
            batch=_BATCH_AFTER_CURSOR,
            not_cancelled=not_cancelled("d"),
            topic_summary=sql.SQL(TOPIC_SUMMARY),
        )
        .as_string()
    )


_DELIVER = _deliver(sql.SQL("m.properties::jsonb"))
# After a pass failed on a row it cannot deliver (setaside.py): the same pass, except that a message set aside has
# no properties to cast (its cast is what failed; it is cancelled, so it is passed over like any cancelled message).
_DELIVER_SETTING_ASIDE = _deliver(
    sql.SQL(
        "CASE WHEN EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id) THEN NULL"
        " ELSE m.properties::jsonb END AS properties"
    )
)

# The rows a pass would read (its batch, due or not: the batch casts every row it reads) that cannot be delivered.
_UNDELIVERABLE = (
    sql.SQL("""
SELECT b.id, 'level', b.level, b.topic, b.key, b.deliver_at, u.reason, u.detail, b.tags, b.properties, b.body,
       b.is_json, b.reconsume_times
FROM (
    SELECT s.level, s.reconsume_times, s.deliver_at, m.*
{batch}) b, LATERAL delaywheel.undeliverable(b.topic, b.body, b.is_json, b.properties) u
WHERE u.reason IS NOT NULL
""")
    .format(batch=_BATCH_AFTER_CURSOR)
    .as_string()
)

# The pass's first statement: the lane's lock (tried; set_aside waits for it), the commit horizon and the clock, and
# the planner settings for reading the queue in cursor order (QUEUE_PLAN) and probing the cancellations (PASS_PLAN).
_PLAN = sql.SQL(f"{QUEUE_PLAN}, {PASS_PLAN}")
_TRY_LOCK = (
    sql.SQL(
        "SELECT pg_try_advisory_xact_lock(%s, %s), {horizon}::text, coalesce(%s::timestamptz,"
        " clock_timestamp()), {plan}"
    )
    .format(horizon=sql.SQL(COMMIT_HORIZON), plan=_PLAN)
    .as_string()
)
_LOCK = (
    sql.SQL("SELECT pg_advisory_xact_lock(%s, %s), {horizon}::text, {plan}")
    .format(horizon=sql.SQL(COMMIT_HORIZON), plan=_PLAN)
    .as_string()
)
# The level's checkpoint: where its last pass left its queue, the start before its first delivery.
_CURSOR = (
    "SELECT coalesce(c.cursor_xid::text, '0'), coalesce(c.cursor_id, 0)"
    " FROM (SELECT) start LEFT JOIN delaywheel.level_checkpoint c ON c.level = %s"
)


def levels_above(conn: psycopg.Connection, level: int) -> list[int]:
    """Levels above `level` that still hold rows: what is left when the level table is shortened while
    messages are pending. One index probe per level found (a loose index scan), so it costs nothing
    when there are none."""
    rows = conn.execute(
        """WITH RECURSIVE l(level) AS (
               (SELECT level FROM delaywheel.level_segments WHERE level > %(l)s ORDER BY level LIMIT 1)
               UNION ALL
               SELECT (SELECT q.level FROM delaywheel.level_segments q WHERE q.level > l.level ORDER BY q.level LIMIT 1)
               FROM l WHERE l.level IS NOT NULL)
           SELECT level FROM l WHERE level IS NOT NULL""",
        {"l": level},
    ).fetchall()
    return [int(r[0]) for r in rows]


def deliver_level(
    conn: psycopg.Connection,
    cache: PartitionCache,
    level: int,
    *,
    now: datetime | None = None,
    limit: int = 5000,
) -> PassResult:
    """Deliver the due head of one level's queue; see the module docstring for the guarantees. A row the pass
    cannot deliver is set aside (setaside.py) and the pass runs again: the level never stops on it. The day's topic
    partition is created before the pass, never inside it (`PartitionCache.without_ddl`)."""
    return cache.without_ddl(conn, lambda: _deliver_or_set_aside(conn, cache, level, now, limit))


def _deliver_or_set_aside(
    conn: psycopg.Connection, cache: PartitionCache, level: int, now: datetime | None, limit: int
) -> PassResult:
    statement = _DELIVER

    def deliver() -> PassResult:  # one pass in a transaction of its own: BEGIN and COMMIT in its pipelines
        return in_own_transaction(conn, lambda own: _pass(conn, cache, level, now, limit, statement, own=own))

    for _ in range(3):  # more rows may turn up in the next try's batch (a newer horizon)
        try:
            return deliver()
        except POISON:
            if not set_aside(conn, cache, level, limit):
                raise  # nothing the store can name: the lane stops, as before, rather than skip a row
            statement = _DELIVER_SETTING_ASIDE
    return deliver()


def set_aside(conn: psycopg.Connection, cache: PartitionCache, level: int, limit: int) -> int:
    """Set aside the rows of the level's next batch that cannot be delivered (own transaction, under the level's
    lock); returns how many there are, those set aside before included (their cast still fails the fast pass)."""
    with conn.transaction():
        row = conn.execute(  # planned as the pass is (QUEUE_PLAN): the FIFO index, not a sort of the queue
            _LOCK, (LEVEL_LOCK, level)
        ).fetchone()
        assert row is not None
        cursor = conn.execute(_CURSOR, (level,)).fetchone()
        assert cursor is not None
        bad = conn.execute(
            _UNDELIVERABLE,
            {"level": level, "cxid": cursor[0], "cid": cursor[1], "xmin": row[1], "limit": limit},
        ).fetchall()
        return record(conn, cache, bad)


def _pass(
    conn: psycopg.Connection,
    cache: PartitionCache,
    level: int,
    now: datetime | None,
    limit: int,
    statement: str,
    *,
    own: bool,
) -> PassResult:
    """The pass's statements in two pipelines, each one round trip, as the wheel's pass (wheel._pass): the lock, the
    horizon and the clock with the checkpoint (BEGIN first when `own`); the move, which also advances the checkpoint
    (COMMIT next when `own`), and the head after it. It was eight round trips, and a full deliverer passes every level
    at start, the wheel last. Statements still run one after another, each with its own snapshot, so the
    checkpoint is read after the lock is held."""
    opened = open_pass(conn, own, _TRY_LOCK, (LEVEL_LOCK, level), now, _CURSOR, (level,))
    if opened is None:
        return PassResult(0, 0, None, busy=True)
    xmin, clock, cursor, waited = opened
    cache.ensure(conn, "topic_messages", [clock])
    params = {
        "now": clock,
        "injected": now,
        "level": level,
        "cxid": cursor[0],
        "cid": cursor[1],
        "xmin": xmin,
        "limit": limit,
    }
    with conn.pipeline():
        moving = conn.execute(statement, params)
        if own:
            conn.execute("COMMIT")  # before the head: the rows are readable without waiting for it
        heading = conn.execute(LEVEL_HEAD, {"level": level})  # after the checkpoint the move wrote
    moved, due, scanned, summary = moving.fetchone()  # type: ignore[misc]
    head = heading.fetchone()
    return PassResult(
        moved,
        due - moved,
        head[0] if head else None,
        more=scanned == limit and due == scanned,
        topics=topic_spans(summary),
        waited=waited,
    )
