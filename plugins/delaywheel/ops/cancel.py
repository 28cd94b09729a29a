"""Cancel pending messages by id, by key, or in bulk: by a key list, a checked predicate, or keys from another table.

A cancellation is a row in `cancellations` that deliverers anti-join; the message itself stays until its partition
is retired. A cancel holds no lane lock while deliverers run: it commits its cancellations, then waits for the passes
already running of the lanes that may hold the messages (the only ones that may have read a message without its
cancellation) and reads what they did, all in one statement (a procedure, sql/cancel.sql). A
message is delivered or cancelled, never both, and the caller is told which: a delivery wins (DESIGN.md,
"Cancellation"). Each step of a cancel by id or key is a function of sql/cancel.sql, which the procedures call too:
this module builds only the calls.
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

from delaywheel.db import commits_each_statement
from delaywheel.locks import LEVEL_LOCK, WHEEL_LOCK, turns
from delaywheel.partitions import PartitionCache
from delaywheel.pending import PENDING, STILL_PENDING, not_cancelled
from delaywheel.produce.keyblooms import probe, slots
from delaywheel.types import MAX_ID

MATCH_TIMEOUT = timedelta(minutes=5)  # the default of Settings.match_timeout

Outcome = Literal["cancelled", "already_cancelled", "already_delivered", "not_found"]


@dataclass(frozen=True)
class CancelResult:
    message_id: int | None
    outcome: Outcome


# The steps of a cancel by id or by key (sql/cancel.sql), each called with the parameters `cancel` makes: the id as
# "v", or `key_params`. The finds (read only): the pending messages with the id or key.
_FIND = {
    "id": "SELECT * FROM delaywheel.cancel_find_id(%(v)s)",
    "key": "SELECT * FROM delaywheel.cancel_find_key(%(v)s, %(h1)s, %(h2)s, %(slots)s)",
}
# The lanes that may hold them, as (class, key) rows.
_LANES = {
    "id": "delaywheel.cancel_lanes_id(%(v)s)",
    "key": "delaywheel.cancel_lanes_key(%(v)s, %(h1)s, %(h2)s)",
}
# What became of the messages with the id or key: (ids delivered, ids cancelled earlier), one row.
_SETTLED = {
    "id": "SELECT delivered, cancelled FROM delaywheel.cancel_settled_id(%(v)s)",
    "key": "SELECT delivered, cancelled FROM delaywheel.cancel_settled_key(%(v)s)",
}
# The planner settings of each (delaywheel.lookup_plan): the finds', and the search of the topics and cancellations,
# with generic plans (prepared: planned once per connection); and, in a caller's transaction, the plain ones.
_FIND_PLAN = "SELECT delaywheel.lookup_plan(true, true)"
_SETTLE_PLAN = "SELECT delaywheel.lookup_plan(false, true)"
_LOCKED_PLAN = "SELECT delaywheel.lookup_plan(false, false)"


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
    """The parameters of the lookup by key (delaywheel.cancel_find_key): the key, its filter hashes, its summary
    slots. Typed as the columns they meet (bigint hashes, int slots) rather than by value: psycopg sends a Python int
    as int2, int4 or int8 by its size, and prepares a statement once per combination of types, so a 32-bit hash of
    either half made up to eight prepared lookups per connection, each planned over every partition (an id, likewise,
    three)."""
    h1, h2 = probe(key)
    return {"v": key, "h1": Int8(h1), "h2": Int8(h2), "slots": [Int4(slot) for slot in slots(h2)]}


# Found pending messages: (id, deliver_at, key, lane, level, xid as text), STILL_PENDING's columns.
Found = tuple[int, datetime, str | None, str, int | None, str]


def find(conn: psycopg.Connection, how: str, params: dict[str, object]) -> list[Found]:
    """The pending messages with the id or key (read only, no lane lock). One prepared statement, planned once per
    connection (delaywheel.lookup_plan says why)."""
    with conn.pipeline():  # one round trip; outside a transaction, one implicit transaction for both statements
        conn.execute(_FIND_PLAN)
        cur = conn.execute(_FIND[how], params, prepare=True)
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


# The turns of the lanes that may hold the messages with the id or key (`_LANES`), or of every lane (bulk cancel), held
# until the caller's transaction ends (delaywheel.hold_lanes, in the cancellers' one order).
_HOLD = "SELECT delaywheel.hold_lanes(array_agg(l.class), array_agg(l.key)) FROM {} AS l(class, key)"
_HOLD_MAY_HOLD = {how: _HOLD.format(lanes) for how, lanes in _LANES.items()}
_EVERY_LANE = sql.SQL("""(
        SELECT {wheel_class}, {wheel_key}
        UNION ALL
        SELECT {level_class}, generate_series(1, coalesce((SELECT max(level) FROM delaywheel.level_segments), 0)))""")
_HOLD_EVERY_LANE = _HOLD.format(
    _EVERY_LANE.format(
        wheel_class=sql.Literal(WHEEL_LOCK[0]),
        wheel_key=sql.Literal(WHEEL_LOCK[1]),
        level_class=sql.Literal(LEVEL_LOCK),
    ).as_string()
)
_AWAIT_LANES = "SELECT delaywheel.await_lanes(%(classes)s::int[], %(keys)s::int[])"


def await_passes(conn: psycopg.Connection, locks: Sequence[tuple[int, int]]) -> None:
    """Wait for the delivery passes of these lanes that are running now (delaywheel.await_lanes)."""
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
        settled = _settling(conn, how, params, lane_locks(found))
    marked = {mid for (mid,) in marking.fetchall()} if marking else set()
    return _settled_outcomes(how, params, found, marked, settled)


def settle(
    conn: psycopg.Connection, how: str, params: dict[str, object], found: Sequence[Found], marked: set[int]
) -> list[CancelResult]:
    """The true outcome of each message found, once every pass that may have read it without its cancellation has
    ended (await_passes), and the messages with the id or key delivered earlier: `mark_and_settle`'s second half on
    its own, for a caller that commits the cancellations itself (tests hold a pass open between the two)."""
    with _released_on_error(conn), conn.pipeline():
        settled = _settling(conn, how, params, lane_locks(found))
    return _settled_outcomes(how, params, found, marked, settled)


def _settling(
    conn: psycopg.Connection, how: str, params: dict[str, object], locks: Sequence[tuple[int, int]]
) -> psycopg.Cursor:
    """In a pipeline, one implicit transaction: the wait for the passes holding `locks` (those of the lanes found,
    `lane_locks`), then, in a snapshot after it, the search of the topics and of the cancellations (`_SETTLED`,
    prepared: planned once per connection, as `find`). Returns its cursor."""
    await_passes(conn, locks)
    conn.execute(_SETTLE_PLAN)
    return conn.execute(_SETTLED[how], {"v": params["v"]}, prepare=True)


def _settled_outcomes(
    how: str, params: dict[str, object], found: Sequence[Found], marked: set[int], settled: psycopg.Cursor
) -> list[CancelResult]:
    """`_outcomes` of the messages `found` and of the row of `_SETTLED` in `settled`."""
    delivered, cancelled = settled.fetchone()  # type: ignore[misc]
    return _outcomes(how, params, [row[0] for row in found] + sorted(set(cancelled)), marked, set(delivered))


# --- One statement ---------------------------------------------------------------------------------------------
# `cancel` outside a transaction is one CALL of a procedure (sql/cancel.sql), which runs in one round trip what would
# otherwise be a pipeline of statements: the find and the insert of its cancellations as one statement, COMMIT, the
# wait for the passes in flight of the lanes that may hold the messages (`_LANES`, worked out after the commit), the
# search of the topics and of the cancellations made earlier (`_SETTLED`, the latter returned with the ids found). If
# the insert fails, nothing is committed and no lane is waited for.
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
    # with the id or key cancelled earlier.
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
    wait for that, or report busy). None of the messages found is delivered meanwhile: their lanes are locked."""
    with conn.transaction():
        conn.execute(_LOCKED_PLAN)
        conn.execute(_HOLD_MAY_HOLD[how], params)
        found = conn.execute(_FIND[how], params).fetchall()
        marked = mark(conn, cache, found, reason)
        settled = conn.execute(_SETTLED[how], params)
    return _settled_outcomes(how, params, found, marked, settled)


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
