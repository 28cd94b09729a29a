"""Where a consumer group reads a topic from: the start of a new group, and `seek` for an existing one.

A group's offset on a topic is a position in the topic's read order, `(xid, queue_offset)` (topics.py), one per
queue of the topic; its next pull hands the rows after it. A queue's rows are a subsequence of the topic's, so one
position of the topic is valid for every queue: a start or a seek puts every queue's offset there. A target names a
position:

- `earliest`: before every row, so every row kept is read (a group with no offset reads from there);
- `latest`: the last row below the commit horizon: what is readable now is passed, whatever commits later is read;
- a time: just before the first row, in read order, delivered at or after it; with none, `latest`;
- an offset N: just before the first row, in read order, whose queue_offset is N or more; with none, `latest`.

A target never lies past the commit horizon (invariant 3): a transaction still open may commit rows below any
position past it, and they would never be read. Read order is the order of commits, not of the clock or of the
numbers, so a position by time or offset may also hand a few rows delivered before the time or numbered below N
(those committed after the first one at or past it), never skip one at or past it.

A new group's start (`start`) creates its offsets at the target before its first pull, and changes nothing once the
group has offsets. A seek moves existing offsets (`seek`), under the row locks an ack takes (`topics._lock_offset`),
so a seek and an ack take turns, counts itself in each offset row (`seeks`: an ack of a batch read before it moves
none of them, `topics._ack`) and records what it did in `group_seeks`. Each builds its one statement over every
offset row of (group, topic), in one place each (`start_statement`, `seek_statements`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors, sql

from delaywheel.consume.topics import QUEUES
from delaywheel.db import COMMIT_HORIZON, QUEUE_PLAN
from delaywheel.produce.producer import database_clock
from delaywheel.produce.validation import check_topic, checked_group, storable

EARLIEST, LATEST, TIME, OFFSET = "earliest", "latest", "time", "offset"
MAX_BY_CHARS = 200
MAX_OFFSET = 2**63 - 1
SEEK_WAIT_S = 30.0  # how long a seek tries to lock the group's offsets while acks hold them


@dataclass(frozen=True)
class Target:
    """A position to start or seek to: `kind` is EARLIEST, LATEST, TIME (`at`) or OFFSET (`offset`)."""

    kind: str
    at: datetime | None = None
    offset: int | None = None

    def __str__(self) -> str:
        if self.kind == TIME:
            assert self.at is not None
            return f"time {self.at.isoformat()}"
        return f"offset {self.offset}" if self.kind == OFFSET else self.kind


@dataclass(frozen=True)
class Position:
    """A group's offset: the (xid, queue_offset) in read order its next pull reads after."""

    xid: int
    offset: int


@dataclass(frozen=True)
class Seeked:
    """What a seek did: the group's offset in each queue of the topic moved (`moves[qid]`: from, to), recorded in
    `delaywheel.group_seeks` by `by` at `at`."""

    topic: str
    group: str
    target: str
    by: str
    at: datetime
    moves: tuple[tuple[Position, Position], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "group": self.group,
            "target": self.target,
            "by": self.by,
            "at": self.at.isoformat(),
            "moves": [
                {
                    "queue": qid,
                    "from": {"xid": b.xid, "queue_offset": b.offset},
                    "to": {"xid": a.xid, "queue_offset": a.offset},
                }
                for qid, (b, a) in enumerate(self.moves)
            ],
        }


class UnknownOffset(ValueError):
    """A seek of a group that has no offset on the topic: nothing to move (a new group starts at its first pull)."""


class SeekBusy(TimeoutError):
    """A seek that could not lock the group's offsets within SEEK_WAIT_S (acks kept them): nothing moved."""


