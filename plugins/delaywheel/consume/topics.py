"""Consumers: pull a batch by consumer group, ack it, or hand failures to RocketMQ's retry ladder.

Topic rows are read in (xid, queue_offset) order below the commit horizon, like the level queues, so a
group's offset never passes a delivery that commits late. Delivery to consumers is at-least-once: a
batch not acked is pulled again; `Delivered.idempotency_id` is the key consumers deduplicate by.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from delaywheel.config import Settings
from delaywheel.db import COMMIT_HORIZON, QUEUE_PLAN, commits_each_statement
from delaywheel.locks import GROUP_LOCK, GROUP_TOPIC_KEY
from delaywheel.partitions import PartitionCache
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import DLQ_PREFIX, RETRY_PREFIX, Message, checked_group
from delaywheel.types import MAX_ID, TopicSpan

_log = logging.getLogger(__name__)

FIRST_RETRY_LEVEL = 3  # RocketMQ: retry n is delayed by level 3 + n


@dataclass(frozen=True)
class Delivered:
    """A delivered message as a consumer sees it (`delaywheel.Delivered`). What a producer hands over is a
    `delaywheel.Message` (`validation.Message`): another class, with another name."""

    topic: str
    queue_offset: int
    message_id: int
    key: str | None
    tags: str | None
    properties: dict[str, str]
    body: bytes | Any
    reconsume_times: int
    deliver_at: datetime
    delivered_at: datetime
    source_topic: str  # the topic it was read from (the group's retry topic for retries)

    @property
    def idempotency_id(self) -> int:
        """The original message's id, the same across retries: deduplicate on this. Only the store writes
        ORIGIN_MESSAGE_ID (producers may not, validation.RESERVED_PROPERTIES); a value that is not an id anyway
        (a row written some other way) gives this message's own id rather than an error."""
        origin = self.properties.get("ORIGIN_MESSAGE_ID") if isinstance(self.properties, dict) else None
        if isinstance(origin, str) and origin.isascii() and origin.isdigit() and len(origin) <= 19:
            value = int(origin)
            if value <= MAX_ID:
                return value
        return self.message_id


@dataclass
class Batch:
    group: str
    messages: list[Delivered]
    cursors: dict[str, tuple[str, int]] = field(default_factory=dict)  # topic -> (xid, offset) of its last message
    positions: list[tuple[int, int]] = field(default_factory=list)  # each message's (xid, queue_offset) in its topic
    # Rows past the group's offset that the batch does not hold existed when it was read: rows not readable yet
    # (committed above the commit horizon, or just after the read) or beyond the batch's room. The consumer then
    # looks again within milliseconds rather than wait for the next notification (which may have come already).
    behind: bool = False
    # Rows read that the group's tag filter left out (`tags.parse`): not in `messages`, but behind the cursors, so the
    # batch's ack moves the group's offset past them.
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        """Whether the pull read anything, handed over or skipped by the tag filter: a batch of skipped rows only
        holds no message, yet needs its ack, or the group reads the same rows again."""
        return bool(self.messages or self.cursors)


@dataclass(frozen=True)
class AckResult:
    """What an ack did. `acked`: messages whose group offset this ack moved past, failed ones included;
    `retried`: of those, the failed ones handed to the retry ladder (or, after `max_reconsume_times`, the
    dead-letter topic); `already_acked`: messages another ack of the group had passed already (a second ack of
    the batch, or another consumer of the group acked further) — nothing was done for them, failed or not."""

    acked: int = 0
    retried: int = 0
    already_acked: int = 0


def retry_topic(group: str) -> str:
    """The group's retry topic; a group whose retry topic would not be a topic name raises (`check_group`): so pull,
    ack and a consumer refuse it before anything is read or written, and its failures can always be acked."""
    return RETRY_PREFIX + checked_group(group)


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + checked_group(group)


MAX_BATCH = 1_000_000  # the most messages one pull reads, holds and acks at once


