"""Consumers: pull a batch by consumer group, ack it, or hand failures to RocketMQ's retry ladder.

A topic is read as QUEUES queues by key hash (sql/consume.sql): each member of a group reads only the queues it
holds a lease on, its share of them, so members share a group's load while one key's messages go to one member at a
time, in order. Within a queue, rows are read in (xid, queue_offset) order below the commit horizon, like the level
queues, so a group's offset in a queue never passes a delivery that commits late. Delivery to consumers is
at-least-once: a batch not acked is pulled again (once its lease ends, by any member);
`Delivered.idempotency_id` is the key consumers deduplicate by.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from delaywheel.config import Settings
from delaywheel.consume.retry import dlq_topic, reconsume_later, retries_so_far, retry_topic
from delaywheel.db import COMMIT_HORIZON, QUEUE_PLAN, commits_each_statement
from delaywheel.partitions import PartitionCache
from delaywheel.produce.validation import RECONSUME_TIME, checked_group
from delaywheel.types import MAX_ID, TopicSpan

_log = logging.getLogger(__name__)


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
    # (source, queue) -> (xid, offset) of the batch's last message from that source's queue
    cursors: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    positions: list[tuple[int, int]] = field(default_factory=list)  # each message's (xid, queue_offset) in its topic
    qids: list[int] = field(default_factory=list)  # each message's queue
    # Rows past the group's offset in the queues read that the batch does not hold existed when it was read: rows not
    # readable yet (committed above the commit horizon, or just after the read) or beyond the batch's room. The
    # consumer then looks again within milliseconds rather than wait for the next notification.
    behind: bool = False
    topic: str = ""  # the topic pulled: the leases are the group's on it
    holder: str = ""  # the member that pulled it, whose leases its ack checks
    queues: tuple[int, ...] = ()  # the queues the member held when it read the batch
    # source -> the position up to which the batch holds every row of the queues held past their offsets: its ack
    # moves all of those queues' offsets there (a queue held but idle does not keep the next read's start behind)
    ends: dict[str, tuple[str, int]] = field(default_factory=dict)
    # Rows read that the group's tag filter left out (`tags.parse`): not in `messages`, but behind the cursors, so the
    # batch's ack moves the group's offset past them.
    skipped: int = 0
    # (source, queue) -> how many seeks had moved the group's offset there when the batch was read: an ack moves no
    # offset a seek has moved since (`position.seek`), so a batch read before a rewind does not pass it
    seeks: dict[tuple[str, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        """Whether the pull read anything, handed over or skipped by the tag filter: a batch of skipped rows only
        holds no message, yet needs its ack, or the group reads the same rows again."""
        return bool(self.messages or self.cursors)


@dataclass(frozen=True)
class AckResult:
    """What an ack did. `acked`: messages whose group offset this ack moved past, failed ones included;
    `retried`: of those, the failed ones handed to a retry (or, after the group's last, to the dead-letter
    topic: retry.py); `already_acked`: messages another ack of the group had passed already (a second ack of
    the batch, or another consumer of the group acked further) — nothing was done for them, failed or not;
    `lost`: messages of a batch whose queue another member took after its lease expired: not acked (that member
    handles them); `sought`: messages of queues whose offset a seek moved after the batch was read (`position.seek`):
    not acked, none retried, the group reads on from where the seek put it (a rewind hands them again)."""

    acked: int = 0
    retried: int = 0
    already_acked: int = 0
    lost: int = 0
    sought: int = 0


class LeaseLost(RuntimeError):
    """An ack of a batch whose queue's lease expired and passed to another member of the group: refused, nothing
    acked; the other member handles the batch's messages (at least once)."""


QUEUES = 16  # a topic's queues (topic_messages.qid, a hash of the key: sql/migrations/002_consumer_queues.sql)
DEFAULT_LEASE_S = 30.0  # how long a member holds its queues without pulling (the time to run a batch's handler)
MAX_LEASE_S = 86_400.0


