"""Cancel pending messages by id, by key, or in bulk: by a key list, a checked predicate, or keys from another table.

A cancellation is a row in `cancellations` that deliverers anti-join; the message itself stays until its partition
is retired. A cancel holds no lane lock while deliverers run: it commits its cancellations, then waits for the passes
already running of the lanes that may hold the messages (the only ones that may have read a message without its
cancellation) and reads what they did, all in one statement (a procedure, sql/cancel.sql). A
message is delivered or cancelled, never both, and the caller is told which: a delivery wins (DESIGN.md,
"Cancellation").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

import psycopg
from psycopg import errors, sql
from psycopg.types.numeric import Int4, Int8

from delaywheel.db import LOOKUP_PLAN, commits_each_statement
from delaywheel.locks import LEVEL_LOCK, TURNS, WHEEL_LOCK, turns
from delaywheel.partitions import PartitionCache
from delaywheel.pending import PENDING, SEGMENT_PENDING, STILL_PENDING, not_cancelled, pending
from delaywheel.produce.keyblooms import probe, slots
from delaywheel.types import MAX_ID

MATCH_TIMEOUT = timedelta(minutes=5)  # the default of Settings.match_timeout

Outcome = Literal["cancelled", "already_cancelled", "already_delivered", "not_found"]


@dataclass(frozen=True)
class CancelResult:
    message_id: int | None
    outcome: Outcome


# Finding one message: the segments that may hold it, by their id ranges (GiST), then the message itself. By id,
# the range holds the id. By key, segments carry no key index (a per-message entry is what they avoid):
# `candidates` are the id ranges of the far sends whose summary filter of the key's group lets the key through
# (far_key_summaries: about one filter per send instead of one per far segment, which adds up with millions pending;
# read from the index that holds them, and FIND_PLAN below), of the far segments too small
# for a filter that hold the key (their partial GIN index), and of the pending level segments whose filter lets it
# through (levels hold few segments: a send writes one per level). In those ranges a segment's own filter is tested
# before its keys are read (here, and where the lane wait picks its levels, CASE fixes the order: the planner would run
# the cheaper-looking `@>` first, reading every segment's keys).
_MAY_HOLD_KEY = sql.SQL(
    "CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, %(h1)s, %(h2)s) THEN s.keys @> ARRAY[%(v)s::text] END"
)
_KEY_CANDIDATES = sql.SQL("""
WITH candidates AS MATERIALIZED (
    SELECT range_agg(m.r) AS ranges FROM (
        SELECT int8range(f.id_lo, f.id_hi, '[]') FROM delaywheel.far_key_summaries f
        WHERE f.slot = ANY(%(slots)s::int[]) AND delaywheel.bloom_may_hold(f.bloom, %(h1)s, %(h2)s)
        UNION ALL
        SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.wheel_far_segments s
        WHERE s.key_bloom IS NULL AND s.keys @> ARRAY[%(v)s::text]
        UNION ALL
        SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE {segment_pending} AND {may_hold_key}) AS m(r))
