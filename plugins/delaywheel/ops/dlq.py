"""A consumer group's dead-letter topic as a place to work in: browse what waits there, redrive it to the group.

A message the group failed `max_reconsume_times` times lands in `%DLQ%<group>` (`topics._reconsume_later`) with
`ORIGIN_TOPIC` and `ORIGIN_MESSAGE_ID`. Browsing reads the dead letters not yet redriven, oldest first, as the
`Delivered` a consumer would get (the original topic, `idempotency_id` the original id, `reconsume_times` the
attempts). A redrive sends chosen dead letters (all, by id, or by a checked predicate) again as fresh retries into
`%RETRY%<group>`, which the group's consumers read beside their topic: `reconsume_times` 0, so the group's retry
ladder starts again, and the ORIGIN_* properties kept, so `idempotency_id` stays the original id. Each dead letter is
redriven once: the retries, `dlq_redriven` (a row per dead letter, its key the guard) and `dlq_redrives` (who, when,
how, how many) are one transaction, under the group's REDRIVE_LOCK.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import sql

from delaywheel.config import Settings
from delaywheel.consume.topics import Delivered, _body, dlq_topic, retry_topic
from delaywheel.locks import GROUP_KEY, REDRIVE_LOCK
from delaywheel.ops.cancel import read_only
from delaywheel.partitions import PartitionCache
from delaywheel.produce.producer import send_for_store
from delaywheel.produce.validation import Message, checked_group, storable
from delaywheel.types import MAX_ID

# The columns a redrive predicate may name: a dead letter as `dlq list --json` shows it.
DLQ_COLUMNS = (
    "message_id",
    "idempotency_id",
    "topic",
    "queue_offset",
    "key",
    "tags",
    "properties",
    "reconsume_times",
    "deliver_at",
    "delivered_at",
)
MAX_BY_CHARS = 1000

# `Delivered.idempotency_id` in SQL: ORIGIN_MESSAGE_ID when it is a JSON string of 1-19 ASCII digits within bigint,
# else the row's own id (tests/ops/test_dlq.py holds the two equal).
_IDEMPOTENCY_ID = """coalesce(
    CASE WHEN jsonb_typeof(t.properties->'ORIGIN_MESSAGE_ID') = 'string'
              AND (t.properties->>'ORIGIN_MESSAGE_ID') ~ '^[0-9]{1,19}$'
         THEN CASE WHEN (t.properties->>'ORIGIN_MESSAGE_ID')::numeric <= 9223372036854775807
                   THEN (t.properties->>'ORIGIN_MESSAGE_ID')::bigint END END,
    t.message_id)"""
# The group's dead letters waiting (not redriven): Delivered's fields in order but the last (source_topic: the
# dead-letter topic), then is_json, the row's position and its idempotency_id (DLQ_COLUMNS, for predicates).
# Replayed copies (origin 'replay', the same message_id as the row they copy) are not dead letters of their own.
_WAITING = sql.SQL(
    "SELECT coalesce(t.properties->>'ORIGIN_TOPIC', t.topic) AS topic, t.queue_offset, t.message_id, t.key, t.tags,"
    " t.properties, t.body, t.reconsume_times, t.deliver_at, t.delivered_at,"
    " t.is_json, t.xid, " + _IDEMPOTENCY_ID + " AS idempotency_id"
    " FROM delaywheel.topic_messages t"
    " WHERE t.topic = %(dlq)s AND t.origin <> 'replay'"
    " AND NOT EXISTS (SELECT FROM delaywheel.dlq_redriven r WHERE r.grp = %(group)s AND r.message_id = t.message_id)"
)
# Browsing: how many wait, and the oldest `limit` of them (no rows: one row with the count and NULLs).
_BROWSE = sql.SQL(
    "SELECT n.waiting, d.* FROM (SELECT count(*) AS waiting FROM ({waiting}) c) n"
    " LEFT JOIN LATERAL (SELECT * FROM ({waiting}) w ORDER BY w.xid, w.queue_offset LIMIT %(limit)s) d ON true"
).format(waiting=_WAITING)
_FIELDS = 10  # Delivered's fields read from a row, in order (the rest are source_topic, given)
_KNOWN = (
    "SELECT EXISTS (SELECT FROM delaywheel.consumer_offsets WHERE grp = %(group)s)"
    " OR EXISTS (SELECT FROM delaywheel.topic_messages WHERE topic = %(dlq)s)"
)
_RECORD = """WITH r AS (
    INSERT INTO delaywheel.dlq_redrives (grp, requested_by, how, predicate, redriven)
    VALUES (%(group)s, %(by)s, %(how)s, %(predicate)s, cardinality(%(ids)s::bigint[])) RETURNING id),