def checked_lease(lease_s: float) -> float:
    """`lease_s` if it is a number of seconds from 0.1 to a day; else ValueError, before anything is read."""
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) or not 0.1 <= lease_s <= MAX_LEASE_S:
        raise ValueError(f"lease_s must be a number of seconds from 0.1 to {MAX_LEASE_S:,.0f}, not {lease_s!r}")
    return float(lease_s)


def sources_of(topic: str, group: str) -> tuple[str, ...]:
    """What a group reads for `topic`: the topic and the group's retry topic; only the topic itself when it is one of
    the group's own reserved topics (its retry topic once, not twice; its DLQ without taking its pending retries)."""
    retry = retry_topic(group)
    return (topic,) if topic in (retry, dlq_topic(group)) else (topic, retry)


MAX_BATCH = 1_000_000  # the most messages one pull reads, holds and acks at once


def checked_batch_size(max_messages: int) -> int:
    """`max_messages` if it is a whole number from 1 to MAX_BATCH; else ValueError, before anything is read."""
    if isinstance(max_messages, bool) or not isinstance(max_messages, int) or not 1 <= max_messages <= MAX_BATCH:
        raise ValueError(f"max_messages must be a whole number from 1 to {MAX_BATCH:,}, not {max_messages!r}")
    return max_messages


def new_holder() -> str:
    """A member's name in its group's leases: unique per consumer loop or per pull."""
    return uuid.uuid4().hex


def pull(
    conn: psycopg.Connection,
    topic: str,
    group: str,
    max_messages: int = 100,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    holder: str | None = None,
    accept: frozenset[str] | None = None,
) -> Batch:
    """The next messages after the group's offsets, from the topic and the group's retry topic, in the queues this
    pull holds for `lease_s` (its share of the group's queues): `ack` them, or `release` the batch, within the lease.
    Of the topic's messages, only those whose tag is in `accept` (None: all; `tags.parse`) are handed over."""
    checked_batch_size(max_messages)
    checked_lease(lease_s)
    sources_of(topic, group)  # a bad group raises before anything is read
    holder = holder or new_holder()
    with conn.transaction():
        batch = _take_and_read(conn, group, topic, holder, lease_s, max_messages, accept, durable=True)
        if not batch:  # nothing read, nothing to ack: hold nothing
            release(conn, batch)
        return batch


def _take_and_read(
    conn: psycopg.Connection,
    group: str,
    topic: str,
    holder: str,
    lease_s: float,
    max_messages: int,
    accept: frozenset[str] | None,
    durable: bool,
) -> Batch:
    """Inside the caller's transaction: the member's share of the queues, then the read of them."""
    sources = sources_of(topic, group)
    queues = _take(conn, group, topic, holder, lease_s, durable=durable)
    rows = _read(conn, group, sources, holder, max_messages).fetchall()
    return _batch(group, sources, rows, max_messages, holder, queues, accept)


def release(conn: psycopg.Connection, batch: Batch) -> None:
    """Give back the batch's queues without acking it: its messages go to the group's next pull at once."""
    if batch.holder:
        give_queues(conn, batch.group, batch.topic, batch.holder)


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


# The queues the member holds on the pulled topic (parameters: group, s0 (the topic), holder), as an array.
_HELD = """q AS MATERIALIZED (
    SELECT coalesce(array_agg(l.qid), '{}') AS held FROM delaywheel.consumer_leases l
    WHERE l.grp = %(group)s AND l.topic = %(s0)s AND l.holder = %(holder)s)"""
