"""The store's shared SQL, each written once: a segment's messages, "pending", "cancelled", and when each lane's head
falls due. Delivery, cancel, retire, stats, quality and the Airflow sensors and triggers all build on these (the
cursor rules themselves are in deliver/levels.py and deliver/wheel.py).

Fragments are psycopg.sql compositions: every identifier in them (a segment's alias, an array column) is quoted by
psycopg, every value is a placeholder the caller binds. The few kept as text (PENDING, LEVEL_HEAD, WHEEL_HEAD) are
rendered once, here, for the callers that take text.
"""

from __future__ import annotations

from psycopg import sql

# --- A segment's messages ---------------------------------------------------------------------------------------
# Level segments (level_segments) and far blocks (wheel_far_segments) hold one send's messages as parallel arrays, one
# element per message; topics, tags, properties and is_json hold a single element when every message shares it
# (read through delaywheel.spread). The message columns, in one order, and the segment's array each comes from:
_ARRAYS = {  # column -> (array, may be one element for all: spread)
    "id": ("ids", False),
    "topic": ("topics", True),
    "key": ("keys", False),
    "tags": ("tags", True),
    "properties": ("properties", True),  # JSON objects as text
    "body": ("bodies", False),
    "is_json": ("is_json", True),
    "due": ("deliver_ats", False),  # far blocks only: UTC `timestamp`, read as `due AT TIME ZONE 'UTC'`
}


def _arrays(columns: tuple[str, ...], segment: str) -> list[tuple[str, sql.Composed, bool]]:
    """(column, the segment's array it comes from, shared) for each of `columns`, in _ARRAYS' order."""
    unknown = [c for c in columns if c not in _ARRAYS]
    if unknown or not columns:
        raise ValueError(f"segment columns {unknown or '(none)'}: choose from {list(_ARRAYS)}")
    s = sql.Identifier(segment)
    return [
        (column, sql.SQL("{}.{}").format(s, sql.Identifier(_ARRAYS[column][0])), _ARRAYS[column][1])
        for column in _ARRAYS
        if column in columns
    ]


def segment_messages(*columns: str, segment: str = "s", alias: str = "m") -> sql.Composed:
    """`unnest(s.ids, delaywheel.spread(s.topics, s.n), …) AS m(id, topic, …)`: one row per message of the segment
    row `segment`, with the columns named (always in _ARRAYS' order, whatever order they are asked in).

    A Python builder rather than a SQL function: a set-returning function unnests every array it is given, so a
    cancel's lookup (ids and keys) would detoast the segment's bodies too, where this unnests only the arrays a
    statement reads; and the planner sees the `unnest` itself, so the plans that tests/test_query_plans.py checks (the
    FIFO index walked one segment at a time, stopping at the LIMIT) are the ones written here. The migrations' views
    (`level_queue`, `wheel_far` in sql/views.sql) keep their own copies as history."""
    arrays = _arrays(columns, segment)
    n = sql.SQL("{}.n").format(sql.Identifier(segment))
    return sql.SQL("unnest({}) AS {}({})").format(
        sql.SQL(", ").join(
            sql.SQL("delaywheel.spread({}, {})").format(a, n) if shared else a for _, a, shared in arrays
        ),
        sql.Identifier(alias),
        sql.SQL(", ").join(sql.Identifier(column) for column, _, _ in arrays),
    )


# --- Cancelled ------------------------------------------------------------------------------------------------
def cancelled(row: str, *, id_column: str = "id", due_column: str = "deliver_at", probe: bool = False) -> sql.Composed:
    """Has the message `row` (its id and due time) a cancellation? The one definition every reader uses: deliverers
    skip it, bulk cancel and reconcile leave it out, stats subtract it, quality counts it as settled.

    A cancellation is keyed by (message_id, due_at): the unique index of cancellations and the partition key of
    `cancellations` (by due day, so a lookup reads one day's index). Keyed by `message_id` alone, the test would
    agree with this one on every row the store writes, because a message id is
    queued once with one due time: ids come from `message_id_seq` for every send (a consumer's retry is a new message
    with a new id; the roll moves a far message to the near wheel with its due time; replay writes `origin =
    'replay'` topic rows, never queue rows; catch-up runs the deliverers' own passes), and every cancellation copies
    its due time from the row it cancels (cancel.mark, setaside.record). The two differ only on a row written some
    other way, one naming the id with another due time: the deliverers would deliver that message while a reader
    keyed by id counted it as cancelled. With one definition nothing reads such a row as a cancellation
    (tests/ops/test_not_cancelled.py).

    `probe=True` fences the test (OFFSET 0), so that PostgreSQL runs it as one index probe per row instead of turning
    it into a join: for readers of every pending message (`PENDING`), whose rows the planner overestimates by orders of
    magnitude (the wheel cursor's view joins tables that are never analyzed), a join looks cheapest as a merge of all
    cancellations ever made, sorted, so a bulk cancel of a few keys would sort them all, to disk; probed, it reads
    about what it found (tests/test_query_plans.py)."""
    r = sql.Identifier(row)
    return sql.SQL(
        "EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = {}.{} AND c.due_at = {}.{}{})"
    ).format(r, sql.Identifier(id_column), r, sql.Identifier(due_column), sql.SQL(" OFFSET 0" if probe else ""))