rows AS (
    INSERT INTO delaywheel.dlq_redriven (grp, message_id, redrive_id, retry_message_id)
    SELECT %(group)s, u.dead, r.id, u.retry FROM r, unnest(%(ids)s::bigint[], %(retries)s::bigint[]) u(dead, retry))
SELECT id FROM r"""
_HISTORY = """SELECT r.id, r.grp, r.requested_by, r.db_role, r.redriven_at, r.how, r.predicate, r.redriven,
       ARRAY(SELECT d.message_id FROM delaywheel.dlq_redriven d WHERE d.redrive_id = r.id ORDER BY d.message_id)
FROM delaywheel.dlq_redrives r WHERE r.grp = %(group)s ORDER BY r.id DESC LIMIT %(limit)s"""

How = Literal["all", "ids", "where"]


class UnknownGroup(ValueError):
    """A group this store knows nothing of: it has acked nothing here and has no dead-letter topic."""


@dataclass(frozen=True)
class DeadLetters:
    """A page of a group's dead letters waiting: how many wait in all, and the oldest of them."""

    group: str
    waiting: int
    messages: list[Delivered]


@dataclass(frozen=True)
class Redrive:
    """What a redrive did (or, `dry_run`, would do). `redriven`: the dead letters' ids sent again, and `retry_ids` the
    retries they became, in the same order (empty for a dry run); `redrive_id` the record's (None: nothing was
    written). By ids: `already_redriven` those an earlier redrive took, `not_found` those that are no dead letter of
    the group."""

    group: str
    how: How
    redrive_id: int | None
    redriven: list[int]
    retry_ids: list[int]
    already_redriven: list[int]
    not_found: list[int]
    dry_run: bool = False


@dataclass(frozen=True)
class RedriveRecord:
    """One redrive as recorded: who (the caller's `by` and the database role), when, how, how many and which."""

    id: int
    group: str
    requested_by: str | None
    db_role: str
    redriven_at: datetime
    how: How
    predicate: str | None
    redriven: int
    message_ids: list[int]


def browse(conn: psycopg.Connection, group: str, *, limit: int = 100) -> DeadLetters:
    """The group's dead letters not yet redriven, the oldest `limit` (1..MAX_ID) first, and how many wait in all.
    An unknown group raises UnknownGroup; a malformed one InvalidMessage (`bad_group`)."""
    checked_group(group)
    _check_limit(limit)
    dlq = dlq_topic(group)
    params: dict[str, Any] = {"group": group, "dlq": dlq, "limit": limit}
    with conn.transaction():
        _check_known(conn, params)
        rows = conn.execute(_BROWSE, params).fetchall()
    waiting = int(rows[0][0]) if rows else 0
    return DeadLetters(group, waiting, [_delivered(r[1:], dlq) for r in rows if r[1] is not None])