def checked_batch_size(max_messages: int) -> int:
    """`max_messages` if it is a whole number from 1 to MAX_BATCH; else ValueError, before anything is read."""
    if isinstance(max_messages, bool) or not isinstance(max_messages, int) or not 1 <= max_messages <= MAX_BATCH:
        raise ValueError(f"max_messages must be a whole number from 1 to {MAX_BATCH:,}, not {max_messages!r}")
    return max_messages


def pull(
    conn: psycopg.Connection, topic: str, group: str, max_messages: int = 100, accept: frozenset[str] | None = None
) -> Batch:
    """The next messages after the group's committed offset, from the topic and the group's retry topic; of the
    topic's, only those whose tag is in `accept` (None: all; `tags.parse`)."""
    checked_batch_size(max_messages)
    sources = (topic, retry_topic(group))
    with conn.transaction():
        conn.execute(_SET_READ_PLAN)
        return _batch(group, sources, _read(conn, group, sources, max_messages).fetchall(), max_messages, accept)


def _body(data: bytes, is_json: bool, message_id: int) -> Any:
    """A delivered body as the consumer gets it. Every body the store wrote as JSON decodes; a row written into a
    topic by hand that does not (bad UTF-8 or JSON) is handed over as its raw bytes, with a warning, rather than
    raise: a body no consumer could ever decode must not stop its group (invariant 7)."""
    if not is_json:
        return data
    try:
        return json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        _log.warning("message %s: its body is marked JSON but does not decode; handed over as raw bytes", message_id)
        return data


# The group's offset in one source (`source`: the parameter naming it), as a row to compare (xid, queue_offset) with.
_OFFSET = sql.SQL("""(
          coalesce((SELECT cursor_xid FROM delaywheel.consumer_offsets WHERE grp = %(group)s AND topic = {source}), '0'),
          coalesce((SELECT cursor_offset FROM delaywheel.consumer_offsets WHERE grp = %(group)s AND topic = {source}), 0))""")
# One source's next messages after the group's offset, below the commit horizon (`h`, read once for every source),
# one more than a batch takes: that one, if there, says that the source has more readable rows than the batch holds
# (`Batch.behind`); it is not handed out. The columns are Delivered's fields in order but the last (source_topic: the
# source read), then is_json, the source's index (`src`) and the position.
_SOURCE = sql.SQL("""(
    SELECT coalesce(t.properties->>'ORIGIN_TOPIC', t.topic), t.queue_offset, t.message_id, t.key, t.tags,
           t.properties, t.body, t.reconsume_times, t.deliver_at, t.delivered_at,
           t.is_json, {index} AS src, t.xid::text::bigint AS position
    FROM delaywheel.topic_messages t
    WHERE t.topic = {source} AND (t.xid, t.queue_offset) > {offset}
      AND t.xid < (SELECT x FROM h)
    ORDER BY t.xid, t.queue_offset
    LIMIT %(limit)s + 1
)""")
# Whether the source holds a row that no read can take yet (committed at or above the commit horizon): one probe of
# the read's index at the horizon. Every such row is past the group's offset, which is a row read, so below the
# horizon when it was read, and the horizon only moves up. With the read's rows (below the horizon) that is every row
# past the offset. (Bounded by the offset too, the probe would start from the offset and walk the rows after it;
# counting the rows past the offset would walk the batch's rows a second time.)
_UNREADABLE = sql.SQL(
    "EXISTS (SELECT FROM delaywheel.topic_messages t WHERE t.topic = {source} AND t.xid >= (SELECT x FROM h))"
)
# Not ordered as a whole: each source's rows come in its read's order as PostgreSQL runs it, and `_batch` orders them
# again, a pass over rows already in order. An ORDER BY here would sort the whole rows, bodies and all, a sizeable
# part of a pull's server time.
_READ = sql.SQL("""WITH h AS MATERIALIZED (SELECT {horizon} AS x)
SELECT r.*, e.behind FROM (SELECT {unreadable} AS behind) e
LEFT JOIN LATERAL ({sources}) r ON true""")


