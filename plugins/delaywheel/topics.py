"""Consumers: pull a batch by consumer group, ack it, or hand failures to RocketMQ's retry ladder.

Topic rows are read in (xid, queue_offset) order below the commit horizon, like the level queues, so a
group's offset never passes a delivery that commits late. Delivery to consumers is at-least-once: a
batch not acked is pulled again; `Message.idempotency_id` is the key consumers deduplicate by.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from .config import Settings
from .db import COMMIT_HORIZON, QUEUE_PLAN
from .levels import TopicSpan
from .partitions import PartitionCache
from .producer import send_for_store
from .validation import Message as OutgoingMessage

_log = logging.getLogger(__name__)

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
FIRST_RETRY_LEVEL = 3  # RocketMQ: retry n is delayed by level 3 + n


@dataclass(frozen=True)
class Delivered:
    """A delivered message as a consumer sees it (`delaywheel.Delivered`; `topics.Message` is the same class, under the
    name it had before: the producer's `delaywheel.Message` is what a producer hands over)."""

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
            if value <= 2**63 - 1:
                return value
        return self.message_id


Message = Delivered  # the delivered message's former name, kept for code that imports it


@dataclass
class Batch:
    group: str
    messages: list[Message]
    cursors: dict[str, tuple[str, int]] = field(default_factory=dict)  # topic -> (xid, offset) of its last message
    positions: list[tuple[int, int]] = field(default_factory=list)  # each message's (xid, queue_offset) in its topic

    def __len__(self) -> int:
        return len(self.messages)


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
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


def pull(conn: psycopg.Connection, topic: str, group: str, max_messages: int = 100) -> Batch:
    """The next messages after the group's committed offset, from the topic and the group's retry topic."""
    with conn.transaction():
        # the cursor's index order across partitions, not "read all, sort"; the commit horizon, once for every source
        row = conn.execute(f"SELECT {COMMIT_HORIZON}::text, {QUEUE_PLAN}").fetchone()
        assert row is not None
        return _pull(conn, (topic, retry_topic(group)), group, max_messages, row[0])


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


def _pull(conn: psycopg.Connection, sources: tuple[str, ...], group: str, max_messages: int, horizon: str) -> Batch:
    """`pull`'s reads, inside the caller's transaction (QUEUE_PLAN already set), each source in turn, below
    `horizon` (db.COMMIT_HORIZON read earlier in the transaction: every xid below it had ended then, so it is
    still a valid horizon, only a more cautious one)."""
    batch = Batch(group, [])
    for source in sources:
        room = max_messages - len(batch.messages)
        if room <= 0:
            break
        rows = conn.execute(
            """
            SELECT t.topic, t.queue_offset, t.xid::text, t.message_id, t.key, t.tags, t.properties, t.body,
                   t.is_json, t.reconsume_times, t.deliver_at, t.delivered_at
            FROM delaywheel.topic_messages t
            WHERE t.topic = %(topic)s
              AND (t.xid, t.queue_offset) > (
                  coalesce((SELECT cursor_xid FROM delaywheel.consumer_offsets WHERE grp = %(group)s AND topic = %(topic)s), '0'),
                  coalesce((SELECT cursor_offset FROM delaywheel.consumer_offsets WHERE grp = %(group)s AND topic = %(topic)s), 0))
              AND t.xid < %(horizon)s::xid8
            ORDER BY t.xid, t.queue_offset
            LIMIT %(limit)s
            """,
            {"group": group, "topic": source, "limit": room, "horizon": horizon},
        ).fetchall()
        for r in rows:
            batch.positions.append((int(r[2]), r[1]))
            properties = r[6] or {}
            body = _body(bytes(r[7]), r[8], r[3])
            batch.messages.append(Message(
                topic=str(properties.get("ORIGIN_TOPIC", r[0])), queue_offset=r[1], message_id=r[3], key=r[4],
                tags=r[5], properties=properties, body=body, reconsume_times=r[9], deliver_at=r[10],
                delivered_at=r[11], source_topic=r[0],
            ))
        if rows:
            batch.cursors[source] = (rows[-1][2], rows[-1][1])
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
    failed = _checked_failures(batch, failed)
    with conn.transaction():
        return _ack(conn, settings, cache, batch, failed)


# Advisory lock class of a consumer group's hold on one source topic (second key: a hash of group and topic). A
# `consume` loop holds it (session level) from the pull of a batch to the commit of its ack, so two consumers of one
# group never handle the same batch. Keys of different (group, topic) pairs may collide: they then take turns.
GROUP_LOCK = 0x64770040
_GROUP_KEY = "hashtext(jsonb_build_array(%s::text, %s::text)::text)"


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
) -> tuple[AckResult, Batch, frozenset[str]]:
    """Ack `done` (as `ack`) and pull the group's next batch from `topic` and its retry topic, in one transaction:
    a consumer's steady state costs one BEGIN/COMMIT per batch, not two, and the pull starts past what was just acked.

    The group lock (GROUP_LOCK) is tried for each source not in `held` in the statement that sets the pull's plan;
    a source whose lock another consumer of the group holds is not read. The reads come in later statements, so
    their snapshots are taken after the lock was granted, hence after the previous holder's ack committed. Returns
    the ack's result, the batch, and the sources whose locks this session now holds: the caller releases them
    (`release_group_locks`) only after the transaction committed, once it has nothing of theirs in hand."""
    failed = _checked_failures(done, failed) if done is not None else set()
    sources = (topic, retry_topic(group))
    wanted = [s for s in sources if s not in held]
    tries = "".join(f", pg_try_advisory_lock({GROUP_LOCK}, {_GROUP_KEY})" for _ in wanted)
    params = [v for s in wanted for v in (group, s)]
    with conn.transaction():
        result = _ack(conn, settings, cache, done, failed) if done is not None else AckResult()
        # (a horizon is valid whenever it is read; it is the offsets that must be read after the locks)
        row = conn.execute(f"SELECT {COMMIT_HORIZON}::text, {QUEUE_PLAN}{tries}", params).fetchone()  # type: ignore[arg-type]
        assert row is not None
        now_held = held | {s for s, got in zip(wanted, row[3:], strict=True) if got}
        batch = _pull(conn, tuple(s for s in sources if s in now_held), group, max_messages, row[0])
    return result, batch, frozenset(now_held)


