"""The timing wheel: any due time up to `wheel_max_delay`, delivered no sooner than its exact time.

Cursor rule (TimerCheckpoint, the newest entry of `wheel_cursor`): every row with (deliver_at, id) <= cursor and
xid < horizon_xid is delivered or cancelled. A pass first delivers *stragglers* — rows for times the
cursor already passed, whose transactions committed after the last pass — then the due range after
the cursor, reading only rows below the commit horizon (xmin), then appends the next entry with horizon_xid = xmin.
Rows moved by the roll get the roller's xid, so they are stragglers or ahead of the cursor: never lost.

The cursor is appended, never updated (wheel_cursor): an updated row keeps one dead version per pass while any
transaction in the cluster is old, and every read of it would walk them all. The newest entry is the first in the
primary key read backwards, so the pass's one read of it costs the same few buffers however old that transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

import psycopg
from psycopg import errors, sql

from delaywheel.config import Settings
from delaywheel.db import COMMIT_HORIZON, PASS_PLAN, QUEUE_PLAN, in_own_transaction
from delaywheel.deliver import levels
from delaywheel.deliver.levels import topic_spans
from delaywheel.deliver.setaside import POISON, record
from delaywheel.locks import WHEEL_LOCK
from delaywheel.partitions import DAY, HOUR, PartitionCache, floor_to
from delaywheel.pending import not_cancelled, segment_messages
from delaywheel.types import PassResult

# The cursor as the last pass left it (the first entry of wheel_cursor's primary key read backwards).
CURSOR = (
    "SELECT pass, cursor_at, cursor_id, horizon_xid::text, delivered FROM delaywheel.wheel_cursor"
    " ORDER BY pass DESC LIMIT 1"
)
# The pass that appends entry n, n a multiple of TRIM_EVERY, deletes entries [n - 2 * TRIM_EVERY, n - TRIM_EVERY):
# every block once, the newest never, and by a bounded range (one open at its low end would walk every entry an old
# transaction still keeps on disk). The log holds 1,000-2,000 entries, and more only while such a transaction lasts.
TRIM_EVERY = 1000

# The wheel's rows a pass reads (the set-aside step too): the stragglers, and the due batch after the cursor.
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
# The head after a pass is looked for first among the near rows due within HEAD_WINDOW of the cursor (one or two
# partitions), then, only if none is there, among all of them (pending.wheel_head, in sql/wheel_pass.sql).
HEAD_WINDOW = HOUR
# A pass is one CALL of `delaywheel.wheel_pass` (sql/wheel_pass.sql), which runs in this order: the lane's lock
# (tried, then waited for up to levels.LANE_WAIT), the commit horizon and the clock, CURSOR, the stragglers' move,
# QUEUE_PLAN, the due batch's move, the cursor's next entry (and every TRIM_EVERY entries the trim of an old block),
# COMMIT, then the head. QUEUE_PLAN comes after the stragglers' move: they have no index in due order, and
# priced-out sorting would make the planner walk the whole due index up to the cursor to avoid sorting them.
# One round trip, where sending them from here would take nine statements in three pipelines. Not prepared, as
# cancel's CALL: the plans worth keeping are the procedure's own.
_CALL = (
    "CALL delaywheel.wheel_pass(%(injected)s::timestamptz, %(limit)s::integer, %(commit)s, %(lane_wait)s,"
    " %(head_window)s::interval, %(trim_every)s::bigint, %(lock_class)s::integer, %(lock_key)s::integer,"
    " %(topic_days)s::timestamptz[])"
)
# The lane's lock, waited for by the set-aside step, with the commit horizon and the clock, and the pass's planner
# settings (as wheel_pass sets them, below): generic plans, and the cancellations probed by their index
# (db.PASS_PLAN). Generic, because the stragglers' move would otherwise be planned again at every pass, over the near
# wheel's partitions, and that server time is spent before the due batch's move, hence in every due row's lateness:
# the planner prices a generic plan as reading every partition, not knowing that executor start-up prunes those past
# the cursor, so it would keep choosing custom plans.
_WAIT_LOCK = (
    sql.SQL(
        "SELECT pg_advisory_xact_lock(%s, %s), {horizon}::text, coalesce(%s::timestamptz, clock_timestamp()),"
        " set_config('plan_cache_mode', 'force_generic_plan', true), {pass_plan}"
    )
    .format(horizon=sql.SQL(COMMIT_HORIZON), pass_plan=sql.SQL(PASS_PLAN))
    .as_string()
)
_QUEUE_PLAN = sql.SQL("SELECT {}").format(sql.SQL(QUEUE_PLAN)).as_string()

_ALL = ("id", "topic", "key", "tags", "properties", "body", "is_json", "due")


def _roll_rows(segments: sql.Composable, only: sql.Composable) -> sql.Composed:
    """Far segments' messages (`only` those) into the near wheel: the roll's one insert. `segments`: a far block's
    partition, or the rows a slice took out of one."""
    return sql.SQL("""