def _read_statement(n: int) -> str:
    """The read of `n` sources (parameters s0, s1, ...): every source's rows, each with `behind` (a source holds
    rows past the offset not readable yet); no rows: one row of NULLs with it. As text, rendered once: prepared by
    its text (`_read`)."""
    sources = [(sql.Literal(i), sql.Placeholder(f"s{i}")) for i in range(n)]
    return _READ.format(
        horizon=sql.SQL(COMMIT_HORIZON),
        unreadable=sql.SQL(" OR ").join(_UNREADABLE.format(source=s) for _, s in sources),
        sources=sql.SQL("\nUNION ALL\n").join(
            _SOURCE.format(index=i, source=s, offset=_OFFSET.format(source=s)) for i, s in sources
        ),
    ).as_string()


_READS = {n: _read_statement(n) for n in (1, 2)}
_FIELDS = tuple(f.name for f in fields(Delivered))[:-1]
_ORDER = operator.itemgetter(len(_FIELDS) + 2, 1)  # a source's order: position (the xid), then queue_offset
assert fields(Delivered)[-1].name == "source_topic"
# The read's planner settings: the cursor's index order across partitions, not "read all, sort" (QUEUE_PLAN), and
# the read planned once per connection (a prepared generic plan): it names topic_messages four times, and planning
# it for each batch cost more than running it. Nothing is pruned by its parameters.
_READ_PLAN = sql.SQL("{}, set_config('plan_cache_mode', 'force_generic_plan', true)").format(sql.SQL(QUEUE_PLAN))
# An ack that travels with a pull commits without waiting for its WAL to reach the disk: the pull's rows come back
# only after the commit, and beside busy loops that wait is a scheduler tick, on the path from a delivery's
# notification to the handler. A PostgreSQL crash within the next 3 x wal_writer_delay
# can undo such an ack, and the batch is handed out again: the same at-least-once contract as a crash before the
# ack. A later durable commit (the deliverer's) flushes it anyway. `ack` on its own, the loop's last, stays durable.
_ASYNC_ACK = sql.SQL("set_config('synchronous_commit', 'off', true)")
_SET_READ_PLAN = sql.SQL("SELECT {}").format(_READ_PLAN).as_string()
# The group lock's keys on (group, source): parameters group, then source.
_GROUP_LOCK_KEYS = sql.SQL("{}, {}").format(sql.Literal(GROUP_LOCK), sql.SQL(GROUP_TOPIC_KEY))


def _read(conn: psycopg.Connection, group: str, sources: tuple[str, ...], max_messages: int) -> psycopg.Cursor[Any]:
    """The read of the group's next messages from each source, up to `max_messages` each, in one statement
    (_READ_PLAN set earlier in the transaction), results in binary (bodies as they are, not hex text)."""
    params: dict[str, Any] = {"group": group, "limit": max_messages}
    params.update({f"s{i}": source for i, source in enumerate(sources)})
    return conn.execute(_READS[len(sources)], params, binary=True, prepare=True)


def _batch(
    group: str,
    sources: tuple[str, ...],
    rows: list[tuple[Any, ...]],
    max_messages: int,
    accept: frozenset[str] | None = None,
) -> Batch:
    """The batch of `_read`'s rows: the first source's first, then the next one's while there is room. A Delivered
    is built from its row's fields directly, not through its generated __init__, which sets each field of the frozen
    class through object.__setattr__ and would be most of a pull's time in Python. With `accept` (the group's tag
    filter, `tags.parse`), rows of the topic whose tag is not in it are skipped: left out of the messages, still
    behind the cursor. The group's retry topic is not filtered: its messages are the group's own, taken already."""
    batch = Batch(group, [])
    n = len(_FIELDS)
    left = False  # rows read that the batch has no room for (each source reads one more than a batch takes)
    for i, source in enumerate(sources):
        room = max_messages - len(batch.messages)
        read = sorted((r for r in rows if r[n + 1] == i), key=_ORDER)
        taken = read[:room]
        left = left or len(read) > len(taken)
        kept = taken if accept is None or source == RETRY_PREFIX + group else [r for r in taken if r[4] in accept]
        batch.skipped += len(taken) - len(kept)
        for r in kept:
            message = object.__new__(Delivered)
            values = message.__dict__
            values.update(zip(_FIELDS, r, strict=False))  # (the last columns are the batch's)
            values["source_topic"] = source
            if r[5] is None:
                values["properties"] = {}
            if r[n]:  # is_json
                values["body"] = _body(r[6], True, r[2])
            batch.messages.append(message)
            batch.positions.append((r[n + 2], r[1]))
        if taken:
            batch.cursors[source] = (str(taken[-1][n + 2]), taken[-1][1])
    batch.behind = left or (bool(rows) and bool(rows[0][n + 3]))  # (no rows: one row of NULLs but `behind`)
    return batch


