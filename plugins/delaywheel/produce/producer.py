"""Sending: validate every message first, then write it all in one transaction, or none of it.

Due times are computed from one reading of the database clock per call, so a batch is consistent and every
worker shares the same clock (DESIGN.md, "Never early"). A batch (`send_many`) travels as columns (`columns.Columns`)
into Arrow record batches written by binary COPY (`arrow_copy`). A single message (`send_one`, what `Store.send`
calls) is one statement: the client applies the rules (`validation.prepare`) and `delaywheel.send_one` (sql/send.sql)
reads the clock, takes the id and writes the row send_many would write. Nothing here imports pyarrow, numpy or
pgpq until a batch is sent, so a single send and the CLI's other commands start without them.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors, pq

from delaywheel.config import Settings
from delaywheel.partitions import PartitionCache
from delaywheel.produce.validation import Message, check_now, check_now_near, prepare

ID_BLOCK = 65536  # ids per nextval (message_id_seq): a call numbers its messages within the blocks it takes
SEGMENT_MAX = 1000  # messages per level segment (level_segments): a pass reads whole segments, so not too many


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one batch. A batch allocates a few objects per message
    (records, rows, due times), none of them in a cycle, yet each allocation threshold rescans the growing
    batch: a sizeable share of send_many's time on a large batch."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def clock_and_ids(
    conn: psycopg.Connection, ids: list[int], count: int, now: datetime | None, settings: Settings
) -> datetime:
    """The clock for this call: `now`, once checked against the database's (`validation.check_now_near`), or the
    database's; `ids` filled with `count` new message ids, ascending (from ceil(count / ID_BLOCK) blocks), unless it
    holds them already: a write that goes again (`PartitionCache.without_ddl`) keeps the ids its first try drew, as a
    sequence's draws are never rolled back. A `now` refused raises before anything is written."""
    check_now(now)
    row = conn.execute(
        "SELECT clock_timestamp(), ARRAY(SELECT nextval('delaywheel.message_id_seq') FROM generate_series(1, %s))",
        (0 if ids else -(-count // ID_BLOCK),),
    ).fetchone()
    assert row is not None
    if now is not None:
        check_now_near(now, row[0], settings)
    for block in row[1]:
        ids.extend(range(block, block + min(ID_BLOCK, count - len(ids))))
    return row[0] if now is None else now


def send_many(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    messages: Iterable[Message],
    *,
    now: datetime | None = None,
    reconsume_times: Sequence[int] | None = None,
) -> list[int]:
    """Write all messages or none; returns their ids in input order."""
    return _send(conn, settings, cache, messages, now, reconsume_times, internal=False)


def send_for_store(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    messages: Iterable[Message],
    reconsume_times: Sequence[int],
) -> list[int]:
    """The store's own sends (the retry ladder, `retry.reconsume_later`): the same rules, except that reserved
    topics (%RETRY%, %DLQ%) and properties (ORIGIN_*, REPLAY_*) are allowed. Not for producers."""
    return _send(conn, settings, cache, messages, None, reconsume_times, internal=True)


def _send(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    messages: Iterable[Message],
    now: datetime | None,
    reconsume_times: Sequence[int] | None,
    *,
    internal: bool,
) -> list[int]:
    batch = list(messages)
    if not batch:
        return []
    from delaywheel.produce.arrow_copy import write_columns  # Arrow, numpy and pgpq: only once a batch is sent
    from delaywheel.produce.columns import prepare_columns

    ids: list[int] = []

    def write() -> list[int]:
        with collector_paused(), conn.transaction():
            clock = clock_and_ids(conn, ids, len(batch), now, settings)
            columns = prepare_columns(batch, clock, settings, reconsume_times, internal=internal)
            write_columns(conn, settings, cache, ids, columns, clock)
        return ids

    return cache.without_ddl(conn, write)  # partitions created before the write, each committed (outside a caller's)


# A fixed instant to apply the rules against when the database's clock decides: every rule but an absolute due
# time's bounds (too_far, too_old) gives the same verdict at any instant, and a delay or level places the message
# at an offset from the clock, which is all send_one needs.
_REFERENCE = datetime(2000, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_SEND_ONE_ARGS = (
    "(%s::text, %s::bytea, %s::boolean, %s::text, %s::text, %s::text, %s::text, %s::smallint, %s::integer,"
    " %s::integer, %s::bigint, %s::timestamptz, %s::timestamptz, %s::bigint, %s::bigint, %s::bigint)"
)
SEND_ONE = "SELECT message_id, clock, NULL, NULL FROM delaywheel.send_one" + _SEND_ONE_ARGS
# In the caller's transaction: the same, as a subtransaction that returns its error rather than raising it (sql/send.sql)
SEND_ONE_SAVEPOINT = (
    "SELECT message_id, clock, error_state, error_message FROM delaywheel.send_one_savepoint" + _SEND_ONE_ARGS
)


def send_one(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    message: Message,
    *,
    now: datetime | None = None,
) -> int:
    """Send one message in one statement (`delaywheel.send_one`, sql/send.sql); returns its id. The same rules, verdicts
    and stored rows as `send_many([message])`. Outside a transaction the statement is its own; inside one the
    caller opened on `conn` it runs as a savepoint, which the server takes and releases within the statement
    (`send_one_savepoint`): an error rolls back the send alone and is raised here as its SQLSTATE's psycopg error
    (its message; no further diagnostics), and the caller's transaction goes on."""
    now = check_now(now)
    if now is not None and not settings.test_clock:  # one more round trip, only for an injected clock
        check_now_near(now, database_clock(conn), settings)
    deliver_at = message.deliver_at
    absolute = (
        now is None
        and message.delay_level is None
        and message.delay is None
        and isinstance(deliver_at, datetime)
        and deliver_at.utcoffset() is not None
    )
    probe = now if now is not None else deliver_at if absolute else _REFERENCE
    assert probe is not None
    prepared = prepare(message, probe, settings)  # raises InvalidMessage: nothing sent
    placement = prepared.placement
    params: tuple[Any, ...] = (
        prepared.topic,
        prepared.body,
        prepared.is_json,
        prepared.key,
        prepared.tags,
        json.dumps(prepared.properties) if prepared.properties else None,  # as columns.py writes them
        "at" if absolute else placement.lane,
        placement.level or 0,
        placement.requested_level or 0,
        prepared.reconsume_times,
        None if absolute else (placement.deliver_at - probe) // _US,
        deliver_at if absolute else None,
        now,
        settings.wheel_max_delay // _US,
        settings.past_tolerance // _US,
        settings.wheel_near_window // _US,
    )
    idle = conn.info.transaction_status == pq.TransactionStatus.IDLE
    row = conn.execute(SEND_ONE if idle else SEND_ONE_SAVEPOINT, params).fetchone()
    assert row is not None
    message_id, clock, error_state, error_message = row
    if error_state is not None:  # rolled back to the function's own savepoint: the caller's transaction goes on
        raise _error(error_state, error_message)
    if message_id is None:  # an absolute due time out of bounds at the database's clock: name the rule it breaks
        prepare(message, clock, settings)
        return send_many(conn, settings, cache, [message], now=clock)[0]  # (the rules would have raised)
    return int(message_id)


def database_clock(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _error(sqlstate: str, message: str) -> psycopg.Error:
    """The psycopg exception a statement failing with this SQLSTATE raises (DatabaseError for one psycopg lacks)."""
    try:
        return errors.lookup(sqlstate)(message)
    except KeyError:
        return psycopg.DatabaseError(f"{message} (SQLSTATE {sqlstate})")