""").format(segment_pending=SEGMENT_PENDING, may_hold_key=_MAY_HOLD_KEY)
_LOOKUP: dict[str, tuple[sql.Composable, sql.Composable, sql.Composable, sql.Composable]] = {
    # how -> (WITH clause, condition on segments s, condition on messages q, their positions in a segment s). A
    # segment's messages are read at the positions of the id or key (pending.segment_elements), not unnested and
    # tested one by one; so by key a segment's filter is tested, and then its keys are read once, for the positions.
    "id": (
        sql.SQL(""),
        sql.SQL("int8range(s.id_first, s.id_last, '[]') @> %(v)s::bigint"),
        sql.SQL("q.id = %(v)s"),
        sql.SQL("array_positions(s.ids, %(v)s::bigint)"),
    ),
    "key": (
        _KEY_CANDIDATES,
        sql.SQL(
            "int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates)"
            " AND delaywheel.bloom_may_hold(s.key_bloom, %(h1)s, %(h2)s)"
        ),
        sql.SQL("q.key = %(v)s"),
        sql.SQL("array_positions(s.keys, %(v)s::text)"),
    ),
}


def _find_one(first: sql.Composable, segments: sql.Composable, rows: sql.Composable, positions: sql.Composable) -> str:
    """The lookup as text, from a _LOOKUP entry."""
    return (
        sql.SQL("{} SELECT p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text FROM ({}) p")
        .format(first, pending(segments, rows, positions))
        .as_string()
    )


# The lookup itself (as text: prepared, and rendered once), and its planner settings (db.LOOKUP_PLAN) with a generic
# plan for its transaction.
_FIND_ONE = {how: _find_one(*parts) for how, parts in _LOOKUP.items()}
_LOOKUP_PLAN = sql.SQL("SELECT {}").format(sql.SQL(LOOKUP_PLAN)).as_string()
_GENERIC = "SELECT {}, set_config('plan_cache_mode', 'force_generic_plan', true)"
_GENERIC_LOOKUP_PLAN = sql.SQL(_GENERIC).format(sql.SQL(LOOKUP_PLAN)).as_string()
# The find's settings: bitmap scans priced out as well. The far-key summaries it tests, one row per send, are read
# from the index that holds their filters (far_key_summaries_lookup); until autovacuum has marked their pages all-visible the
# planner prices that index-only scan at a heap page a row and picks a bitmap scan, which is then one page a row
# indeed, and the connection's generic plan keeps that choice for its life. GIN's bitmap scans (the small far
# segments' keys) stay: GIN has no other index scan. Not for the topics' search: a BRIN index has only bitmap scans,
# and with those priced out a small partition would be read whole.
FIND_PLAN = LOOKUP_PLAN + ", set_config('enable_bitmapscan', 'off', true)"
_GENERIC_FIND_PLAN = sql.SQL(_GENERIC).format(sql.SQL(FIND_PLAN)).as_string()
# The messages with the id or key delivered into a topic (cancel reports them), by message_id's B-tree or key's BRIN.
_DELIVERED = {
    how: sql.SQL("SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE {} = %(v)s AND origin <> 'replay'")
    .format(sql.Identifier(column))
    .as_string()
    for how, column in (("id", "message_id"), ("key", "key"))
}
# The messages with the id or key cancelled earlier, by cancellations_once's B-tree on message_id or the partial one
# on key: once a pass has moved past a cancelled message it is no longer pending, and a repeated cancel reports it
# `already_cancelled` from here rather than `not_found`. A message a pass set aside (deliver.setaside) was not
# cancelled by a caller and is left out.
_CANCELLED = {
    how: sql.SQL(
        "SELECT DISTINCT message_id FROM delaywheel.cancellations WHERE {} = %(v)s"
        " AND NOT starts_with(reason, 'set aside: ')"
    )
    .format(sql.Identifier(column))
    .as_string()
    for how, column in (("id", "message_id"), ("key", "key"))
}


_BIGINT = range(-MAX_ID - 1, MAX_ID + 1)  # what a message id can be


def cancel(
    conn: psycopg.Connection,
    cache: PartitionCache,
    *,
    message_id: int | None = None,
    key: str | None = None,
    reason: str = "cancelled",
) -> list[CancelResult]:
    """Cancel one message by id, or every message with a key; one result per message found.

    No lane lock is held while deliverers run (DESIGN.md, "Cancellation"): the cancellations are committed first,
    then the cancel waits for the passes, of the lanes that may hold the messages found, that may have read them
    before that commit, and reads what happened; one statement (`_cancel_in_one_call`), or, the first time a due day
    needs its `cancellations` partition, three round trips. A delivery wins: the answer is `already_delivered`
    whenever the message reached its topic (made durable before it is reported: `durable_answer`), and `cancelled`
    only when no pass can deliver it any more. Inside a transaction the caller holds (nothing can be committed before
    the caller's commit), the lanes' turns are taken instead and held until then (locks.TURNS).
    """
    if (message_id is None) == (key is None):
        raise ValueError("cancel needs exactly one of message_id or key")
    if key is not None:
        how, params = "key", key_params(key)
    elif message_id is not None and message_id in _BIGINT:
        how, params = "id", {"v": Int8(message_id)}  # (typed as key_params says why)
    else:
        raise ValueError(f"message_id must be a bigint (ids are), got {message_id!r}")
    if not commits_each_statement(conn):  # a cancellation cannot be committed before the wait: lock the lanes instead
        results = _cancel_locked(conn, cache, how, params, reason)
    else:
        try:
            results = _cancel_in_one_call(conn, how, params, reason)
        except errors.CheckViolation:  # a message found is due on a day with no `cancellations` partition yet
            results = mark_and_settle(conn, cache, how, params, find(conn, how, params), reason)
    if any(r.outcome == "already_delivered" for r in results):
        durable_answer(conn)
    return results


# A pass commits without waiting for its WAL flush (sql/level_pass.sql, sql/wheel_pass.sql), so a crash of PostgreSQL right after it may undo
# a delivery that a cancel has read. Before such a cancel answers `already_delivered`, it commits a WAL record of its
# own and waits for that flush, which flushes the delivery's commit with it (the WAL is flushed in order): the
# answer then holds after any crash. Inside a caller's transaction the record is the caller's, flushed by its commit.
_DURABLE_ANSWER = "SELECT pg_logical_emit_message(true, 'delaywheel', 'already_delivered')"


def durable_answer(conn: psycopg.Connection) -> None:
    """Make every delivery this connection has read durable before it is reported (above)."""
    conn.execute(_DURABLE_ANSWER)


def key_params(key: str) -> dict[str, object]:
    """The parameters of the lookup by key (_LOOKUP): the key, its filter hashes, its summary slots. Typed as the
    columns they meet (bigint hashes, int slots) rather than by value: psycopg sends a Python int as int2, int4 or
    int8 by its size, and prepares a statement once per combination of types, so a 32-bit hash of either half made
    up to eight prepared lookups per connection, each planned over every partition (an id, likewise, three)."""
    h1, h2 = probe(key)
    return {"v": key, "h1": Int8(h1), "h2": Int8(h2), "slots": [Int4(slot) for slot in slots(h2)]}


# Found pending messages: (id, deliver_at, key, lane, level, xid as text), STILL_PENDING's columns.
Found = tuple[int, datetime, str | None, str, int | None, str]


def find(conn: psycopg.Connection, how: str, params: dict[str, object]) -> list[Found]:
    """The pending messages with the id or key (read only, no lane lock). One prepared statement, planned once per
    connection: planning the lookup over the near wheel's partitions and the far blocks costs more
    than running it, and a generic plan loses nothing, since no partition is pruned by
    id or key."""
    with conn.pipeline():  # one round trip; outside a transaction, one implicit transaction for both statements
        conn.execute(_GENERIC_FIND_PLAN)
        cur = conn.execute(_FIND_ONE[how], params, prepare=True)
    return cur.fetchall()


# The cancellations of messages found, for those the cursors still show pending; one per message (their unique index: a
# concurrent cancel of the same message is waited for, and then this one inserts nothing).
_MARK = (
    sql.SQL("""
INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
SELECT t.id, t.deliver_at, t.key, %(reason)s
FROM unnest(%(ids)s::bigint[], %(dues)s::timestamptz[], %(keys)s::text[], %(lanes)s::text[],
            %(levels)s::smallint[], %(xids)s::xid8[]) AS t(id, deliver_at, key, lane, level, xid)
WHERE {}
ON CONFLICT (message_id, due_at) DO NOTHING
RETURNING message_id
""")
    .format(STILL_PENDING)
    .as_string()
)


def mark(conn: psycopg.Connection, cache: PartitionCache, found: Sequence[Found], reason: str) -> set[int]:
    """Insert the cancellations of `found` in one statement (in the caller's transaction if it holds one, else
    committed on return); returns the ids it cancelled now."""
    if not found:
        return set()
    cache.ensure(conn, "cancellations", [row[1] for row in found])
    # Outside a transaction the statement is its own (one round trip); a partition `ensure` created is committed.
    return {mid for (mid,) in _mark(conn, found, reason).fetchall()}


def _mark(conn: psycopg.Connection, found: Sequence[Found], reason: str) -> psycopg.Cursor:
    return conn.execute(_MARK, {"reason": reason, **_columns(found)}, prepare=True)


def _columns(found: Sequence[Sequence[object]]) -> dict[str, list[object]]:
    return {
        name: [row[i] for row in found] for i, name in enumerate(("ids", "dues", "keys", "lanes", "levels", "xids"))
    }


def lane_locks(found: Sequence[Sequence[object]]) -> list[tuple[int, int]]:
    """The advisory locks held by delivery passes of the lanes of `found` (rows with lane and level at 3 and 4)."""
    return sorted({WHEEL_LOCK if row[3] == "wheel" else (LEVEL_LOCK, int(row[4])) for row in found})  # type: ignore[call-overload]


def _in_lock_order(lanes: sql.Composable, lock: str) -> sql.Composed:
    """The turns of the lanes `lanes` (a query of the lanes' (class, key) rows), each taken with the advisory-lock
    function `lock`, in the cancellers' one order: the wheel's turns, then the levels' ascending, each lane's in turn
    (locks.TURNS), so no two cancels deadlock. The lock is a volatile function in the select list, so PostgreSQL
    evaluates it after the sort, row by row."""
    return sql.SQL("""
    SELECT k.class, k.key, {lock}(k.class, k.key) FROM (
        SELECT l.class + t.turn, l.key, l.class FROM ({lanes}) AS l(class, key), unnest(ARRAY[{turns}]) AS t(turn)
    ) AS k(class, key, lane)
    ORDER BY k.lane = {wheel_class} DESC, k.key, k.class""").format(
        lock=sql.SQL(lock),
        lanes=lanes,
        turns=sql.SQL(", ").join(map(sql.Literal, TURNS)),
        wheel_class=sql.Literal(WHEEL_LOCK[0]),
    )


def _lane_wait(lanes: sql.Composable) -> str:
    """The statement that waits for the delivery passes running now of the lanes `lanes` (run it after the
    cancellations committed: a pass that starts later reads them). A pass in flight holds one of its lane's two turns
    (locks.TURNS), so the wait takes each turn in order. Shared, so cancels never wait for each other, and held for no
    time at all: session locks, each released in the statement that waited for it (the inner query takes one, the
    outer one lets it go before the next is taken). A cancel granted a turn as the pass holding it commits may keep it
    until its process runs; the next pass takes the other turn meanwhile, so it does not wait for that cancel, and
    finds both taken only when a cancel is stalled there for a whole pass (then it waits, levels.LANE_WAIT, rather than
    report busy). Under a transaction's lock such a wait would have lasted to the end of that transaction: through the
    search of the topics."""
    return (
        sql.SQL("SELECT pg_advisory_unlock_shared(k.class, k.key) FROM ({} OFFSET 0) k")
        .format(_in_lock_order(lanes, "pg_advisory_lock_shared"))
        .as_string()
    )


def _lane_hold(lanes: sql.Composable) -> str:
    """The statement that takes the turns of the lanes `lanes` until the caller's transaction ends (a cancel inside
    it, which cannot commit its cancellations first): deliverers of those lanes wait for that, or report busy."""
    return _in_lock_order(lanes, "pg_advisory_xact_lock").as_string()


# The lanes, as (class, key) rows, that may hold the message: the wheel's, and those of the pending level segments that
# may (by id, their id range; by key, their filter; no far candidates: those are the wheel's): a superset is harmless.
# And every lane, for a bulk cancel inside a caller's transaction.
_WHEEL_LANE = sql.SQL("SELECT {}, {}").format(sql.Literal(WHEEL_LOCK[0]), sql.Literal(WHEEL_LOCK[1]))
_LANES_MAY_HOLD = {
    how: sql.SQL("""
        {wheel}
        UNION
        SELECT {level_class}, s.level::int FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE {segment_pending} AND {may_hold}""").format(
        wheel=_WHEEL_LANE, level_class=sql.Literal(LEVEL_LOCK), segment_pending=SEGMENT_PENDING, may_hold=may_hold
    )
    for how, may_hold in (("id", _LOOKUP["id"][1]), ("key", _MAY_HOLD_KEY))
}
_EVERY_LANE = sql.SQL("""
        {wheel}
        UNION ALL
        SELECT {level_class}, generate_series(1, coalesce((SELECT max(level) FROM delaywheel.level_segments), 0))
""").format(wheel=_WHEEL_LANE, level_class=sql.Literal(LEVEL_LOCK))
_HOLD_MAY_HOLD = {how: _lane_hold(lanes) for how, lanes in _LANES_MAY_HOLD.items()}
_HOLD_EVERY_LANE = _lane_hold(_EVERY_LANE)


_AWAIT_LANES = _lane_wait(sql.SQL("SELECT * FROM unnest(%(classes)s::int[], %(keys)s::int[])"))


def await_passes(conn: psycopg.Connection, locks: Sequence[tuple[int, int]]) -> None:
    """Wait for the delivery passes of these lanes that are running now (`_lane_wait`)."""
    if locks:
        conn.execute(_AWAIT_LANES, {"classes": [c for c, _ in locks], "keys": [k for _, k in locks]}, prepare=True)


# The turns of a lane wait (`await_passes`, the procedures of sql/cancel.sql) this session still holds: shared,
# session level (objsubid 2: two int4 keys), of the turns' classes.
_RELEASE_LEFT = """
SELECT pg_advisory_unlock_shared(l.classid::int, l.objid::int) FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.objsubid = 2 AND l.granted AND l.mode = 'ShareLock'
  AND l.classid = ANY(%s::int[]::oid[])
"""


@contextmanager
def _released_on_error(conn: psycopg.Connection) -> Iterator[None]:
    """If the lane wait fails part-way (a `statement_timeout`, a cancel from outside), the locks it had taken are
    session locks and would stay held by the connection, and their lanes' deliverers would report busy until it
    closes: for as long as a pooler keeps a server connection (docs/poolers.md). Release them, then re-raise."""
    try:
        yield
    except psycopg.Error:
        if not conn.broken and not conn.closed:
            conn.execute(_RELEASE_LEFT, ([turn for lane in (WHEEL_LOCK, (LEVEL_LOCK, 0)) for turn, _ in turns(*lane)],))
        raise


def mark_and_settle(
    conn: psycopg.Connection,
    cache: PartitionCache,
    how: str,
    params: dict[str, object],
    found: Sequence[Found],
    reason: str,
) -> list[CancelResult]:
    """`mark`, then `settle`, outside a transaction, in one round trip: the insert, then a Sync, which commits it
    before the wait starts (the server runs what it is sent in order)."""
    if found:
        cache.ensure(conn, "cancellations", [row[1] for row in found])
    with _released_on_error(conn), conn.pipeline() as pipeline:
        marking = _mark(conn, found, reason) if found else None
        pipeline.sync()
        delivered, cancelled = _settling(conn, how, params, lane_locks(found))
    marked = {mid for (mid,) in marking.fetchall()} if marking else set()
    return _outcomes(how, params, [row[0] for row in found] + _ids_of(cancelled), marked, _ids(delivered))


def settle(
    conn: psycopg.Connection, how: str, params: dict[str, object], found: Sequence[Found], marked: set[int]
) -> list[CancelResult]:
    """The true outcome of each message found, once every pass that may have read it without its cancellation has
    ended (await_passes), and the messages with the id or key delivered earlier: `mark_and_settle`'s second half on
    its own, for a caller that commits the cancellations itself (tests hold a pass open between the two)."""
    with _released_on_error(conn), conn.pipeline():
        delivered, cancelled = _settling(conn, how, params, lane_locks(found))
    return _outcomes(how, params, [row[0] for row in found] + _ids_of(cancelled), marked, _ids(delivered))


def _settling(
    conn: psycopg.Connection, how: str, params: dict[str, object], locks: Sequence[tuple[int, int]]
) -> tuple[psycopg.Cursor, psycopg.Cursor]:
    """In a pipeline, one implicit transaction: the wait for the passes holding `locks` (those of the lanes found,
    `lane_locks`), then the search of the topics (`_delivered`) and of the cancellations (`_CANCELLED`). Returns
    the cursors of the ids delivered and of the ids cancelled."""
    await_passes(conn, locks)
    delivered = _delivered(conn, how, params)
    return delivered, conn.execute(_CANCELLED[how], {"v": params["v"]}, prepare=True)


def _ids(cursor: psycopg.Cursor) -> set[int]:
    """The message ids of a cursor over (message_id) rows."""
    return {mid for (mid,) in cursor.fetchall()}


def _ids_of(cursor: psycopg.Cursor) -> list[int]:
    """The message ids of a cursor over (message_id) rows, in order."""
    return sorted(_ids(cursor))


def _delivered(conn: psycopg.Connection, how: str, params: dict[str, object]) -> psycopg.Cursor:
    """After the wait for the passes (a statement of its own, so a snapshot taken after it), the search of the topics,
    by B-tree on message_id or by the BRIN bloom summaries on key (LOOKUP_PLAN)."""
    conn.execute(_GENERIC_LOOKUP_PLAN)
    return conn.execute(_DELIVERED[how], {"v": params["v"]}, prepare=True)  # planned once per connection, as `find`


# --- One statement ---------------------------------------------------------------------------------------------
# `cancel` outside a transaction is one CALL of a procedure (sql/cancel.sql), which runs in one round trip what would
# otherwise be a pipeline of seven statements: the lookup and the insert of its cancellations as one statement, COMMIT,
# the wait for the passes in flight (`_lane_wait` of `_LANES_MAY_HOLD`), the search of the topics, then of the
# cancellations made earlier (`_CANCELLED`, returned with the ids found). If the insert fails, nothing is committed and
# no lane is waited for. The wait's statement works out which lanes to wait for itself, a superset, from what it can
# read cheaply after the commit: the wheel, and the levels with a pending segment that may hold the message (their
# filters, as the lookup tests them). A level segment the lookup found is still pending there unless a pass that moved
# past it has committed, and such a pass needs no waiting for: the search of the topics, after, sees what it delivered.
# The procedures embed `_FIND_ONE`, that wait, `_DELIVERED` and `_CANCELLED` as rendered here, each placeholder %(x)s as
# the parameter p_x (tests/ops/test_cancel_procedures.py checks that they still do).
_CALL = {
    "id": "CALL delaywheel.cancel_by_id(%(v)s, %(reason)s)",
    "key": "CALL delaywheel.cancel_by_key(%(v)s, %(h1)s, %(h2)s, %(slots)s, %(reason)s)",
}


def _cancel_in_one_call(
    conn: psycopg.Connection, how: str, params: dict[str, object], reason: str
) -> list[CancelResult]:
    """`cancel` outside a transaction, in one statement (above). Raises CheckViolation, having committed nothing,
    when a message found is due on a day whose `cancellations` partition does not exist yet."""
    with _released_on_error(conn):  # the wait failed part-way (a statement_timeout): the locks it took, released
        # Not prepared: one round trip always. A prepared CALL costs one more whenever psycopg forgets its prepared
        # statements (after any ROLLBACK or DROP on the connection: a pass's lane wait, a retire), and saves nothing:
        # the plans worth keeping are the procedure's own, which the session keeps whatever psycopg does.
        row = conn.execute(_CALL[how], {**params, "reason": reason}, prepare=False).fetchone()
    # A CALL returns its one row; each array NULL when empty. `found` holds the messages found pending, then those
    # with the id or key cancelled earlier (_CANCELLED).
    found, marked, delivered = row  # type: ignore[misc]
    return _outcomes(how, params, found or [], set(marked or ()), set(delivered or ()))


def _outcomes(
    how: str, params: dict[str, object], found: Sequence[int], marked: set[int], delivered: set[int]
) -> list[CancelResult]:
    """One result per message found (`found`: their ids, pending or cancelled earlier, a message once), and one for
    each message with the id or key delivered (`delivered`: their ids, the found ones among them delivered before
    their cancellation); `not_found` when there is neither."""
    results = [
        CancelResult(
            mid, "already_delivered" if mid in delivered else "cancelled" if mid in marked else "already_cancelled"
        )
        for mid in dict.fromkeys(found)
    ]
    seen = set(found)
    results += [CancelResult(mid, "already_delivered") for mid in sorted(delivered - seen)]
    if not results:
        results.append(CancelResult(int(params["v"]) if how == "id" else None, "not_found"))  # type: ignore[call-overload]
    return results


def _cancel_locked(
    conn: psycopg.Connection, cache: PartitionCache, how: str, params: dict[str, object], reason: str
) -> list[CancelResult]:
    """Inside a caller's transaction: the lanes' turns, held until the caller ends it (deliverers of those lanes
    wait for that, or report busy)."""
    with conn.transaction():
        conn.execute(_LOOKUP_PLAN)
        conn.execute(_HOLD_MAY_HOLD[how], params)
        found = conn.execute(_FIND_ONE[how], params).fetchall()
        marked = mark(conn, cache, found, reason)
        delivered = _ids(conn.execute(_DELIVERED[how], params))  # none of `found`: their lanes are locked
        cancelled = _ids_of(conn.execute(_CANCELLED[how], params))
    return _outcomes(how, params, [row[0] for row in found] + cancelled, marked, delivered)


@dataclass(frozen=True)
class Match:
    """A condition on the pending rows `p`, composed by library code only: identifiers through
    `psycopg.sql.Identifier`, values as `%(name)s` parameters in `params`. Callers never build one from text."""

    sql: sql.Composable
    params: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class KeysFrom:
    """The keys of another table's rows, as the structured replacement of a subquery in `where`:
    `KeysFrom("shop.orders", "id", prefix="order-", filters={"status": "paid"})` matches pending messages whose key
    is `'order-' || id` for an order with status 'paid'. `filters` are `column = value` (a list or tuple: `IN`, None:
    `IS NULL`), all ANDed. The table and columns are looked up in the catalog and quoted; every value is bound."""

    table: str
    column: str
    prefix: str = ""
    suffix: str = ""
    filters: Mapping[str, object] = field(default_factory=dict)

    def match(self, conn: psycopg.Connection, name: str = "kf") -> Match:
        from delaywheel.ops.predicate import UnsafeSQL, catalog_table, check_column  # pglast: see where_match

        schema, table, columns = catalog_table(conn, self.table)
        label = f"{schema}.{table}"
        column = check_column(self.column, columns, label)
        params: dict[str, object] = {f"{name}_prefix": self.prefix, f"{name}_suffix": self.suffix}
        conditions: list[sql.Composable] = []
        for i, (col, value) in enumerate(sorted(self.filters.items())):
            ident = sql.SQL("b.{}").format(sql.Identifier(check_column(col, columns, label, what="filter column")))
            if value is None:
                conditions.append(sql.SQL("{} IS NULL").format(ident))
            elif isinstance(value, list | tuple | set | frozenset):
                values = list(value)
                if not values:
                    raise UnsafeSQL(f"filter {col!r} has an empty list of values")
                names = [f"{name}_{i}_{j}" for j in range(len(values))]
                params.update(zip(names, values, strict=True))
                conditions.append(sql.SQL("{} IN ({})").format(ident, sql.SQL(", ").join(map(sql.Placeholder, names))))
            else:
                params[f"{name}_{i}"] = value
                conditions.append(sql.SQL("{} = {}").format(ident, sql.Placeholder(f"{name}_{i}")))
        query = sql.SQL(
            "p.key IN (SELECT {prefix} || b.{column}::text || {suffix} FROM {schema}.{table} b WHERE {where})"
        ).format(
            prefix=sql.Placeholder(f"{name}_prefix"),
            suffix=sql.Placeholder(f"{name}_suffix"),
            column=sql.Identifier(column),
            schema=sql.Identifier(schema),
            table=sql.Identifier(table),
            where=sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true"),
        )
        return Match(query, params)


def where_match(where: str) -> Match:
    """A caller's predicate over the pending rows, checked (`predicate.check_expression`) and rendered from its
    parse tree; the text itself never reaches the server. The checker (pglast, PostgreSQL's parser) is imported
    here, not with the module: every Airflow task, DAG parse and CLI command imports this module, few check text."""
    from delaywheel.ops.predicate import CANCEL_COLUMNS, UnsafeSQL, check_expression

    try:
        checked = check_expression(where, CANCEL_COLUMNS, qualifier="p", what="--where predicate")
    except UnsafeSQL as exc:
        hint = (
            " (to match keys from another table, use keys_from / --keys-from-table)" if "subquery" in str(exc) else ""
        )
        raise UnsafeSQL(f"{exc}{hint}") from None
    return Match(sql.SQL(checked.replace("%", "%%")))


def matching(
    conn: psycopg.Connection,
    *,
    keys: list[str] | None = None,
    where: str | None = None,
    keys_from: KeysFrom | None = None,
    match: Match | None = None,
) -> Match:
    """Every condition given, ANDed: a key list, a checked predicate, keys from another table, a library Match."""
    parts: list[Match] = []
    if keys is not None:
        parts.append(Match(sql.SQL("p.key = ANY(%(keys)s)"), {"keys": [str(k) for k in keys]}))
    if where is not None:
        parts.append(where_match(where))
    if keys_from is not None:
        parts.append(keys_from.match(conn))
    if match is not None:
        parts.append(match)
    if not parts:
        raise ValueError("bulk cancel needs keys, where, keys_from or a match")
    return Match(
        sql.SQL(" AND ").join(sql.SQL("({})").format(m.sql) for m in parts),
        {k: v for m in parts for k, v in m.params.items()},
    )


@contextmanager
def read_only(conn: psycopg.Connection, timeout: timedelta | None) -> Iterator[None]:
    """A READ ONLY transaction with a statement timeout for reads shaped by a caller. Inside a transaction the
    caller owns, a savepoint with the timeout only (read-only cannot be undone before the caller's commit)."""
    ms = f"{int((timeout or MATCH_TIMEOUT).total_seconds() * 1000)}ms"
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        with conn.transaction():
            conn.execute("SET TRANSACTION READ ONLY")
            conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)", (ms,))
            yield
        return
    before = conn.execute("SELECT pg_catalog.current_setting('statement_timeout')").fetchone()[0]  # type: ignore[index]
    try:
        with conn.transaction():
            conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)", (ms,))
            yield
    finally:
        if not conn.broken and conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, true)", (before,))