def ack(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    batch: Batch,
    failed: set[int] | None = None,
) -> AckResult:
    """Commit the batch's offsets; messages whose message_id is in `failed` go to the retry ladder
    (or the dead-letter topic after `max_reconsume_times`) in the same transaction.

    Idempotent: only the messages this ack moves the group's offset past count, and only failed ones among them
    are retried. Acking a batch again, or acking a batch another consumer of the group has acked past, retries
    nothing twice (`AckResult.already_acked`). A `failed` id that is not a message of the batch raises ValueError
    and nothing is acked: it is a bug in the caller, which would otherwise lose that failure silently."""
    checked_group(batch.group)
    failed = _checked_failures(batch, failed)
    with conn.transaction():
        moved, _ = _move(conn, batch)
        return _ack(conn, settings, cache, batch, failed, moved)


# The common ack: the group's offset for a source is still before the batch's first message from it (where the
# previous batch's ack left it), so every message of the batch from it passes; the sources moved come back. A source
# not moved (the group's first ack of it, or another ack got there first) is left to `_ack`'s general path.
_MOVE = sql.SQL("""WITH v (topic, xid, "offset", n, first_xid, first_offset) AS (VALUES {values}),
moved AS (
    UPDATE delaywheel.consumer_offsets o
    SET cursor_xid = v.xid::xid8, cursor_offset = v."offset", acked = o.acked + v.n, updated_at = clock_timestamp()
    FROM v
    WHERE o.grp = %s AND o.topic = v.topic AND (o.cursor_xid, o.cursor_offset) < (v.first_xid::xid8, v.first_offset)
    RETURNING o.topic
)
SELECT ARRAY(SELECT topic FROM moved){extra}""")
_MOVE_VALUE = sql.SQL("(%s::text, %s::text, %s::bigint, %s::int, %s::text, %s::bigint)")
_NO_MOVE = sql.SQL("SELECT ARRAY[]::text[]{extra}")


@functools.cache
def _move_statement(sources: int, tries: int | None, durable: bool = True) -> str:
    """`_MOVE` for a batch's `sources` sources (0: nothing to move), then, for a pull (`tries` not None), the pull's
    plan settings, `_ASYNC_ACK` unless `durable`, and `tries` tries of the group lock. As text, rendered once per
    shape: psycopg prepares a statement it runs often by its text, and a pull need not compose it again."""
    extra: sql.Composable = sql.SQL("")
    if tries is not None:
        try_lock = sql.SQL("pg_try_advisory_lock({})").format(_GROUP_LOCK_KEYS)
        settings = [_READ_PLAN] if durable else [_READ_PLAN, _ASYNC_ACK]
        extra = sql.SQL(", {}").format(sql.SQL(", ").join([*settings, *[try_lock] * tries]))
    if not sources:
        return _NO_MOVE.format(extra=extra).as_string()
    return _MOVE.format(values=sql.SQL(", ").join([_MOVE_VALUE] * sources), extra=extra).as_string()