# The group's offsets in one source, every queue's (arrays indexed by qid + 1; '0' / 0 before its first ack) with
# its count of seeks, and the lowest of them among the queues held (sx, so): where the source's read starts. NULL
# when no queue is held.
_OFFSETS = sql.SQL("""o{index} AS MATERIALIZED (
    SELECT array_agg(c.x ORDER BY c.q) AS xids, array_agg(c.o ORDER BY c.q) AS offs,
           array_agg(c.s ORDER BY c.q) AS seeks,
           (array_agg(c.x ORDER BY c.x, c.o) FILTER (WHERE c.q = ANY (q.held)))[1] AS sx,
           (array_agg(c.o ORDER BY c.x, c.o) FILTER (WHERE c.q = ANY (q.held)))[1] AS so
    FROM q, LATERAL (
        SELECT g.q, coalesce(f.cursor_xid, '0'::xid8) AS x, coalesce(f.cursor_offset, 0) AS o,
               coalesce(f.seeks, 0) AS s
        FROM generate_series(0, {last}) g(q)
        LEFT JOIN delaywheel.consumer_offsets f ON f.grp = %(group)s AND f.topic = {source} AND f.qid = g.q) c)""")
# One source's next messages in the queues held, past each queue's offset, below the commit horizon (`h`, read once
# for every source), one more than a batch takes: that one, if there, says that the source has more readable rows
# than the batch holds (`Batch.behind`); it is not handed out. The read walks the topic's read index from the lowest
# offset held; a row of a queue not held, or before its queue's offset, is skipped. The columns are Delivered's
# fields in order but the last (source_topic: the source read), then is_json, the source's index (`src`), the
# position, the queue and its offset's count of seeks.
_SOURCE = sql.SQL("""(
    SELECT coalesce(t.properties->>'ORIGIN_TOPIC', t.topic), t.queue_offset, t.message_id, t.key, t.tags,
           t.properties, t.body, t.reconsume_times, t.deliver_at, t.delivered_at,
           t.is_json, {index} AS src, t.xid::text::bigint AS position, t.qid,
           ((SELECT seeks FROM o{index}))[t.qid + 1] AS seeks
    FROM delaywheel.topic_messages t
    WHERE t.topic = {source}
      AND (t.xid, t.queue_offset) > ((SELECT sx FROM o{index}), (SELECT so FROM o{index}))
      AND t.xid < (SELECT x FROM h)
      AND t.qid = ANY ((SELECT held FROM q)::smallint[])
      AND (t.xid, t.queue_offset) > (((SELECT xids FROM o{index}))[t.qid + 1], ((SELECT offs FROM o{index}))[t.qid + 1])
    ORDER BY t.xid, t.queue_offset
    LIMIT %(limit)s + 1
)""")
# Whether the source holds a row in a queue held that no read can take yet (committed at or above the commit
# horizon): a probe of the read index at the horizon. Every such row is past the group's offset, which is a row read,
# so below the horizon when it was read, and the horizon only moves up.
_UNREADABLE = sql.SQL(
    "EXISTS (SELECT FROM delaywheel.topic_messages t WHERE t.topic = {source} AND t.xid >= (SELECT x FROM h)"
    " AND t.qid = ANY ((SELECT held FROM q)::smallint[]))"
)
# Not ordered as a whole: each source's rows come in its read's order as PostgreSQL runs it, and `_batch` orders them
# again, a pass over rows already in order. An ORDER BY here would sort the whole rows, bodies and all.
# The source's last row below the commit horizon (a backward probe of the read index), as text: with every row of the
# queues held up to it read, their offsets may all move there (`Batch.ends`).
_LAST = sql.SQL(
    "(SELECT ARRAY[t.xid::text, t.queue_offset::text] FROM delaywheel.topic_messages t"
    " WHERE t.topic = {source} AND t.xid < (SELECT x FROM h) ORDER BY t.xid DESC, t.queue_offset DESC LIMIT 1)"
)
# Every queue's count of seeks in the source as the read saw them: an ack moves a held queue without messages only
# while no seek moved it since.
_SEEKS = sql.SQL("(SELECT seeks FROM o{index})")
_READ = sql.SQL("""WITH h AS MATERIALIZED (SELECT {horizon} AS x), {held}, {offsets}
SELECT r.*, e.* FROM (SELECT {unreadable} AS behind, {lasts}) e
LEFT JOIN LATERAL ({sources}) r ON true""")