def release_group_locks(conn: psycopg.Connection, group: str, sources: frozenset[str] | set[str]) -> None:
    """Release the group locks `ack_and_pull` took on this session (call after its transaction committed)."""
    if sources:
        unlocks = ", ".join(f"pg_advisory_unlock({GROUP_LOCK}, {_GROUP_KEY})" for _ in sources)
        conn.execute(f"SELECT {unlocks}", [v for s in sorted(sources) for v in (group, s)])  # type: ignore[arg-type]


def _checked_failures(batch: Batch, failed: set[int] | None) -> set[int]:
    failed = set(failed or ())
    unknown = failed - {m.message_id for m in batch.messages}
    if unknown:
        shown = ", ".join(str(i) for i in sorted(unknown)[:10]) + (" ..." if len(unknown) > 10 else "")
        raise ValueError(f"failed holds {len(unknown)} id(s) that are not messages of this batch: {shown};"
                         " nothing was acked")
    return failed


def _ack(conn: psycopg.Connection, settings: Settings, cache: PartitionCache, batch: Batch, failed: set[int]) -> AckResult:
    """`ack`'s work inside the caller's transaction."""
    acked: list[Message] = []
    for topic, (xid, offset) in batch.cursors.items():
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
        passed = [m for m, pos in zip(batch.messages, batch.positions, strict=True)
                  if m.source_topic == topic and pos > before]
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
    return conn.execute(  # type: ignore[return-value]
        "SELECT cursor_xid::text, cursor_offset FROM delaywheel.consumer_offsets WHERE grp = %s AND topic = %s"
        " FOR UPDATE",
        (group, topic),
    ).fetchone()