def _move(
    conn: psycopg.Connection,
    batch: Batch | None,
    tries: int | None = None,
    params: list[Any] | None = None,
    durable: bool = True,
) -> tuple[set[str], tuple[Any, ...]]:
    """In one statement, `_MOVE` for each source of `batch` (if any), then for a pull (`tries` not None) its plan
    settings (`_move_statement`) and `tries` tries of the group lock (with `params`) after the moves' column.
    Returns the sources moved and the row."""
    row = _moving(conn, batch, tries, params, durable).fetchone()
    assert row is not None
    return set(row[0]), row


def _moving(
    conn: psycopg.Connection,
    batch: Batch | None,
    tries: int | None = None,
    params: list[Any] | None = None,
    durable: bool = True,
) -> psycopg.Cursor[Any]:
    """`_move`'s statement, sent (in a pipeline, not yet answered): its cursor."""
    values: list[Any] = []
    sources = 0
    if batch is not None and batch.cursors:
        for topic, (xid, offset) in batch.cursors.items():
            mine = [pos for m, pos in zip(batch.messages, batch.positions, strict=True) if m.source_topic == topic]
            first = mine[0] if mine else (xid, offset)  # none: every row read from it was skipped by the tag filter
            values += [topic, xid, offset, len(mine), str(first[0]), first[1]]
        sources = len(batch.cursors)
        values.append(batch.group)
    return conn.execute(_move_statement(sources, tries, durable), values + (params or []))


def ack_and_pull(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    done: Batch | None,
    failed: set[int] | None,
    topic: str,
    group: str,
    max_messages: int,
    held: frozenset[str] = frozenset(),
    accept: frozenset[str] | None = None,
) -> tuple[AckResult, Batch, frozenset[str]]:
    """Ack `done` (as `ack`) and pull the group's next batch from `topic` and its retry topic, in one transaction:
    BEGIN; the ack's common move (`_MOVE`) with the pull's plan settings and lock tries; the read of both sources;
    COMMIT. A source the common move did not cover, and failed messages, take `ack`'s general path in between. In
    the steady state (the group's locks held, nothing failed) the move and the read go as one round trip, one
    implicit transaction (`_ack_and_pull_held`). On a connection of its own (not in a caller's transaction) the
    transaction commits without waiting for its WAL flush (`_ASYNC_ACK`).

    The group lock (GROUP_LOCK) is tried for each source not in `held` in the statement that sets the pull's plan;
    a source whose lock another consumer of the group holds is not read. The read is a later statement, so its
    snapshot is taken after the lock was granted, hence after the previous holder's ack committed. Returns the
    ack's result, the batch, and the sources whose locks this session now holds: the caller releases them
    (`release_group_locks`) only after the transaction committed, once it has nothing of theirs in hand. `accept`
    is the group's tag filter (`_batch`)."""
    failed = _checked_failures(done, failed) if done is not None else set()
    sources = (topic, retry_topic(group))
    wanted = [s for s in sources if s not in held]
    own = commits_each_statement(conn)  # its own transaction: the ack may commit asynchronously (_ASYNC_ACK)
    if not wanted and not failed and own:
        result, pulled = _ack_and_pull_held(conn, settings, cache, done, group, sources, max_messages, accept)
        if pulled is not None:
            return result, pulled, held
        _, batch, now_held = ack_and_pull(conn, settings, cache, None, None, topic, group, max_messages, held, accept)
        return result, batch, now_held
    params = [v for s in wanted for v in (group, s)]
    with conn.transaction():
        moved, row = _move(conn, done, len(wanted), params, durable=not own)
        now_held = held | {s for s, got in zip(wanted, row[len(row) - len(wanted) :], strict=True) if got}
        result = _ack(conn, settings, cache, done, failed, moved) if done is not None else AckResult()
        readable = tuple(s for s in sources if s in now_held)
        rows = _read(conn, group, readable, max_messages).fetchall() if readable else []
        batch = _batch(group, readable, rows, max_messages, accept)
    return result, batch, frozenset(now_held)