INSERT INTO delaywheel.wheel (id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at)
SELECT m.id, m.topic, m.key, m.tags, m.properties::jsonb, m.body, m.is_json, m.due AT TIME ZONE 'UTC', s.enqueued_at
FROM {segments} s, {messages}
{only}
""").format(segments=segments, messages=segment_messages(*_ALL), only=only)


# After a roll failed on a row it cannot deliver: the same, without the rows set aside (setaside.py).
_NOT_SET_ASIDE = sql.SQL("WHERE NOT EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id)")
# A slice of far block %(block)s: its next segments in table order after %(after)s (a position, _RESUME), at most
# %(messages)s of them, and of those the ones read before the messages counted reached %(messages)s; so fewer than
# %(messages)s messages plus one segment's (at most 1,000: producer.SEGMENT_MAX). A TID range scan from the position:
# the segments earlier slices moved, dead in the block until the roll drops it, are not read again.
_PICKED = sql.SQL("""
    SELECT ctid FROM (
        SELECT ctid, n, sum(n) OVER (ROWS UNBOUNDED PRECEDING) AS upto
        FROM (SELECT ctid, n FROM delaywheel.wheel_far_segments
              WHERE block = %(block)s AND ctid > %(after)s::tid LIMIT %(messages)s) c) w
    WHERE upto - n < %(messages)s""")
# One slice into the near wheel, in one statement: (rows moved, messages taken out of the block, the last segment's
# position), all zero and NULL when the block has nothing after the position.
_SLICE = sql.SQL("""
WITH
-- the slice's segments
picked AS ({picked}),
-- out of the block, by the statement that moves them: a message is in its far segment or in the wheel, never both
gone AS (
    DELETE FROM delaywheel.wheel_far_segments s
    WHERE s.block = %(block)s AND s.ctid = ANY(ARRAY(SELECT ctid FROM picked))
    RETURNING s.*),
-- their messages into the near wheel, as the last step moves what is left of the block
moved AS ({move} RETURNING 1)
SELECT (SELECT count(*) FROM moved), (SELECT coalesce(sum(n), 0) FROM gone), (SELECT max(ctid)::text FROM picked)
""")
_SLICES = {
    only: _SLICE.format(picked=_PICKED, move=_roll_rows(sql.Identifier("gone"), sql.SQL(only))).as_string()
    for only in ("", _NOT_SET_ASIDE.as_string())
}
# The far segments' messages the roll would move that cannot be delivered ({segments}: which segments).
_FAR_UNDELIVERABLE = sql.SQL("""
SELECT m.id, 'wheel', NULL::smallint, m.topic, m.key, m.due AT TIME ZONE 'UTC', u.reason, u.detail, m.tags,
       m.properties, m.body, m.is_json, 0
FROM delaywheel.wheel_far_segments s, {messages},
     LATERAL delaywheel.undeliverable(m.topic, m.body, m.is_json, m.properties) u