def _reconsume_later(
    conn: psycopg.Connection, settings: Settings, cache: PartitionCache, group: str, messages: list[Message]
) -> None:
    outgoing, times = [], []
    for m in messages:
        times.append(m.reconsume_times + 1)
        # as strings: a row written some other way may hold other JSON values, and its retry must not fail the ack
        properties = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (m.properties or {}).items()}
        properties.setdefault("ORIGIN_TOPIC", m.topic)
        properties.setdefault("ORIGIN_MESSAGE_ID", str(m.message_id))
        if times[-1] > settings.max_reconsume_times:
            outgoing.append(OutgoingMessage(dlq_topic(group), m.body, key=m.key, tags=m.tags, properties=properties))
        else:
            level = FIRST_RETRY_LEVEL + m.reconsume_times
            outgoing.append(OutgoingMessage(retry_topic(group), m.body, delay_level=level, key=m.key, tags=m.tags,
                                            properties=properties))
    send_for_store(conn, settings, cache, outgoing, times)  # the store's own: reserved topics and properties


# Messages in a topic past the watchers' mark and below the commit horizon (what a consumer could read now).
_FRESH = """
WITH m AS (SELECT seen_xid, seen_offset FROM delaywheel.topic_watch WHERE topic = %(topic)s /*lock*/),
fresh AS (
    SELECT t.xid, t.queue_offset FROM delaywheel.topic_messages t, m
    WHERE t.topic = %(topic)s AND (t.xid, t.queue_offset) > (m.seen_xid, m.seen_offset)
      AND t.xid < """ + COMMIT_HORIZON + """
)
"""
# The idle look, read-only and lock-free: is there a mark yet, and anything past it?
_LOOK = _FRESH + "SELECT EXISTS (SELECT 1 FROM m), EXISTS (SELECT 1 FROM fresh)"
# The claim, under the mark's row lock (two watchers never announce the same messages): the count and the
# first and last (xid, queue_offset).
_CLAIM = _FRESH.replace("/*lock*/", "FOR UPDATE") + """
SELECT (SELECT count(*) FROM fresh),
       (SELECT ARRAY[xid::text, queue_offset::text] FROM fresh ORDER BY xid, queue_offset LIMIT 1),
       (SELECT ARRAY[xid::text, queue_offset::text] FROM fresh ORDER BY xid DESC, queue_offset DESC LIMIT 1)
"""


async def announce_new(conn: psycopg.AsyncConnection, topic: str) -> TopicSpan | None:
    """Claim the messages that reached `topic` since the last announcement: returns their span and moves
    the mark past them, in one transaction; None when there is nothing new. A watcher calls this every
    second per topic, so the common case (nothing new) is one read-only query that writes and locks nothing."""
    look = await (await conn.execute(_LOOK, {"topic": topic})).fetchone()  # type: ignore[arg-type]
    has_mark, has_new = look if look else (False, False)
    if has_mark and not has_new:
        return None
    async with conn.transaction():
        if not has_mark:
            await conn.execute("INSERT INTO delaywheel.topic_watch (topic) VALUES (%s) ON CONFLICT DO NOTHING", (topic,))
        row = await (await conn.execute(_CLAIM, {"topic": topic})).fetchone()  # type: ignore[arg-type]
        if row is None or not row[0]:
            return None
        count, first, last = int(row[0]), row[1], row[2]
        await conn.execute(
            "UPDATE delaywheel.topic_watch SET seen_xid = %s::xid8, seen_offset = %s, announced = announced + %s,"
            " fired_at = clock_timestamp() WHERE topic = %s",
            (last[0], int(last[1]), count, topic),
        )
    return TopicSpan(count, (first[0], int(first[1])), (last[0], int(last[1])))