def _ack_and_pull_held(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    done: Batch | None,
    group: str,
    sources: tuple[str, ...],
    max_messages: int,
    accept: frozenset[str] | None = None,
) -> tuple[AckResult, Batch | None]:
    """`ack_and_pull` with both sources' group locks held and nothing failed, in one round trip: the common move
    with the pull's plan settings and the read, sent together and ended by one Sync, so one implicit transaction
    (the connection commits each statement: `db.commits_each_statement`). BEGIN, the two statements and COMMIT
    awaited one by one would be four round trips, and each costs a wake-up of the consumer and of its server process,
    which wait for a CPU on a busy machine. When the common
    move did not cover every source of `done` (the group's first ack of a source, or another consumer acked past
    it), the read saw that source's offset unmoved: it is dropped (no batch), and the rest of the ack is done by
    `ack`'s general path in a transaction of its own (at least once either way: acks are idempotent)."""
    with conn.pipeline():
        moving = _moving(conn, done, 0, durable=False)
        reading = _read(conn, group, sources, max_messages)
    row = moving.fetchone()
    assert row is not None
    moved = set(row[0])
    if done is not None and not moved >= done.cursors.keys():
        with conn.transaction():
            return _ack(conn, settings, cache, done, set(), moved), None
    result = _ack(conn, settings, cache, done, set(), moved) if done is not None else AckResult()
    return result, _batch(group, sources, reading.fetchall(), max_messages, accept)


def release_group_locks(conn: psycopg.Connection, group: str, sources: frozenset[str] | set[str]) -> None:
    """Release the group locks `ack_and_pull` took on this session (call after its transaction committed)."""
    if sources:
        unlock = sql.SQL("pg_advisory_unlock({})").format(_GROUP_LOCK_KEYS)
        conn.execute(
            sql.SQL("SELECT {}").format(sql.SQL(", ").join([unlock] * len(sources))),
            [v for s in sorted(sources) for v in (group, s)],
        )


def _checked_failures(batch: Batch, failed: set[int] | None) -> set[int]:
    failed = set(failed or ())
    unknown = failed - {m.message_id for m in batch.messages}
    if unknown:
        shown = ", ".join(str(i) for i in sorted(unknown)[:10]) + (" ..." if len(unknown) > 10 else "")
        raise ValueError(
            f"failed holds {len(unknown)} id(s) that are not messages of this batch: {shown}; nothing was acked"
        )
    return failed


def _ack(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    batch: Batch,
    failed: set[int],
    moved: Collection[str],
) -> AckResult:
    """`ack`'s work inside the caller's transaction, after `_move`: `moved` are the sources it moved."""
    acked: list[Delivered] = []
    for topic, (xid, offset) in batch.cursors.items():
        if topic in moved:
            acked += [m for m in batch.messages if m.source_topic == topic]
            continue
        # the group's offset for the topic, locked until commit: concurrent acks of the group take turns
        row = _lock_offset(conn, batch.group, topic)
        if row is None:  # the group's first ack of the topic (a second round trip, once)
            conn.execute(
                "INSERT INTO delaywheel.consumer_offsets (grp, topic) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (batch.group, topic),
            )
            row = _lock_offset(conn, batch.group, topic)
        before = (int(row[0]), row[1]) if row else (0, 0)
        if before >= (int(xid), offset):
            continue  # acked this far already: nothing to commit, nothing to retry
        passed = [
            m
            for m, pos in zip(batch.messages, batch.positions, strict=True)
            if m.source_topic == topic and pos > before
        ]
        conn.execute(
            """UPDATE delaywheel.consumer_offsets
               SET cursor_xid = %(xid)s::xid8, cursor_offset = %(offset)s, acked = acked + %(n)s,
                   updated_at = clock_timestamp()
               WHERE grp = %(group)s AND topic = %(topic)s""",
            {"group": batch.group, "topic": topic, "xid": xid, "offset": offset, "n": len(passed)},
        )
        acked += passed
    retry = [m for m in acked if m.message_id in failed]
    if retry:
        _reconsume_later(conn, settings, cache, batch.group, retry)
    return AckResult(acked=len(acked), retried=len(retry), already_acked=len(batch.messages) - len(acked))