def redrive(
    conn: psycopg.Connection,
    settings: Settings,
    cache: PartitionCache,
    group: str,
    *,
    ids: Collection[int] | None = None,
    where: str | None = None,
    all: bool = False,
    by: str | None = None,
    dry_run: bool = False,
    timeout: timedelta | None = None,
) -> Redrive:
    """Send the group's chosen dead letters again as fresh retries into its retry topic, once each: every one
    waiting (`all=True`), those with the ids in `ids` (their `message_id` as browsed), or those meeting `where`, one
    expression over DLQ_COLUMNS checked as cancel's predicates are (`predicate.UnsafeSQL` otherwise). Exactly one
    of the three. `by` says who asks (recorded beside the database role). Everything is checked before anything is
    written; a dry run writes nothing. A redrive that finds nothing to send writes nothing either."""
    checked_group(group)
    how, wanted, checked = _choice(ids, where, all)
    if by is not None and (not isinstance(by, str) or not storable(by) or len(by) > MAX_BY_CHARS):
        raise ValueError(f"by must be text PostgreSQL can store, at most {MAX_BY_CHARS} characters")
    params: dict[str, Any] = {"group": group, "dlq": dlq_topic(group)}
    with read_only(conn, timeout or settings.match_timeout):
        _check_known(conn, params)
        if checked is not None:  # the caller's predicate runs read-only, with the timeout, and only here
            matched = sql.SQL("SELECT w.message_id FROM ({}) w WHERE ({})").format(_WAITING, sql.SQL(checked))
            wanted = [int(r[0]) for r in conn.execute(matched, params).fetchall()]
        if dry_run:
            return _outcome(group, how, None, _read(conn, params, wanted), [], conn, wanted, dry_run=True)

    def run() -> Redrive:
        with conn.transaction():
            conn.execute(
                sql.SQL("SELECT pg_advisory_xact_lock({}, {})").format(sql.Literal(REDRIVE_LOCK), sql.SQL(GROUP_KEY)),
                (group,),
            )
            dead = _read(conn, params, wanted)
            if not dead:
                return _outcome(group, how, None, [], [], conn, wanted)
            retries = send_for_store(conn, settings, cache, [_retry(group, m) for m in dead], [0] * len(dead))
            row = conn.execute(
                _RECORD,
                {
                    **params,
                    "by": by,
                    "how": how,
                    "predicate": where if how == "where" else None,
                    "ids": [m.message_id for m in dead],
                    "retries": retries,
                },
            ).fetchone()
            assert row is not None
            return _outcome(group, how, int(row[0]), dead, retries, conn, wanted)

    return cache.without_ddl(conn, run)  # a missing topic partition: made outside the transaction, and run again


def history(conn: psycopg.Connection, group: str, *, limit: int = 20) -> list[RedriveRecord]:
    """The group's last `limit` redrives as recorded, newest first."""
    checked_group(group)
    _check_limit(limit)
    rows = conn.execute(_HISTORY, {"group": group, "limit": limit}).fetchall()
    return [
        RedriveRecord(
            id=r[0],
            group=r[1],
            requested_by=r[2],
            db_role=r[3],
            redriven_at=r[4],
            how=r[5],
            predicate=r[6],
            redriven=r[7],
            message_ids=list(r[8]),
        )
        for r in rows
    ]


def _choice(
    ids: Collection[int] | None, where: str | None, everything: bool
) -> tuple[How, list[int] | None, str | None]:
    """Which dead letters a redrive asks for, checked: (how, the ids or None for all, the checked predicate)."""
    if everything is not True and everything is not False:
        raise ValueError(f"all must be True or False, not {everything!r}")
    given = [name for name, value in (("ids", ids), ("where", where), ("all", everything or None)) if value is not None]
    if len(given) != 1:
        raise ValueError(f"redrive needs exactly one of ids, where or all=True; got {', '.join(given) or 'none'}")
    if everything:
        return "all", None, None
    if where is not None:
        from delaywheel.ops.predicate import check_expression  # pglast: only when text is checked (as cancel does)

        checked = check_expression(where, DLQ_COLUMNS, qualifier="w", what="--where predicate")
        return "where", None, checked.replace("%", "%%")
    assert ids is not None
    if isinstance(ids, str | bytes) or not isinstance(ids, Collection):
        raise ValueError(f"ids must be a collection of message ids, not {type(ids).__name__}")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= MAX_ID]
    if bad:
        shown = ", ".join(repr(i) for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise ValueError(f"ids must be whole numbers from 1 to {MAX_ID}: {shown}")
    if not ids:
        raise ValueError("ids is empty: name at least one dead letter's message_id")
    return "ids", sorted(set(ids)), None


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_ID:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_ID}, not {limit!r}")