WHERE {segments} AND u.reason IS NOT NULL
""")
# ... in every far block the roll moves (its last step), and in a slice's segments.
_BLOCKS_UNDELIVERABLE = _FAR_UNDELIVERABLE.format(
    messages=segment_messages(*_ALL), segments=sql.SQL("s.block < %(target)s")
).as_string()
_SLICE_UNDELIVERABLE = _FAR_UNDELIVERABLE.format(
    messages=segment_messages(*_ALL),
    segments=sql.SQL("s.block = %(block)s AND s.ctid = ANY(ARRAY({}))").format(_PICKED),
).as_string()
# Where this process's last slice of each block (by partition name) ended, per connection: the next slice reads on
# from there rather than walking the dead rows of the slices before (a quadratic walk over a block of single sends).
# Only a hint: a block that looks empty from its position is read again from its start before the last step, and
# the last step moves whatever is left, so a stale or lost position (another process's slices, a restart) costs
# one read of the block, never a message.
_RESUME: weakref.WeakKeyDictionary[psycopg.Connection, dict[str, str]] = weakref.WeakKeyDictionary()
_START = "(0,0)"  # before every row: line pointers count from 1
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

T = TypeVar("T")


def roll(conn: psycopg.Connection, settings: Settings, cache: PartitionCache, now: datetime | None = None) -> int:
    """One step of the roll, which moves the far blocks that entered the near window into the fine wheel; returns
    rows moved. A row that cannot be delivered is set aside (setaside.py) instead of stopping the roll, hence every
    wheel pass.

    Rolling a day block in one transaction holding the wheel's lane lock and ACCESS EXCLUSIVE on both wheel parents
    would, at a billion pending timers, mean minutes a day with no wheel delivery and every timer send waiting
    (docs/capacity.md, "The roll"). So a step is: a short transaction creating the partitions the blocks fill;
    then slices, each moving at most `settings.wheel_roll_slice` messages (plus one segment) and deleting their
    segments, with no lock on the parents beyond what a send takes; and, once a slice finds its block empty, the last
    step (parents locked, what producers added since moved, the block dropped, `near_until` set), which has
    only a few sends left to move. Each is its own transaction under the lane's lock (a pass never sees half of one;
    a roll does nothing while another holds the lane). Until the last step producers go on sending into the block
    (`near_until` has not moved), and the slices take those too.

    A step does at most one full slice, and a wheel pass is one step and then its delivery, returning "due now"
    while the roll is not done (advance_wheel): the roll goes on at the runner's pace, a pass of the near wheel (and
    of the runner's other lanes) between any two slices, and never a whole block ahead of them. Looping slices here
    instead would free the lock between slices for nobody, since the lane's one deliverer would be the one looping.
    The slack is large: the roll starts as the near window's end crosses the block's first day, so its first
    message is due `wheel_near_window` (3 days) later, against minutes of slices for a 30-million-row block."""
    return _roll_step(conn, settings, cache, now)[0]


def _roll_target(clock: datetime, settings: Settings) -> datetime:
    return floor_to(clock + settings.wheel_near_window, DAY) + DAY


# The last `near_until` this process read on a connection on the real clock, with the server's clock then and the
# monotonic time it was read at (a pass with an injected clock always looks). `near_until` only grows (the roll's
# last step sets it to a later target), so while the one read is at or past the target the roll has nothing to do,
# and the pass needs no round trip to learn it. Read at every pass, it would be a round trip of its own before every
# due row's move: a wake-up of the deliverer and of its server process each, which on a busy machine wait for a CPU.
_NEAR_UNTIL: weakref.WeakKeyDictionary[psycopg.Connection, tuple[datetime, datetime, float]] = (
    weakref.WeakKeyDictionary()
)


def _roll_step(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, now: datetime | None
) -> tuple[int, datetime | None]:
    """(rows moved, the clock while the roll has more to do, else None). Nothing to roll is known without asking the
    server while the `near_until` last read (_NEAR_UNTIL) covers the target at the server's clock, reckoned as the
    clock read then plus the time elapsed here."""
    known = _NEAR_UNTIL.get(conn) if now is None else None
    if known is not None:
        near_until, clock, at = known
        if near_until >= _roll_target(clock + timedelta(seconds=time.monotonic() - at), settings):
            return 0, None
    at = time.monotonic()
    clock, near_until = conn.execute(  # type: ignore[misc]
        "SELECT coalesce(%s::timestamptz, clock_timestamp()), near_until FROM delaywheel.wheel_roll", (now,)
    ).fetchone()
    if now is None:
        _NEAR_UNTIL[conn] = (near_until, clock, at)
    target = _roll_target(clock, settings)
    if near_until >= target:  # nothing to roll (the common case): skip the locking transactions below
        return 0, None
    moved = 0
    blocks = _roll_partitions(conn, cache, clock, near_until, target)
    if blocks is None:  # the lane is busy: roll next pass
        return 0, clock
    resume = _RESUME.setdefault(conn, {})
    for name, lo in blocks:
        while True:
            after = resume.get(name, _START)
            params = {"block": lo, "after": after, "messages": settings.wheel_roll_slice}
            sliced = _setting_aside(conn, cache, _SLICE_UNDELIVERABLE, params, functools.partial(_slice, conn, params))
            if sliced is None:  # the lane is busy: roll next pass
                return moved, clock
            rows, taken, last = sliced
            moved += rows
            if taken >= settings.wheel_roll_slice:  # a full slice: the next step goes on from its end
                resume[name] = last
                return moved, clock
            resume.pop(name, None)
            if after == _START:
                break  # nothing left that this slice could see: on to the next block, then the last step
    rows, done = _setting_aside(
        conn,
        cache,
        _BLOCKS_UNDELIVERABLE,
        {"target": target},
        lambda only: _roll(conn, settings, cache, clock, target, only),
    )
    return moved + rows, None if done else clock


def _setting_aside(
    conn: psycopg.Connection,
    cache: PartitionCache,
    undeliverable: str,
    params: dict[str, object],
    move: Callable[[str], T],
) -> T:
    """`move("")`; if a row it moves cannot be delivered, `undeliverable`'s rows (with `params`) set aside and then
    `move(_NOT_SET_ASIDE)`, which leaves them out."""
    try:
        return move("")
    except POISON:
        if not _set_aside_far(conn, cache, undeliverable, params):
            raise  # nothing the store can name: the roll fails rather than skip a row
    return move(_NOT_SET_ASIDE.as_string())


def _set_aside_far(
    conn: psycopg.Connection, cache: PartitionCache, undeliverable: str, params: dict[str, object]
) -> int:
    """Set aside the far messages the roll moves next that cannot be delivered; returns how many."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WHEEL_LOCK)
        return record(conn, cache, conn.execute(undeliverable, params).fetchall())