def _lock_offset(conn: psycopg.Connection, group: str, topic: str) -> tuple[str, int] | None:
    return conn.execute(
        "SELECT cursor_xid::text, cursor_offset FROM delaywheel.consumer_offsets WHERE grp = %s AND topic = %s"
        " FOR UPDATE",
        (group, topic),
    ).fetchone()


def _reconsume_later(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, group: str, messages: list[Delivered]
) -> None:
    outgoing, times = [], []
    for m in messages:
        times.append(m.reconsume_times + 1)
        # as strings: a row written some other way may hold other JSON values, and its retry must not fail the ack
        properties = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (m.properties or {}).items()}
        properties.setdefault("ORIGIN_TOPIC", m.topic)
        properties.setdefault("ORIGIN_MESSAGE_ID", str(m.message_id))
        if times[-1] > settings.max_reconsume_times:
            outgoing.append(Message(dlq_topic(group), m.body, key=m.key, tags=m.tags, properties=properties))
        else:
            level = FIRST_RETRY_LEVEL + m.reconsume_times
            outgoing.append(
                Message(retry_topic(group), m.body, delay_level=level, key=m.key, tags=m.tags, properties=properties)
            )
    send_for_store(conn, settings, cache, outgoing, times)  # the store's own: reserved topics and properties


# Messages in a topic past the watchers' mark and below the commit horizon (what a consumer could read now).
_FRESH = (
    """
WITH m AS (SELECT seen_xid, seen_offset FROM delaywheel.topic_watch WHERE topic = %(topic)s /*lock*/),
fresh AS (
    SELECT t.xid, t.queue_offset FROM delaywheel.topic_messages t, m
    WHERE t.topic = %(topic)s AND (t.xid, t.queue_offset) > (m.seen_xid, m.seen_offset)
      AND t.xid < """
    + COMMIT_HORIZON
    + """
)
"""
)
# The idle look, read-only and lock-free: is there a mark yet, and anything past it?
_LOOK = _FRESH + "SELECT EXISTS (SELECT 1 FROM m), EXISTS (SELECT 1 FROM fresh)"
# The claim, under the mark's row lock (two watchers never announce the same messages): the count and the
# first and last (xid, queue_offset).
_CLAIM = (
    _FRESH.replace("/*lock*/", "FOR UPDATE")
    + """
SELECT (SELECT count(*) FROM fresh),
       (SELECT ARRAY[xid::text, queue_offset::text] FROM fresh ORDER BY xid, queue_offset LIMIT 1),
       (SELECT ARRAY[xid::text, queue_offset::text] FROM fresh ORDER BY xid DESC, queue_offset DESC LIMIT 1)
"""
)


async def announce_new(conn: psycopg.AsyncConnection, topic: str) -> TopicSpan | None:
    """Claim the messages that reached `topic` since the last announcement: returns their span and moves
    the mark past them, in one transaction; None when there is nothing new. A watcher calls this every
    second per topic, so the common case (nothing new) is one read-only query that writes and locks nothing."""
    look = await (await conn.execute(_LOOK, {"topic": topic})).fetchone()
    has_mark, has_new = look if look else (False, False)
    if has_mark and not has_new:
        return None
    async with conn.transaction():
        if not has_mark:
            await conn.execute(
                "INSERT INTO delaywheel.topic_watch (topic) VALUES (%s) ON CONFLICT DO NOTHING", (topic,)
            )
        row = await (await conn.execute(_CLAIM, {"topic": topic})).fetchone()
        if row is None or not row[0]:
            return None
        count, first, last = int(row[0]), row[1], row[2]
        await conn.execute(
            "UPDATE delaywheel.topic_watch SET seen_xid = %s::xid8, seen_offset = %s, announced = announced + %s,"
            " fired_at = clock_timestamp() WHERE topic = %s",
            (last[0], int(last[1]), count, topic),
        )
    return TopicSpan(count, (first[0], int(first[1])), (last[0], int(last[1])))
