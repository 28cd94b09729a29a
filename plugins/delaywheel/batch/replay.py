"""Replay of a due-time range: deliver again every message due in [from, until), one hour per Spark partition.

Replay writes `origin = 'replay'` rows, which the exactly-once invariants do not count, and never replays a message
into the same topic twice (an advisory lock per replayed hour serialises the dedup). Spark (spark/redeliver.py)
only spreads the hours over partitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg import sql

from delaywheel.db import DURABLE_COMMIT
from delaywheel.deliver.levels import TOPIC_SUMMARY
from delaywheel.locks import REPLAY_LOCK
from delaywheel.partitions import HOUR, PartitionCache, floor_to
from delaywheel.produce.validation import check_topic

_REPLAY = """
INSERT INTO delaywheel.topic_messages
    (topic, message_id, origin, level, key, tags, properties, body, is_json, reconsume_times, deliver_at, delivered_at)
SELECT coalesce(%(target)s, t.topic), t.message_id, 'replay', t.level, t.key, t.tags,
       coalesce(t.properties, '{}'::jsonb) || jsonb_build_object('REPLAY_ID', %(rid)s::text, 'REPLAY_OF_TOPIC', t.topic),
       t.body, t.is_json, t.reconsume_times, t.deliver_at, clock_timestamp()
FROM delaywheel.topic_messages t
WHERE t.origin IN ('level', 'wheel', 'direct')
  AND t.deliver_at >= %(lo)s AND t.deliver_at < %(hi)s
  AND t.delivered_at >= %(lo)s  -- never delivered early (invariant 1): prunes older partitions
  AND (%(source)s::text IS NULL OR t.topic = %(source)s)
  AND NOT EXISTS (SELECT 1 FROM delaywheel.topic_messages r
                  WHERE r.origin = 'replay' AND r.message_id = t.message_id AND r.topic = coalesce(%(target)s, t.topic))
ORDER BY t.deliver_at, t.message_id
"""
# The replay, reporting what it wrote (and announcing it to the topic watchers: TOPIC_SUMMARY).
_REPLAY_REPORTED = (
    sql.SQL("WITH moved AS ({} RETURNING topic, queue_offset, xid) SELECT count(*), ({}) FROM moved")
    .format(sql.SQL(_REPLAY), sql.SQL(TOPIC_SUMMARY))
    .as_string()
)
_ALREADY = """
SELECT count(*) FROM delaywheel.topic_messages t
WHERE t.origin IN ('level', 'wheel', 'direct') AND t.deliver_at >= %(lo)s AND t.deliver_at < %(hi)s
  AND t.delivered_at >= %(lo)s AND (%(source)s::text IS NULL OR t.topic = %(source)s)
"""


@dataclass(frozen=True)
class ReplayRequest:
    due_from: datetime
    due_until: datetime
    source_topic: str | None = None
    target_topic: str | None = None  # None: each message back into its own topic

    def __post_init__(self) -> None:
        if self.due_from >= self.due_until:
            raise ValueError(f"replay range is empty: {self.due_from} >= {self.due_until}")
        for topic in (self.source_topic, self.target_topic):
            if topic is not None:
                check_topic(topic)

    def slices(self) -> list[tuple[datetime, datetime]]:
        """The range cut at hour boundaries: one partition each, and the unit replays lock on."""
        cuts, at = [], self.due_from
        while at < self.due_until:
            nxt = min(floor_to(at, HOUR) + HOUR, self.due_until)
            cuts.append((at, nxt))
            at = nxt
        return cuts


def start_replay(conn: psycopg.Connection, request: ReplayRequest, requested_by: str) -> int:
    """Record the request (the audit row); returns the replay id the replayed rows carry."""
    row = conn.execute(
        "INSERT INTO delaywheel.replays (requested_by, due_from, due_until, source_topic, target_topic)"
        " VALUES (%s, %s, %s, %s, %s) RETURNING id",
        (requested_by, request.due_from, request.due_until, request.source_topic, request.target_topic),
    ).fetchone()
    assert row is not None
    return int(row[0])


def replay_slice(url: str, replay_id: int, request: ReplayRequest, lo: datetime, hi: datetime) -> tuple[int, int]:
    """Replay one slice in one transaction; returns (replayed, skipped as already replayed). The hour lock
    serialises concurrent replays of the same hour, so the NOT EXISTS dedup cannot race."""
    params = {"rid": replay_id, "lo": lo, "hi": hi, "source": request.source_topic, "target": request.target_topic}
    with psycopg.connect(url, autocommit=True, application_name="delaywheel-replay") as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (REPLAY_LOCK, int(floor_to(lo, HOUR).timestamp() // 3600)))
        clock = conn.execute(f"SELECT clock_timestamp(), {DURABLE_COMMIT}").fetchone()[0]  # type: ignore[index]
        PartitionCache().ensure(conn, "topic_messages", [clock])
        replayed = conn.execute(_REPLAY_REPORTED, params).fetchone()[0]  # type: ignore[index]
        candidates = conn.execute(_ALREADY, params).fetchone()[0]  # type: ignore[index]
    return replayed, candidates - replayed


def finish_replay(conn: psycopg.Connection, replay_id: int, replayed: int, skipped: int) -> None:
    conn.execute(
        "UPDATE delaywheel.replays SET replayed = %s, skipped = %s, finished_at = clock_timestamp() WHERE id = %s",
        (replayed, skipped, replay_id),
    )