def _roll_partitions(
    conn: psycopg.Connection, cache: PartitionCache, clock: datetime, near_until: datetime, target: datetime
) -> list[tuple[str, datetime]] | None:
    """Create the wheel partitions the roll fills, in a short transaction of its own under the lane's lock
    (creating one locks the wheel's parent, as a send that creates one does); returns the far blocks to roll, (name,
    lower bound) by day, or None if the lane is busy: a roll does nothing while another holds the lane, so a pass
    waiting for it queues at once."""
    with conn.transaction():
        locked = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", WHEEL_LOCK).fetchone()
        if not locked or not locked[0]:
            return None
        conn.execute("SET LOCAL lock_timeout = '5s'")
        blocks = conn.execute(_BLOCKS, (target,)).fetchall()
        start = max(floor_to(clock, HOUR), near_until)
        hours = [start + HOUR * i for i in range(int((target - start) / HOUR))]
        hours += [lo + HOUR * i for _, lo, hi in blocks for i in range(int((hi - lo) / HOUR))]
        cache.ensure(conn, "wheel", hours)
    return [(name, lo) for name, lo, _ in blocks]


def _slice(conn: psycopg.Connection, params: dict[str, object], only: str) -> tuple[int, int, str] | None:
    """One slice (_SLICE) in its own transaction under the wheel's lane lock: (rows moved, messages taken out of the
    block, the position after them); None if the lane is busy."""
    with conn.transaction():
        locked = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", WHEEL_LOCK).fetchone()
        if not locked or not locked[0]:
            return None
        conn.execute("SET LOCAL lock_timeout = '5s'")
        # The parents in the order producers lock them (_roll): the wheel's first. The statement below would lock
        # the far one first (its DELETE), and wait for the wheel's (its INSERT) behind a producer that created a wheel
        # partition and now waits to create a far block behind this slice. ONLY: the parent, not its partitions.
        conn.execute("LOCK TABLE ONLY delaywheel.wheel IN ROW EXCLUSIVE MODE")
        row = conn.execute(_SLICES[only], params).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