def _time(value: object, name: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a datetime with a time zone, not {value!r}")
    return value


def start_target(start: object) -> Target:
    """A new group's start: "earliest" (the default, every row kept), "latest" or an aware datetime; else ValueError."""
    if isinstance(start, datetime):
        return Target(TIME, at=_time(start, "start"))
    if start in (EARLIEST, LATEST):
        assert isinstance(start, str)
        return Target(start)
    raise ValueError(f"start must be 'earliest', 'latest' or a datetime with a time zone, not {start!r}")


def seek_target(to_time: object = None, to_offset: object = None, to: object = None) -> Target:
    """Exactly one of `to_time` (an aware datetime), `to_offset` (a queue_offset, 0 or more) or `to` ("earliest" or
    "latest"); else ValueError."""
    given = [name for name, value in (("to_time", to_time), ("to_offset", to_offset), ("to", to)) if value is not None]
    if len(given) != 1:
        raise ValueError(
            "seek needs exactly one of to_time, to_offset, or to='earliest' / 'latest'"
            + (f" (given: {', '.join(given)})" if given else "")
        )
    if to_time is not None:
        return Target(TIME, at=_time(to_time, "to_time"))
    if to_offset is not None:
        if isinstance(to_offset, bool) or not isinstance(to_offset, int) or not 0 <= to_offset <= MAX_OFFSET:
            raise ValueError(
                f"to_offset must be a queue_offset, a whole number from 0 to {MAX_OFFSET}, not {to_offset!r}"
            )
        return Target(OFFSET, offset=to_offset)
    if to not in (EARLIEST, LATEST):
        raise ValueError(f"to must be 'earliest' or 'latest', not {to!r}")
    assert isinstance(to, str)
    return Target(to)


def check_by(by: object) -> str | None:
    """Who a seek is recorded as: None (the database role) or text of 1 to MAX_BY_CHARS characters; else ValueError."""
    if by is None:
        return None
    if not isinstance(by, str) or not by.strip() or len(by) > MAX_BY_CHARS or not storable(by):
        raise ValueError(f"by must be text of 1 to {MAX_BY_CHARS} characters (no NUL), not {str(by)[:40]!r}")
    return by


# The position of each target kind for topic %(topic)s, as one row (xid, queue_offset), after the CTE `h` (the commit
# horizon, read once). The last row below the horizon; the first row below it meeting the target's condition, whose
# predecessor (queue_offset - 1) is the position; the horizon bounds both.
_LAST = sql.SQL("""SELECT t.xid, t.queue_offset FROM delaywheel.topic_messages t
        WHERE t.topic = %(topic)s AND t.xid < (SELECT x FROM h)
        ORDER BY t.xid DESC, t.queue_offset DESC LIMIT 1""")
_FIRST = sql.SQL("""SELECT t.xid, t.queue_offset - 1 AS queue_offset FROM delaywheel.topic_messages t
        WHERE t.topic = %(topic)s AND t.xid < (SELECT x FROM h) AND {condition}
        ORDER BY t.xid, t.queue_offset LIMIT 1""")
_CONDITIONS = {TIME: sql.SQL("t.delivered_at >= %(at)s"), OFFSET: sql.SQL("t.queue_offset >= %(offset)s")}
_TARGETS = {
    EARLIEST: sql.SQL("SELECT '0'::xid8 AS xid, 0::bigint AS queue_offset"),
    LATEST: sql.SQL("""SELECT coalesce(l.xid, '0'::xid8) AS xid, coalesce(l.queue_offset, 0) AS queue_offset
    FROM (SELECT) one LEFT JOIN LATERAL ({last}) l ON true""").format(last=_LAST),
}
_FIRST_OR_LAST = sql.SQL("""SELECT CASE WHEN f.xid IS NULL THEN coalesce(l.xid, '0'::xid8) ELSE f.xid END AS xid,
           CASE WHEN f.xid IS NULL THEN coalesce(l.queue_offset, 0) ELSE f.queue_offset END AS queue_offset
    FROM (SELECT) one LEFT JOIN LATERAL ({first}) f ON true LEFT JOIN LATERAL ({last}) l ON f.xid IS NULL""")
_WITH_TARGET = sql.SQL("WITH h AS MATERIALIZED (SELECT {horizon} AS x), target AS ({target})\n")


def _with_target(kind: str) -> sql.Composed:
    """`WITH h, target`: the commit horizon and the one row (xid, queue_offset) of the target of `kind`."""
    if kind in _TARGETS:
        target: sql.Composable = _TARGETS[kind]
    else:
        target = _FIRST_OR_LAST.format(first=_FIRST.format(condition=_CONDITIONS[kind]), last=_LAST)
    return _WITH_TARGET.format(horizon=sql.SQL(COMMIT_HORIZON), target=target)


@functools.cache
def start_statement(kind: str) -> str:
    """A new group's offset rows on the topic, one per queue, all at the target: inserted only while (group, topic)
    has none (then nothing is read), so a group's later pulls with a start change nothing. Parameters group, topic
    and the target's (at, offset). Returns the positions inserted, if any."""
    return (
        _with_target(kind)
        + sql.SQL("""INSERT INTO delaywheel.consumer_offsets (grp, topic, qid, cursor_xid, cursor_offset)
SELECT %(group)s, %(topic)s, g.q, p.xid, p.queue_offset FROM target p, generate_series(0, {last}) g(q)
WHERE NOT EXISTS (SELECT FROM delaywheel.consumer_offsets o WHERE o.grp = %(group)s AND o.topic = %(topic)s)
ON CONFLICT DO NOTHING
RETURNING cursor_xid::text, cursor_offset""").format(last=sql.Literal(QUEUES - 1))
    ).as_string()


@functools.cache
def seek_statements(kind: str) -> tuple[str, str]:
    """A seek's two statements, in one transaction: lock every offset row of (group, topic) as an ack does
    (`topics._lock_offset`), in queue order, returning them; then move each to the target, count the seek in it (an
    ack of a batch read before moves it no more) and record each move in `group_seeks`, returning what it recorded
    in queue order. Read after the lock, the rows and the horizon are what the last ack left. Parameters group,
    topic, the target's (at, offset), target (its text) and by (None: the database role)."""
    lock = """SELECT qid FROM delaywheel.consumer_offsets
WHERE grp = %(group)s AND topic = %(topic)s ORDER BY qid FOR UPDATE"""
    move = _with_target(kind) + sql.SQL(""",
moved AS (
    UPDATE delaywheel.consumer_offsets o
    SET cursor_xid = p.xid, cursor_offset = p.queue_offset, seeks = o.seeks + 1, updated_at = clock_timestamp()
    FROM target p, delaywheel.consumer_offsets old
    WHERE o.grp = %(group)s AND o.topic = %(topic)s AND old.grp = o.grp AND old.topic = o.topic AND old.qid = o.qid
    RETURNING o.qid, old.cursor_xid AS from_xid, old.cursor_offset AS from_offset, o.cursor_xid AS to_xid,
              o.cursor_offset AS to_offset
),
recorded AS (
    INSERT INTO delaywheel.group_seeks
        (grp, topic, qid, target, sought_by, sought_at, from_xid, from_offset, to_xid, to_offset)
    SELECT %(group)s, %(topic)s, qid, %(target)s, coalesce(%(by)s::text, current_user::text),
           (SELECT clock_timestamp()), from_xid, from_offset, to_xid, to_offset
    FROM moved
    RETURNING qid, sought_by, sought_at, from_xid, from_offset, to_xid, to_offset
)
SELECT sought_by, sought_at, from_xid::text, from_offset, to_xid::text, to_offset FROM recorded ORDER BY qid""")
    return lock, move.as_string()


# The seek's lock waits, bounded below the server's deadlock_timeout: acks lock a group's offset rows in no fixed
# order, so a seek locking all of them could close a cycle with one; bounded so, the seek is always the one that gives
# up (and tries again), never an ack. Returns the statement_timeout to restore after the lock.
_BOUND_LOCK_WAIT = """SELECT s.old, set_config('statement_timeout',
    least(250, extract(epoch FROM current_setting('deadlock_timeout')::interval) * 500)::int::text, true)
FROM (SELECT current_setting('statement_timeout') AS old OFFSET 0) s"""
_RESTORE = sql.SQL("SELECT set_config('statement_timeout', %s, true), {}").format(sql.SQL(QUEUE_PLAN)).as_string()


def _params(topic: str, group: str, target: Target) -> dict[str, Any]:
    return {"topic": topic, "group": group, "at": target.at, "offset": target.offset}


def _not_ahead(conn: psycopg.Connection, target: Target) -> None:
    """A time target must not lie ahead of the database's clock: messages delivered before it, after now, would be
    read, since a position cannot lie past what is delivered."""
    if target.at is not None:
        clock = database_clock(conn)
        if target.at > clock:
            raise ValueError(
                f"{target} is ahead of the database's clock ({clock.isoformat()}): a group can start or seek only to"
                " a time that has passed ('latest' passes everything delivered so far)"
            )


def start(conn: psycopg.Connection, topic: str, group: str, target: Target) -> Position | None:
    """Give `group` its offsets on `topic` (every queue's) at `target` if it has none yet (before its first pull);
    returns the position set, None if the group had them already (or `target` is `earliest`, where a group without
    them reads from anyway)."""
    if target.kind == EARLIEST:
        return None
    checked_group(group)
    check_topic(topic)
    with conn.transaction():
        _not_ahead(conn, target)
        conn.execute(sql.SQL("SELECT {}").format(sql.SQL(QUEUE_PLAN)))
        row = conn.execute(start_statement(target.kind), _params(topic, group, target)).fetchone()
    return None if row is None else Position(int(row[0]), row[1])  # (every queue's is the same)


def seek(conn: psycopg.Connection, topic: str, group: str, target: Target, by: str | None = None) -> Seeked:
    """Move `group`'s offset on `topic` to `target` (backwards: its messages are handed again; forwards: skipped),
    recorded with `by` (None: the database role) in `group_seeks`, in one transaction. UnknownOffset (a ValueError)
    when the group has no offset on the topic, saying whether the group or the topic is unknown; SeekBusy when acks
    kept the group's offsets locked for SEEK_WAIT_S."""
    checked_group(group)
    check_topic(topic)
    by = check_by(by)
    lock, move = seek_statements(target.kind)
    params = {**_params(topic, group, target), "target": str(target), "by": by}
    deadline = time.monotonic() + SEEK_WAIT_S
    while True:
        with conn.transaction():
            _not_ahead(conn, target)
            locked = _lock(conn, lock, params)
            if locked is not None:
                if not locked:
                    raise UnknownOffset(_unknown(conn, topic, group))
                rows = conn.execute(move, params).fetchall()
                break
        if time.monotonic() >= deadline:
            raise SeekBusy(
                f"seek: the offsets of group {group!r} on {topic!r} stayed locked by its acks for {SEEK_WAIT_S:.0f} s;"
                " nothing moved: try again"
            )
        time.sleep(0.01)
    moves = tuple((Position(int(r[2]), r[3]), Position(int(r[4]), r[5])) for r in rows)
    return Seeked(topic, group, str(target), rows[0][0], rows[0][1], moves)


def _lock(conn: psycopg.Connection, lock: str, params: dict[str, Any]) -> list[Any] | None:
    """The seek's lock of the group's offset rows, its wait bounded (`_BOUND_LOCK_WAIT`), inside the seek's
    transaction: the rows locked, or None when the wait ran out (nothing is held then: the caller's transaction,
    or savepoint, ends and it tries again)."""
    row = conn.execute(_BOUND_LOCK_WAIT).fetchone()
    assert row is not None
    locked: list[Any] | None
    try:
        with conn.transaction():  # a savepoint: a lock wait that ran out leaves the seek's transaction usable
            locked = conn.execute(lock, params).fetchall()
    except errors.QueryCanceled:
        locked = None
    conn.execute(_RESTORE, (row[0],))
    return locked


def _unknown(conn: psycopg.Connection, topic: str, group: str) -> str:
    """Why `group` has no offset on `topic`: the group has none at all, or the topic is unknown, or the group has
    not acked it yet."""
    row = conn.execute(
        """SELECT ARRAY(SELECT DISTINCT topic FROM delaywheel.consumer_offsets WHERE grp = %(group)s
                        ORDER BY topic LIMIT 6),
                  EXISTS (SELECT FROM delaywheel.topic_messages WHERE topic = %(topic)s)
                  OR EXISTS (SELECT FROM delaywheel.consumer_offsets WHERE topic = %(topic)s)""",
        {"group": group, "topic": topic},
    ).fetchone()
    assert row is not None
    known_topics, topic_known = row
    nothing = f"nothing to seek: group {group!r} has no offset on topic {topic!r}"
    if not topic_known:
        return f"{nothing}, and the topic is unknown here (no messages kept, no group's offset)"
    if not known_topics:
        return (
            f"{nothing}: the group is unknown (it has acked nothing); a new group starts where its first pull's"
            " start says (earliest, latest or a time)"
        )
    shown = ", ".join(known_topics[:5]) + (", ..." if len(known_topics) > 5 else "")
    return f"{nothing}: it has acked none of it yet (its topics: {shown}); give its first pull a start instead"