def _read_statement(n: int) -> str:
    """The read of `n` sources (parameters s0, s1, ...; group, holder, limit): every source's rows, each with
    `behind`; no rows: one row of NULLs with it. As text, rendered once: prepared by its text (`_read`)."""
    sources = [(sql.Literal(i), sql.Placeholder(f"s{i}")) for i in range(n)]
    return _READ.format(
        horizon=sql.SQL(COMMIT_HORIZON),
        held=sql.SQL(_HELD),
        offsets=sql.SQL(", ").join(
            _OFFSETS.format(index=i, source=s, last=sql.Literal(QUEUES - 1)) for i, s in sources
        ),
        unreadable=sql.SQL(" OR ").join(_UNREADABLE.format(source=s) for _, s in sources),
        lasts=sql.SQL(", ").join(
            [*(_LAST.format(source=s) for _, s in sources), *(_SEEKS.format(index=i) for i, _ in sources)]
        ),
        sources=sql.SQL("\nUNION ALL\n").join(_SOURCE.format(index=i, source=s) for i, s in sources),
    ).as_string()


_READS = {n: _read_statement(n) for n in (1, 2)}
_FIELDS = tuple(f.name for f in fields(Delivered))[:-1]
_ORDER = operator.itemgetter(len(_FIELDS) + 2, 1)  # a source's order: position (the xid), then queue_offset
assert fields(Delivered)[-1].name == "source_topic"
# The read's planner settings: the cursor's index order across partitions, not "read all, sort" (QUEUE_PLAN), and
# the read planned once per connection (a prepared generic plan): planning it for each batch cost more than running
# it. Nothing is pruned by its parameters.
_READ_PLAN = sql.SQL("{}, set_config('plan_cache_mode', 'force_generic_plan', true)").format(sql.SQL(QUEUE_PLAN))
# An ack that travels with a pull commits without waiting for its WAL to reach the disk: the pull's rows come back
# only after the commit, and beside busy loops that wait is a scheduler tick, on the path from a delivery's
# notification to the handler. A PostgreSQL crash within the next 3 x wal_writer_delay can undo such an ack, and the
# batch is handed out again: the same at-least-once contract as a crash before the ack. A later durable commit (the
# deliverer's) flushes it anyway. `ack` on its own, the loop's last, stays durable.
_ASYNC_ACK = sql.SQL("set_config('synchronous_commit', 'off', true)")
# The member's share of the group's queues on the topic (sql/consume.sql), with the read's plan settings: parameters
# group, topic, holder, lease (seconds).
_TAKE = sql.SQL("SELECT delaywheel.take_queues(%s, %s, %s, make_interval(secs => %s)), {}")
_TAKES = {
    durable: _TAKE.format(_READ_PLAN if durable else sql.SQL(", ").join([_READ_PLAN, _ASYNC_ACK])).as_string()
    for durable in (True, False)
}
_GIVE = "SELECT delaywheel.give_queues(%s, %s, %s)"


def _take(
    conn: psycopg.Connection, group: str, topic: str, holder: str, lease_s: float, durable: bool
) -> tuple[int, ...]:
    row = conn.execute(_TAKES[durable], (group, topic, holder, lease_s), prepare=True).fetchone()
    assert row is not None
    return tuple(row[0] or ())


def _read(
    conn: psycopg.Connection, group: str, sources: tuple[str, ...], holder: str, max_messages: int
) -> psycopg.Cursor[Any]:
    """The read of the group's next messages from each source in the queues `holder` holds, up to `max_messages`
    each, in one statement (_READ_PLAN set earlier in the transaction), results in binary (bodies as they are)."""
    params: dict[str, Any] = {"group": group, "holder": holder, "limit": max_messages}
    params.update({f"s{i}": source for i, source in enumerate(sources)})
    return conn.execute(_READS[len(sources)], params, binary=True, prepare=True)