_BLOCKS = "SELECT name, lo, hi FROM delaywheel.partitions WHERE parent = 'wheel_far_segments' AND lo < %s ORDER BY lo"


# How long the roll's last step waits for the parents' locks: less than `deadlock_timeout` (half of it, at most
# 100 ms). A cancel's lookup takes wheel_far_segments before wheel, a producer wheel before wheel_far_segments, and the
# roll needs both exclusively, so in either order it can meet a statement that holds one and waits for the one the
# roll holds (cancels racing a roll do meet it, in the cancels' order). Waiting less than the deadlock check does, the
# roll gives up first (LockNotAvailable: roll next pass) and no caller gets a deadlock error; every statement queued
# behind its request waits at most this long.
_PARENTS_WAIT = (
    "SELECT set_config('lock_timeout', (1000 * extract(epoch FROM least(interval '100 ms',"
    " current_setting('deadlock_timeout')::interval / 2)))::int::text, true)"
)


def _roll(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    clock: datetime,
    target: datetime,
    only: str,
) -> tuple[int, bool]:
    """The roll's last step: what is left of the blocks into the wheel, the blocks dropped, `near_until` set, in one
    transaction; (rows moved, whether it ran)."""
    moved = 0
    with conn.transaction():
        locked = conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", WHEEL_LOCK).fetchone()
        # a producer still in its transaction (it holds wheel_roll's row FOR KEY SHARE, through wheel_state, or a
        # far block): roll next pass
        conn.execute("SET LOCAL lock_timeout = '5s'")
        state = conn.execute("SELECT near_until FROM delaywheel.wheel_roll FOR UPDATE").fetchone()
        if not locked or not locked[0] or state is None:
            return 0, False
        if state[0] >= target:  # another process finished it
            return 0, True
        # Creating and dropping partitions takes ACCESS EXCLUSIVE on the parents: take it first, in the order
        # producers lock them (wheel, then wheel_far_segments). Taken later, after a far block's lock, it deadlocks
        # with a producer that holds the parent and waits for the block.
        conn.execute(
            _PARENTS_WAIT
            + "; SELECT delaywheel.lock_partition('wheel'); SELECT delaywheel.lock_partition('wheel_far_segments')"
        )
        start = max(floor_to(clock, HOUR), state[0])
        hours = int((target - start) / HOUR) if target > start else 0
        cache.ensure(conn, "wheel", [start + HOUR * i for i in range(hours)])
        blocks = conn.execute(_BLOCKS, (target,)).fetchall()
        for name, lo, hi in blocks:
            conn.execute("SELECT delaywheel.lock_partition('wheel_far_segments', %s)", (lo,))  # sql/partitions.sql
            cache.ensure(conn, "wheel", [lo + HOUR * i for i in range(int((hi - lo) / HOUR))])
            cur = conn.execute(_roll_rows(sql.Identifier("delaywheel", name), sql.SQL(only)))
            moved += cur.rowcount
            conn.execute("SELECT delaywheel.drop_partition('wheel_far_segments', %s)", (lo,))
            cache.forget("wheel_far_segments", lo)
        conn.execute("UPDATE delaywheel.wheel_roll SET near_until = %s", (target,))
    return moved, True


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
    rolling = None
    with contextlib.suppress(errors.LockNotAvailable):  # a producer holds a far block: roll next pass
        rolling = _roll_step(conn, settings, cache, now)[1]
    result = cache.without_ddl(conn, lambda: _deliver(conn, cache, now, limit))  # no partition created in a pass
    if rolling is None or result.busy or (result.next_due is not None and result.next_due <= rolling):
        return result
    return dataclasses.replace(result, next_due=rolling)  # the roll is not done: pass again at once (roll says why)


