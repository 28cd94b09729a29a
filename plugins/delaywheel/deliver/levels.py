"""Per-level delivery (RocketMQ 4.x's DeliverDelayedMessageTimerTask, one level per call).

A pass is one CALL (sql/level_pass.sql) and one transaction: it takes the level's advisory lock (a second deliverer of
the same level waits up to LANE_WAIT for it, then gets `busy`; cancels never hold it for long, see cancel.py), reads
the head of the level's queue in (xid, id) order below the commit horizon, moves the due prefix into the topics and
advances the checkpoint. A crash before COMMIT leaves queue, topics and checkpoint as they were; after COMMIT, all
three have moved.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from delaywheel.channels import TOPIC_CHANNEL
from delaywheel.db import COMMIT_HORIZON, PASS_PLAN, QUEUE_PLAN, in_own_transaction
from delaywheel.deliver.setaside import POISON, record
from delaywheel.locks import LEVEL_LOCK
from delaywheel.partitions import DAY, PartitionCache, floor_to
from delaywheel.pending import segment_messages
from delaywheel.types import PassResult, TopicSpan

# How long a pass that finds its lane's lock or both its turns taken waits before it reports `busy` (`take_lane`,
# sql/lanes.sql). A cancel takes each turn shared and lets it go in the same statement (cancel.await_passes: waiting
# for the pass in flight), but PostgreSQL grants a waiting request when the holder releases, before the waiter's
# process runs: on a busy machine the cancel then holds it until it is scheduled, which can take several scheduler
# ticks. The next pass takes the other turn meanwhile; it waits only when cancels hold both (one stalled for a whole
# pass, or one inside a caller's transaction). While a pass waits, later cancels queue behind it (no shared request is
# granted past a waiting exclusive one), so a stream of them cannot starve it. Another deliverer of the lane holds the
# lane's lock for a whole pass: this one then waits for that pass and runs its own, or reports busy after this long.
LANE_WAIT = "250ms"


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
# (level_segments). Sorting is priced out for the pass (QUEUE_PLAN), so the planner walks the FIFO index, unnests one
# segment at a time and stops at the LIMIT: a pass reads its batch plus at most one partly passed segment.
# `s` is the segment, `m` one of its messages; what a pass reads is this plus its select list.
_BATCH_AFTER_CURSOR = sql.SQL("""
        FROM delaywheel.level_segments s, {messages}
        WHERE s.level = %(level)s AND (s.xid, s.id_last) > (%(cxid)s::xid8, %(cid)s) AND s.xid < %(xmin)s::xid8
          AND (s.xid, m.id) > (%(cxid)s::xid8, %(cid)s)
        ORDER BY s.xid, s.id_last, m.id
        LIMIT %(limit)s