def _find(columns: str, match: sql.Composable) -> sql.Composed:
    """The pending, not cancelled messages `p` that match (pending.cancelled: the deliverers' own test, probed per
    row found)."""
    return sql.SQL("SELECT {} FROM ({}) p WHERE ({}) AND {}").format(
        sql.SQL(columns), sql.SQL(PENDING), match, not_cancelled("p", probe=True)
    )


def count_matching(
    conn: psycopg.Connection,
    *,
    keys: list[str] | None = None,
    where: str | None = None,
    keys_from: KeysFrom | None = None,
    match: Match | None = None,
    timeout: timedelta | None = None,
) -> int:
    """How many pending, not yet cancelled messages a bulk cancel would hit (for the CLI's guard); read-only."""
    m = matching(conn, keys=keys, where=where, keys_from=keys_from, match=match)
    with read_only(conn, timeout):
        row = conn.execute(
            _find("count(*)", m.sql),
            m.params,
        ).fetchone()
    return int(row[0]) if row else 0


def cancel_matching(
    conn: psycopg.Connection,
    cache: PartitionCache,
    *,
    keys: list[str] | None = None,
    where: str | None = None,
    keys_from: KeysFrom | None = None,
    match: Match | None = None,
    reason: str = "bulk cancel",
    timeout: timedelta | None = None,
) -> int:
    """Cancel, in one set-based statement, every pending message that meets every condition given: its key is in
    `keys`; it satisfies `where`, one expression over (id, deliver_at, key, topic, tags, properties, lane, level)
    checked by `predicate.check_expression` (no subqueries, no functions outside a pure whitelist: `UnsafeSQL`
    otherwise); its key comes from `keys_from` (another table's rows, e.g. the paid orders)."""
    m = matching(conn, keys=keys, where=where, keys_from=keys_from, match=match)
    # Find the matching rows first, read-only: the scan can take a while (a large set, fresh tables without
    # statistics). Then each row found is checked again against the cursors and the cancellations only, so one
    # delivered or cancelled meanwhile is left alone.
    with read_only(conn, timeout):
        found = conn.execute(
            _find("p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text", m.sql),
            m.params,
        ).fetchall()
    if not found:
        return 0
    if not commits_each_statement(conn):  # in the caller's transaction: lock as cancel does
        with conn.transaction():
            conn.execute(_HOLD_EVERY_LANE)
            return len(mark(conn, cache, found, reason))
    # As a single cancel (see `cancel`): commit the cancellations without the lanes' turns, wait for the passes that
    # may have read them before, and leave out what those delivered.
    marked = mark(conn, cache, found, reason)
    if not marked:
        return 0
    await_passes(conn, lane_locks([row for row in found if row[0] in marked]))
    row = conn.execute(
        "SELECT count(DISTINCT message_id) FROM delaywheel.topic_messages"
        " WHERE message_id = ANY(%s::bigint[]) AND origin <> 'replay'",
        (sorted(marked),),
    ).fetchone()
    delivered = int(row[0]) if row else 0
    if delivered:  # left out of the count as delivered: as cancel's `already_delivered`
        durable_answer(conn)
    return len(marked) - delivered