def _batch(
    group: str,
    sources: tuple[str, ...],
    rows: list[tuple[Any, ...]],
    max_messages: int,
    holder: str,
    queues: tuple[int, ...],
    accept: frozenset[str] | None = None,
) -> Batch:
    """The batch of `_read`'s rows: the first source's first, then the next one's while there is room. A Delivered
    is built from its row's fields directly, not through its generated __init__, which sets each field of the frozen
    class through object.__setattr__ and would be most of a pull's time in Python. With `accept` (the group's tag
    filter, `tags.parse`), rows of the topic whose tag is not in it are skipped: left out of the messages, still
    behind the cursor of their (source, queue). The group's retry topic is not filtered: its messages are the
    group's own, taken already."""
    batch = Batch(group, [], topic=sources[0], holder=holder, queues=queues)
    n = len(_FIELDS)
    left = False  # rows read that the batch has no room for (each source reads one more than a batch takes)
    for i, source in enumerate(sources):
        room = max_messages - len(batch.messages)
        read = sorted((r for r in rows if r[n + 1] == i), key=_ORDER)
        taken = read[:room]
        left = left or len(read) > len(taken)
        keep = None if source == retry_topic(group) else accept  # the tags handed over (None: all)
        last = rows[0][n + 6 + i] if rows else None
        if rows and queues:
            seeks = rows[0][n + 6 + len(sources) + i]
            batch.seeks.update({(source, q): seeks[q] for q in queues if (source, q) not in batch.seeks})
        if len(read) > len(taken):  # cut: up to its last row taken (if any)
            if taken:
                batch.ends[source] = (str(taken[-1][n + 2]), taken[-1][1])
        elif last is not None:  # every readable row of the queues held: up to the source's last readable row
            batch.ends[source] = (last[0], int(last[1]))
        for r in taken:
            pair = (source, r[n + 3])
            batch.cursors[pair] = (str(r[n + 2]), r[1])  # past skipped rows too
            batch.seeks[pair] = r[n + 4]
            if keep is not None and r[4] not in keep:
                batch.skipped += 1
                continue
            message = object.__new__(Delivered)
            values = message.__dict__
            values.update(zip(_FIELDS, r, strict=False))  # (the last columns are the batch's)
            values["source_topic"] = source
            if r[5] is None:
                values["properties"] = {}
            elif type(r[5]) is dict and RECONSUME_TIME in r[5]:  # a retry the wheel delivered: its count is here
                values["reconsume_times"] = retries_so_far(r[7], r[5])
            if r[n]:  # is_json
                values["body"] = _body(r[6], True, r[2])
            batch.messages.append(message)
            batch.positions.append((r[n + 2], r[1]))
            batch.qids.append(r[n + 3])
    batch.behind = left or (bool(rows) and bool(rows[0][n + 5]))  # (no rows: one row of NULLs but `behind`)
    return batch


def ack(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    batch: Batch,
    failed: set[int] | None = None,
    *,
    give_back: bool = True,
) -> AckResult:
    """Commit the batch's offsets; messages whose message_id is in `failed` go to a retry by the group's policy or
    RocketMQ's ladder (or the dead-letter topic after the last, retry.py) in the same transaction; then give the
    batch's queues back (unless `give_back` is false: a consume loop keeps them for its next pull).

    Idempotent: only the messages this ack moves the group's offset past count, and only failed ones among them
    are retried. Acking a batch again, or acking a batch another consumer of the group has acked past, retries
    nothing twice (`AckResult.already_acked`). A `failed` id that is not a message of the batch raises ValueError
    and nothing is acked: it is a bug in the caller, which would otherwise lose that failure silently. A batch whose
    queue another member holds now (its lease expired and was taken) raises LeaseLost and nothing is acked."""
    checked_group(batch.group)
    failed = _checked_failures(batch, failed)
    with conn.transaction():
        moved, held = _move(conn, batch)
        if not held:
            raise LeaseLost(_lost_message(batch))
        result = _ack(conn, settings, cache, batch, failed, moved)
        if give_back:
            release(conn, batch)
        return result


def _lost_message(batch: Batch) -> str:
    return (
        f"the lease of group {batch.group!r} on {batch.topic!r} for queue(s) {sorted({q for _, q in batch.cursors})}"
        " expired and passed to another member: nothing acked; that member handles the batch's"
        f" {len(batch)} message(s) (pull within the lease, or give consume a longer lease_s)"
    )