def _deliver(conn: psycopg.Connection, cache: PartitionCache, now: datetime | None, limit: int) -> PassResult:
    for _ in range(3):  # more rows may turn up in the next try's batch (a newer horizon)
        try:
            return _advance(conn, cache, now, limit)
        except POISON:
            if not _set_aside_due(conn, cache, now, limit):
                raise  # nothing the store can name: the lane stops rather than skip a row
    return _advance(conn, cache, now, limit)


def _set_aside_due(conn: psycopg.Connection, cache: PartitionCache, now: datetime | None, limit: int) -> int:
    """Set aside the rows the next pass reads that cannot be delivered (own transaction, under the wheel's lock);
    returns how many (not counting those already cancelled, which the pass skips anyway)."""
    with conn.transaction():
        row = conn.execute(_WAIT_LOCK, (*WHEEL_LOCK, now)).fetchone()
        assert row is not None
        _, xmin, clock = row[:3]
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
    """One pass in a transaction of its own (db.in_own_transaction: on a Store's connection the CALL commits)."""
    return in_own_transaction(conn, lambda own: _pass(conn, cache, now, limit, own=own))


def _pass(
    conn: psycopg.Connection, cache: PartitionCache, now: datetime | None, limit: int, *, own: bool
) -> PassResult:
    """The pass as one CALL (_CALL), which commits before it reads the head when `own` (a Store's connection: the
    rows are readable without waiting for the head); in the caller's transaction otherwise. The rows' delivered_at
    and their commit are in the same statement, with no round trip between them.

    Statements in a procedure each take a new snapshot: the cursor is read after the lock is held. Nothing locks it
    (producers lock wheel_roll's row, not the cursor): the entry the pass appends is keyed by the one it read, so a
    second pass that read the same entry could not commit. The horizon only moves forward: every xid below the stored
    horizon had ended when it was taken, so the larger of the two is still a valid horizon; a smaller one (the commit
    horizon can dip, see db.COMMIT_HORIZON) would make rows already delivered by the due step look like stragglers
    again. An injected clock that went backwards delivers nothing rather than early. If the clock's day has no topic
    partition the procedure returns before its moves (`missing`): created here (or, in a Store's pass, PartitionMissing
    for cache.without_ddl), then the pass runs again (levels.call_pass)."""
    params: dict[str, object] = {
        "injected": now,
        "limit": limit,
        "commit": own,
        "lane_wait": levels.LANE_WAIT,  # read here: the lanes' one setting (tests shorten or lengthen it)
        "head_window": HEAD_WINDOW,
        "trim_every": TRIM_EVERY,
        "lock_class": WHEEL_LOCK[0],
        "lock_key": WHEEL_LOCK[1],
    }
    busy, waited, _, _, delivered, skipped, next_due, more, straggled, summary = levels.call_pass(
        conn, cache, _CALL, params
    )
    if busy:
        return PassResult(0, 0, None, busy=True)
    topics = topic_spans(straggled or {})  # stragglers were written first, in the same transaction
    for topic, span in topic_spans(summary or {}).items():
        topics[topic] = topics[topic].merge(span) if topic in topics else span
    return PassResult(delivered, skipped, next_due, more=more, topics=topics, waited=waited)