def _check_known(conn: psycopg.Connection, params: dict[str, Any]) -> None:
    row = conn.execute(_KNOWN, params).fetchone()
    if not (row and row[0]):
        raise UnknownGroup(
            f"group {params['group']!r} is unknown in this store: it has acked nothing here and has no dead-letter"
            f" topic ({params['dlq']})"
        )


def _read(conn: psycopg.Connection, params: dict[str, Any], ids: list[int] | None) -> list[Delivered]:
    """The group's waiting dead letters with the ids (None: all of them), oldest first, each once."""
    query = sql.SQL("SELECT * FROM ({}) w {} ORDER BY w.xid, w.queue_offset").format(
        _WAITING, sql.SQL("WHERE w.message_id = ANY(%(ids)s::bigint[])" if ids is not None else "")
    )
    seen: set[int] = set()
    dead = []
    for row in conn.execute(query, {**params, "ids": ids}).fetchall():
        if row[2] not in seen:  # (a row written into the topic by hand may repeat an id)
            seen.add(row[2])
            dead.append(_delivered(row, params["dlq"]))
    return dead


def _delivered(row: tuple[Any, ...], dlq: str) -> Delivered:
    """A row of `_WAITING` as the Delivered a consumer of the dead-letter topic would get."""
    topic, queue_offset, message_id, key, tags, properties, body, reconsume_times, deliver_at, delivered_at = row[
        :_FIELDS
    ]
    return Delivered(
        topic,
        queue_offset,
        message_id,
        key,
        tags,
        properties if properties is not None else {},
        _body(bytes(body), True, message_id) if row[_FIELDS] else bytes(body),  # (row[_FIELDS]: is_json)
        reconsume_times,
        deliver_at,
        delivered_at,
        dlq,
    )


def _retry(group: str, m: Delivered) -> Message:
    """A dead letter as a fresh retry of the group: its key, tags and properties (ORIGIN_* kept, so the same
    `idempotency_id`; a row without ORIGIN_MESSAGE_ID gets its own id, the one it was browsed with), due now."""
    properties = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (m.properties or {}).items()}
    properties.setdefault("ORIGIN_MESSAGE_ID", str(m.idempotency_id))
    return Message(retry_topic(group), m.body, key=m.key, tags=m.tags, properties=properties)


def _outcome(
    group: str,
    how: How,
    redrive_id: int | None,
    dead: list[Delivered],
    retries: list[int],
    conn: psycopg.Connection,
    wanted: list[int] | None,
    *,
    dry_run: bool = False,
) -> Redrive:
    """The Redrive of the dead letters sent (or, dry, to be sent); by ids, the others sorted into those an earlier
    redrive took and those that are no dead letter of the group (read in the redrive's transaction)."""
    taken = [m.message_id for m in dead]
    already: list[int] = []
    missing: list[int] = []
    if how == "ids" and wanted is not None:
        rest = sorted(set(wanted) - set(taken))
        if rest:
            found = conn.execute(
                "SELECT message_id FROM delaywheel.dlq_redriven WHERE grp = %s AND message_id = ANY(%s::bigint[])",
                (group, rest),
            ).fetchall()
            already = sorted(int(r[0]) for r in found)
            missing = sorted(set(rest) - set(already))
    return Redrive(group, how, redrive_id, taken, list(retries), already, missing, dry_run)