# The common ack, the batch's leases checked first (locked until commit: a member taking an expired queue waits for
# this ack, then sees its offsets). Only a queue another member holds now refuses it: a queue given back or expired
# and not taken leaves the ack to the offsets, which acks only what no ack passed yet. Then the group's offset in each
# (source, queue) is still before the batch's first message there (where the previous batch's ack left it), and no
# seek moved it since the batch was read, so every message of the batch from it passes; the (source, queue) pairs
# moved come back, with whether every queue of the batch is still this member's. A pair not moved (the group's first
# ack of it, another ack got there first, or a seek) is left to `_ack`'s general path.
_MOVE = sql.SQL("""WITH lease AS MATERIALIZED (
    SELECT l.holder IS NOT NULL AND l.holder <> %(holder)s AND l.expires_at > clock_timestamp() AS taken
    FROM delaywheel.consumer_leases l
    WHERE l.grp = %(group)s AND l.topic = %(topic)s AND l.qid = ANY (%(qids)s::smallint[])
    FOR UPDATE
),
ok AS MATERIALIZED (SELECT NOT coalesce(bool_or(taken), false) AS held FROM lease),
v (topic, qid, xid, "offset", n, first_xid, first_offset, seeks) AS (VALUES {values}),
moved AS (
    UPDATE delaywheel.consumer_offsets o
    SET cursor_xid = v.xid::xid8, cursor_offset = v."offset", acked = o.acked + v.n, updated_at = clock_timestamp()
    FROM v, ok
    WHERE ok.held AND o.grp = %(group)s AND o.topic = v.topic AND o.qid = v.qid
      AND (o.cursor_xid, o.cursor_offset) < (v.first_xid::xid8, v.first_offset) AND o.seeks = v.seeks
    RETURNING o.qid || ' ' || o.topic AS moved
),
-- a queue's first ack: its row, at the batch's position (it read the queue from the start)
added AS (
    INSERT INTO delaywheel.consumer_offsets AS o (grp, topic, qid, cursor_xid, cursor_offset, acked)
    SELECT %(group)s, v.topic, v.qid, v.xid::xid8, v."offset", v.n FROM v, ok
    WHERE ok.held AND NOT EXISTS (
        SELECT FROM delaywheel.consumer_offsets f WHERE f.grp = %(group)s AND f.topic = v.topic AND f.qid = v.qid)
    ON CONFLICT DO NOTHING
    RETURNING o.qid || ' ' || o.topic AS moved
)
SELECT ARRAY(SELECT moved FROM moved UNION ALL SELECT moved FROM added), (SELECT held FROM ok)""")
_MOVE_VALUE = sql.SQL("({}::text, {}::smallint, {}::text, {}::bigint, {}::int, {}::text, {}::bigint, {}::bigint)")


@functools.cache
def _move_statement(pairs: int) -> str:
    """`_MOVE` for a batch's `pairs` (source, queue) pairs. As text, rendered once per shape: psycopg prepares a
    statement it runs often by its text."""
    values = [_MOVE_VALUE.format(*[sql.Placeholder(f"v{i}_{j}") for j in range(8)]) for i in range(pairs)]
    return _MOVE.format(values=sql.SQL(", ").join(values)).as_string()


def _move(conn: psycopg.Connection, batch: Batch) -> tuple[set[tuple[str, int]], bool]:
    """`_MOVE` for the batch: the (source, queue) pairs moved, and whether the member still holds the batch's queues."""
    row = _moving(conn, batch).fetchone()
    assert row is not None
    return _moved(row), bool(row[1])


def _moved(row: tuple[Any, ...]) -> set[tuple[str, int]]:
    return {(topic, int(qid)) for qid, topic in (m.split(" ", 1) for m in row[0])}