""").format(messages=segment_messages("id", "topic", "key", "tags", "properties", "body", "is_json"))


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

# The pass's planner settings: the queue read in cursor order (QUEUE_PLAN), the cancellations probed by their index
# (PASS_PLAN), and generic plans. Generic, because the move's cost estimate counts the set-aside probe (the
# properties' CASE in sql/level_pass.sql) that a custom plan folds away when %(setting_aside)s is false, so the plan
# cache would keep choosing custom plans and plan the move at every pass, most of the cost of a small pass.
PLAN = f"set_config('plan_cache_mode', 'force_generic_plan', true), {QUEUE_PLAN}, {PASS_PLAN}"
# The set-aside step's first statement: the lane's lock (waited for), the commit horizon, and the pass's settings.
_LOCK = (
    sql.SQL("SELECT pg_advisory_xact_lock(%s, %s), {horizon}::text, {plan}")
    .format(horizon=sql.SQL(COMMIT_HORIZON), plan=sql.SQL(PLAN))
    .as_string()
)
# The level's checkpoint: where its last pass left its queue, the start before its first delivery.
CURSOR = (
    "SELECT coalesce(c.cursor_xid::text, '0'), coalesce(c.cursor_id, 0)"
    " FROM (SELECT) start LEFT JOIN delaywheel.level_checkpoint c ON c.level = %(level)s"
)
# A pass is one CALL of `delaywheel.level_pass` (sql/level_pass.sql), which runs, as the wheel's (wheel._CALL): the
# planner settings (PLAN), the lane's lock (tried, then waited for up to LANE_WAIT, else busy), the commit horizon and
# the clock, the checkpoint (CURSOR), the move of the due prefix with the checkpoint's advance, COMMIT, then the head
# (pending.LEVEL_HEAD). One round trip, where sending them from here would take six statements in two pipelines.
_CALL = (
    "CALL delaywheel.level_pass(%(level)s::integer, %(injected)s::timestamptz, %(limit)s::integer, %(commit)s,"
    " %(setting_aside)s, %(lane_wait)s, %(lock_class)s::integer, %(topic_days)s::timestamptz[])"
)
_CLOCK, _MISSING = 2, 3  # of either pass's CALL row: its clock, and whether the clock's day has no topic partition


def call_pass(conn: psycopg.Connection, cache: PartitionCache, call: str, params: dict[str, object]) -> tuple[Any, ...]:
    """A pass's CALL (_CALL here, wheel._CALL) with `params` and the topic days it need not look up: those around this
    machine's clock that the cache knows (an injected or skewed clock looks). If the clock's day has no topic
    partition the procedure returned before its moves (`missing`): created here (or, in a Store's pass,
    PartitionMissing for cache.without_ddl), then the pass is called again. Returns the CALL's row."""
    today = floor_to(datetime.now(UTC), DAY)
    params = {**params, "topic_days": cache.known("topic_messages", [today - DAY, today, today + DAY])}
    row = conn.execute(call, params, prepare=False).fetchone()
    assert row is not None  # a CALL returns its one row
    if row[_MISSING]:
        cache.ensure(conn, "topic_messages", [row[_CLOCK]])
        row = conn.execute(call, params, prepare=False).fetchone()
        assert row is not None and not row[_MISSING]
    return row


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
    def deliver(setting_aside: bool) -> PassResult:  # one pass in a transaction of its own (the CALL commits)
        return in_own_transaction(conn, lambda own: _pass(conn, cache, level, now, limit, setting_aside, own=own))

    setting_aside = False
    for _ in range(3):  # more rows may turn up in the next try's batch (a newer horizon)
        try:
            return deliver(setting_aside)
        except POISON:
            if not set_aside(conn, cache, level, limit):
                raise  # nothing the store can name: the lane stops rather than skip a row
            setting_aside = True
    return deliver(setting_aside)


def set_aside(conn: psycopg.Connection, cache: PartitionCache, level: int, limit: int) -> int:
    """Set aside the rows of the level's next batch that cannot be delivered (own transaction, under the level's
    lock); returns how many there are, those set aside before included (their cast still fails the fast pass)."""
    with conn.transaction():
        row = conn.execute(  # planned as the pass is (QUEUE_PLAN): the FIFO index, not a sort of the queue
            _LOCK, (LEVEL_LOCK, level)
        ).fetchone()
        assert row is not None
        cursor = conn.execute(CURSOR, {"level": level}).fetchone()
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
    setting_aside: bool,
    *,
    own: bool,
) -> PassResult:
    """The pass as one CALL (_CALL), which commits before it reads the head when `own` (a Store's connection: the
    rows are readable without waiting for the head); in the caller's transaction otherwise. Statements in a procedure
    each take a new snapshot: the checkpoint is read after the lock is held. If the clock's
    day has no topic partition the procedure returns before the move (`missing`): created here (or, in a Store's
    pass, PartitionMissing for cache.without_ddl), then the pass runs again (call_pass)."""
    params: dict[str, object] = {
        "level": level,
        "injected": now,
        "limit": limit,
        "commit": own,
        "setting_aside": setting_aside,
        "lane_wait": LANE_WAIT,
        "lock_class": LEVEL_LOCK,
    }
    busy, waited, _, _, moved, due, scanned, summary, head = call_pass(conn, cache, _CALL, params)
    if busy:
        return PassResult(0, 0, None, busy=True)
    return PassResult(
        moved,
        due - moved,
        head,
        more=scanned == limit and due == scanned,
        topics=topic_spans(summary or {}),
        waited=waited,
    )