def not_cancelled(
    row: str, *, id_column: str = "id", due_column: str = "deliver_at", probe: bool = False
) -> sql.Composed:
    """`NOT cancelled(row)`: the deliverers' anti-join."""
    return sql.SQL("NOT {}").format(cancelled(row, id_column=id_column, due_column=due_column, probe=probe))


# --- Pending --------------------------------------------------------------------------------------------------
# Pending = not yet passed by its lane's cursor (the cursor rules of levels.py and wheel.py). `pending()` narrows
# it with a condition on segments `s` (level segments and far blocks: their id-range GiST indexes, say) and one
# on each message `q` (id, key, topic, tags, properties; in the near wheel by its own indexes).
# A cancel's finds by id and by key (sql/cancel.sql) apply the same rules at the id's or key's positions in a
# segment; tests/test_pending.py holds them to these.
# A near-wheel row `q` not yet passed by the wheel cursor `s` (wheel_state): ahead of it, or a straggler.
WHEEL_PENDING = sql.SQL("((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)")
# A level segment not yet passed as a whole, for the counts that need no message of it (retire, stats).
SEGMENT_PENDING = sql.SQL("(c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id))")
_PENDING = sql.SQL("""
    -- level segments past their level's checkpoint, then their messages past it (the checkpoint may sit inside one)
    SELECT q.id, s.deliver_at, q.key, q.topic, q.tags, q.properties::jsonb, 'level' AS lane, s.level, s.xid
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL {level_messages}
    WHERE ({segments}) AND ({rows}) AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    -- the near wheel's rows the wheel cursor has not passed
    SELECT q.id, q.deliver_at, q.key, q.topic, q.tags, q.properties, 'wheel', NULL, q.xid
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE ({rows}) AND {wheel_pending}
    UNION ALL
    -- far blocks: not rolled yet, so every message pending
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, q.topic, q.tags, q.properties::jsonb, 'wheel', NULL, s.xid
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL {far_messages}
    WHERE ({segments}) AND ({rows})
""")


_TRUE = sql.SQL("true")


def pending(segments: sql.Composable = _TRUE, rows: sql.Composable = _TRUE) -> sql.Composed:
    """Every pending message as (id, deliver_at, key, topic, tags, properties, lane, level, xid), cancelled ones
    included (a caller that wants them out adds `not_cancelled("p")` on its alias `p`)."""
    columns = ("id", "topic", "key", "tags", "properties")
    return _PENDING.format(
        segments=segments,
        rows=rows,
        wheel_pending=WHEEL_PENDING,
        level_messages=segment_messages(*columns, alias="q"),
        far_messages=segment_messages(*columns, "due", alias="q"),
    )


PENDING = pending().as_string()  # as text, for the callers that take text (the predicate cancel)
# The same rule for rows already found, checked against the cursors alone (no scan of the queues).
STILL_PENDING = sql.SQL("""
    CASE WHEN t.lane = 'level' THEN NOT EXISTS (
             SELECT 1 FROM delaywheel.level_checkpoint c
             WHERE c.level = t.level AND (t.xid, t.id) <= (c.cursor_xid, c.cursor_id))
         ELSE EXISTS (
             SELECT 1 FROM delaywheel.wheel_state s
             WHERE (t.deliver_at, t.id) > (s.cursor_at, s.cursor_id) OR t.xid >= s.horizon_xid) END
""")