# What an ack moves: (source, queue) -> (to xid, to offset, messages passed, first xid, first offset, seeks). A pair
# read passes its messages, from its first (a pair whose rows the tag filter all skipped: from its cursor, passing
# none); every other queue held moves to the source's end untouched. `seeks`: the offset's count of seeks when read.
Moves = dict[tuple[str, int], tuple[str, int, int, str, int, int]]


def _moves(batch: Batch) -> Moves:
    firsts: dict[tuple[str, int], tuple[int, int, int]] = {}  # pair -> (first xid, first offset, count)
    for m, pos, qid in zip(batch.messages, batch.positions, batch.qids, strict=True):
        pair = (m.source_topic, qid)
        first = firsts.get(pair)
        firsts[pair] = (pos[0], pos[1], 1) if first is None else (first[0], first[1], first[2] + 1)
    moves: Moves = {}
    for pair, (xid, offset) in batch.cursors.items():
        end = batch.ends.get(pair[0], (xid, offset))
        first_xid, first_offset, n = firsts.get(pair) or (int(xid), offset, 0)
        moves[pair] = (end[0], end[1], n, str(first_xid), first_offset, batch.seeks.get(pair, 0))
    for source, (xid, offset) in batch.ends.items():
        for qid in batch.queues:
            moves.setdefault((source, qid), (xid, offset, 0, xid, offset, batch.seeks.get((source, qid), 0)))
    return moves


def _moving(conn: psycopg.Connection, batch: Batch) -> psycopg.Cursor[Any]:
    """`_move`'s statement, sent (in a pipeline, not yet answered): its cursor. A batch that moves nothing holds no
    queue to check."""
    moves = _moves(batch)
    params: dict[str, Any] = {"group": batch.group, "topic": batch.topic, "holder": batch.holder}
    params["qids"] = sorted({qid for _, qid in moves})
    for i, ((source, qid), move) in enumerate(moves.items()):
        params.update({f"v{i}_{j}": value for j, value in enumerate((source, qid, *move))})
    if not moves:
        return conn.execute("SELECT ARRAY[]::text[], true")
    return conn.execute(_move_statement(len(moves)), params)


def ack_and_pull(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    done: Batch | None,
    failed: set[int] | None,
    topic: str,
    group: str,
    max_messages: int,
    holder: str,
    lease_s: float = DEFAULT_LEASE_S,
    accept: frozenset[str] | None = None,
) -> tuple[AckResult, Batch]:
    """Ack `done` (as `ack`, keeping its queues) and pull the member's next batch from `topic` and its retry topic, in
    one transaction: the ack's common move (`_MOVE`, its leases checked), the member's share of the queues taken
    (renewed, given back past its share, taken up to it) with the pull's plan settings, then the read of the queues
    held. A (source, queue) the common move did not cover, and failed messages, take `ack`'s general path in between.
    With nothing failed on a connection of its own (not in a caller's transaction) the three statements go as one
    round trip, one implicit transaction that commits without waiting for its WAL flush (`_ASYNC_ACK`). A `done`
    whose lease was lost is not acked (`AckResult.lost`). `accept` is the group's tag filter (`_batch`)."""
    failed = _checked_failures(done, failed) if done is not None else set()
    sources = sources_of(topic, group)
    own = commits_each_statement(conn)  # its own transaction: the ack may commit asynchronously (_ASYNC_ACK)
    if not failed and own:
        with conn.pipeline():
            moving = _moving(conn, done) if done is not None else None
            taking = conn.execute(_TAKES[False], (group, topic, holder, lease_s), prepare=True)
            reading = _read(conn, group, sources, holder, max_messages)
        queues = _queues(taking)
        if moving is None or done is None:
            return AckResult(), _batch(group, sources, reading.fetchall(), max_messages, holder, queues, accept)
        row = moving.fetchone()
        assert row is not None
        moved, held = _moved(row), bool(row[1])
        if not held:
            _log.warning("delaywheel consumer: %s", _lost_message(done))
            return AckResult(lost=len(done)), _batch(
                group, sources, reading.fetchall(), max_messages, holder, queues, accept
            )
        result = _ack(conn, settings, cache, done, set(), moved) if moved >= done.cursors.keys() else None
        if result is not None:
            return result, _batch(group, sources, reading.fetchall(), max_messages, holder, queues, accept)
        # a pair the common move did not cover: the read saw its offset unmoved; ack the rest, then read again
        with conn.transaction():
            result = _ack(conn, settings, cache, done, set(), moved)
            return result, _take_and_read(conn, group, topic, holder, lease_s, max_messages, accept, durable=True)
    with conn.transaction():
        result = AckResult()
        if done is not None:
            moved, held = _move(conn, done)
            if held:
                result = _ack(conn, settings, cache, done, failed, moved)
            else:
                _log.warning("delaywheel consumer: %s", _lost_message(done))
                result = AckResult(lost=len(done))
        # durable unless its own transaction with nothing failed: a retry or dead letter written here must not be
        # undone by a crash after its ack
        durable = not own or bool(failed)
        return result, _take_and_read(conn, group, topic, holder, lease_s, max_messages, accept, durable=durable)


def _queues(taking: psycopg.Cursor[Any]) -> tuple[int, ...]:
    row = taking.fetchone()
    assert row is not None
    return tuple(row[0] or ())


def give_queues(conn: psycopg.Connection, group: str, topic: str, holder: str) -> None:
    """Give back every queue `holder` holds on (group, topic) and leave the group: the end of a consume loop."""
    conn.execute(_GIVE, (group, topic, holder))


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
    moved: Collection[tuple[str, int]],
) -> AckResult:
    """`ack`'s work inside the caller's transaction, after `_move`: `moved` are the (source, queue) pairs it moved."""
    acked: list[Delivered] = []
    sought = 0
    moves = _moves(batch)
    for topic, qid in batch.cursors:  # (a queue held without messages here: moved by `_move` or already past)
        xid, offset = moves[(topic, qid)][:2]
        mine = [
            (m, pos)
            for m, pos, q in zip(batch.messages, batch.positions, batch.qids, strict=True)
            if m.source_topic == topic and q == qid
        ]
        if (topic, qid) in moved:
            acked += [m for m, _ in mine]
            continue
        # the group's offset in the queue, locked until commit: concurrent acks of the group take turns
        row = _lock_offset(conn, batch.group, topic, qid)
        assert row is not None  # `_move` made the queue's first offset row (its `added`)
        if row[2] != batch.seeks.get((topic, qid), 0):
            sought += len(mine)  # a seek moved the offset since the batch was read: where it put it stands
            continue
        before = (int(row[0]), row[1])
        if before >= (int(xid), offset):
            continue  # acked this far already: nothing to commit, nothing to retry
        passed = [m for m, pos in mine if pos > before]
        conn.execute(
            """UPDATE delaywheel.consumer_offsets
               SET cursor_xid = %(xid)s::xid8, cursor_offset = %(offset)s, acked = acked + %(n)s,
                   updated_at = clock_timestamp()
               WHERE grp = %(group)s AND topic = %(topic)s AND qid = %(qid)s""",
            {"group": batch.group, "topic": topic, "qid": qid, "xid": xid, "offset": offset, "n": len(passed)},
        )
        acked += passed
    retry = [m for m in acked if m.message_id in failed]
    if retry:
        reconsume_later(conn, settings, cache, batch.group, retry)
    already = len(batch.messages) - len(acked) - sought
    return AckResult(acked=len(acked), retried=len(retry), already_acked=already, sought=sought)


def _lock_offset(conn: psycopg.Connection, group: str, topic: str, qid: int) -> tuple[str, int, int] | None:
    """The group's offset in (topic, queue) and its count of seeks, locked until commit (None: no row yet)."""
    return conn.execute(
        "SELECT cursor_xid::text, cursor_offset, seeks FROM delaywheel.consumer_offsets"
        " WHERE grp = %s AND topic = %s AND qid = %s FOR UPDATE",
        (group, topic, qid),
    ).fetchone()


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