# --- When a lane's head falls due ------------------------------------------------------------------------------
# Read without writing anything (sensors and triggers only look; a pass reads its own after moving its cursor).
# A level is FIFO with one delay, so its head is the first message after its checkpoint (its segment's due time); the wheel's next due
# time is the first row after its cursor, or "now" while stragglers wait, or, with only far blocks pending,
# `near_until`: every far row is due at or after it, and far blocks have no index in due order,
# so a waiter wakes when the far blocks start, never after their first row is due. (A near_until already
# past means the roll is overdue: the head is then in the past, and the next pass rolls.)
# Cursors are read in subqueries, and stragglers found as the first row in xid order rather than by EXISTS
# (which drops ORDER BY ... LIMIT): either way the planner walks an index from the cursor, even on a fresh
# partition without statistics, instead of scanning every delivered row (a sensor polls this every second).


def level_head(level: sql.Composable) -> sql.Composed:
    """The due time of level `level`'s head (an expression: a placeholder, or a column of the caller's rows), read
    from its checkpoint; no row when the level holds nothing pending."""
    checkpoint = sql.SQL("(SELECT {} FROM delaywheel.level_checkpoint WHERE level = {})")
    return sql.SQL("""
    SELECT s.deliver_at FROM delaywheel.level_segments s
    WHERE s.level = {level}
      AND (s.xid, s.id_last) > (coalesce({cursor_xid}, '0'), coalesce({cursor_id}, 0))
    ORDER BY s.xid, s.id_last LIMIT 1
""").format(
        level=level,
        cursor_xid=checkpoint.format(sql.Identifier("cursor_xid"), level),
        cursor_id=checkpoint.format(sql.Identifier("cursor_id"), level),
    )


def wheel_head(
    cursor_at: sql.Composable,
    cursor_id: sql.Composable,
    horizon: sql.Composable,
    clock: sql.Composable,
    *,
    before: sql.Composable | None = None,
) -> sql.Composed:
    """The wheel's next due time after the cursor (cursor_at, cursor_id) with stragglers from xid `horizon` on
    (`clock` while one waits), as one row; each argument an expression (a placeholder, or a read of wheel_state).

    With `before`, only near rows due before it are searched, and there is no row unless one is found there (the
    caller then asks without it). The search for the first near row has no upper bound on the due time, so the
    planner plans, and the executor opens, every partition ahead of the cursor, most of a wheel pass's time. Bounded by
    an hour or so it touches one or two, and
    a busy wheel always has a row that close."""
    near = sql.SQL("""SELECT w.deliver_at FROM delaywheel.wheel w
          WHERE w.deliver_at >= {at} AND (w.deliver_at, w.id) > ({at}, {id}){bound}
          ORDER BY w.deliver_at, w.id LIMIT 1""").format(
        at=cursor_at,
        id=cursor_id,
        bound=sql.SQL("") if before is None else sql.SQL(" AND w.deliver_at < {}").format(before),
    )
    return sql.SQL("""
    SELECT least(
        -- the first near row after the cursor
        near.at,
        -- far blocks pending: when they start
        (SELECT near_until FROM delaywheel.wheel_roll WHERE EXISTS (SELECT FROM delaywheel.wheel_far_segments)),
        -- a straggler behind the cursor: due now
        (SELECT {clock} WHERE (
            SELECT w.xid FROM delaywheel.wheel w
            WHERE w.xid >= {horizon} AND w.deliver_at <= {at}
            ORDER BY w.xid LIMIT 1) IS NOT NULL))
    FROM ({near}) near(at){found}
""").format(
        at=cursor_at,
        horizon=horizon,
        clock=clock,
        near=sql.SQL("SELECT ({})").format(near),
        found=sql.SQL("") if before is None else sql.SQL(" WHERE near.at IS NOT NULL"),
    )


def _state(column: str) -> sql.Composed:
    return sql.SQL("(SELECT {} FROM delaywheel.wheel_state)").format(sql.Identifier(column))


# As text, for the callers that take text (Airflow hooks and triggers, the runner): parameter `level` for a level.
LEVEL_HEAD = level_head(sql.Placeholder("level")).as_string()
WHEEL_HEAD = wheel_head(
    _state("cursor_at"), _state("cursor_id"), _state("horizon_xid"), sql.SQL("clock_timestamp()")
).as_string()
