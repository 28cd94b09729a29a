"""Cancel pending messages by id, by key, or by a set-based predicate.

A cancellation is a row in `cancellations` that deliverers anti-join; the message itself stays until
its partition is retired. Cancelling takes the same advisory locks as the deliverers of the lanes it
touches, so a message is either delivered or cancelled, never both, and the caller is told which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import psycopg

from .db import LOOKUP_PLAN
from .keyblooms import probe
from .levels import LEVEL_LOCK
from .partitions import PartitionCache
from .pending import PENDING, STILL_PENDING, pending
from .wheel import WHEEL_LOCK

Outcome = Literal["cancelled", "already_cancelled", "already_delivered", "not_found"]

@dataclass(frozen=True)
class CancelResult:
    message_id: int | None
    outcome: Outcome


def _lock_all_lanes(conn: psycopg.Connection) -> None:
    """Wheel first, then levels in ascending order: one order for every canceller, so no deadlock."""
    conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WHEEL_LOCK)
    levels = conn.execute(
        "SELECT generate_series(1, coalesce((SELECT max(level) FROM delaywheel.level_segments), 0))"
    ).fetchall()
    for (level,) in levels:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LEVEL_LOCK, level))


def _lock_level_lanes(conn: psycopg.Connection, segments: str, params: dict[str, object]) -> None:
    """The wheel and every level with a segment that may hold the message (a superset is harmless)."""
    conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", WHEEL_LOCK)
    levels = conn.execute(
        f"SELECT DISTINCT level FROM delaywheel.level_segments s WHERE {segments} ORDER BY 1", params  # type: ignore[arg-type]
    ).fetchall()
    for (level,) in levels:
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LEVEL_LOCK, level))


# Finding one message: the segments that may hold it (by their id ranges; by key, the pending segments whose key
# filter lets it through: segments carry no key index, see keyblooms.py), then the message itself. The filter is
# tested first (CASE fixes the order: the planner would run the cheaper-looking `@>`, reading every segment's keys).
_LOOKUP = {
    "id": ("int8range(s.id_first, s.id_last, '[]') @> %(v)s::bigint", "q.id = %(v)s"),
    "key": ("CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, %(h1)s, %(h2)s) THEN s.keys @> ARRAY[%(v)s::text] END",
            "q.key = %(v)s"),
}


def cancel(
    conn: psycopg.Connection, cache: PartitionCache, *, message_id: int | None = None, key: str | None = None, reason: str = "cancelled"
) -> list[CancelResult]:
    """Cancel one message by id, or every message with a key; one result per message found."""
    if (message_id is None) == (key is None):
        raise ValueError("cancel needs exactly one of message_id or key")
    params: dict[str, object] = {"v": message_id}
    if key is not None:
        h1, h2 = probe(key)
        params = {"v": key, "h1": h1, "h2": h2}
    segments, rows = _LOOKUP["id" if message_id is not None else "key"]
    with conn.transaction():
        conn.execute(f"SELECT {LOOKUP_PLAN}")
        _lock_level_lanes(conn, segments, params)
        found = conn.execute(
            f"""
            SELECT p.id, p.deliver_at, p.key,
                   EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = p.id) AS cancelled
            FROM ({pending(segments, rows)}) p
            """,  # type: ignore[arg-type]
            params,
        ).fetchall()
        cache.ensure(conn, "cancellations", [due for _, due, _, _ in found])
        results = []
        for mid, due, mkey, already in found:
            if already:
                results.append(CancelResult(mid, "already_cancelled"))
                continue
            conn.execute(
                "INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason) VALUES (%s, %s, %s, %s)",
                (mid, due, mkey, reason),
            )
            results.append(CancelResult(mid, "cancelled"))
        pending_ids = [r.message_id for r in results]
        column = "message_id" if message_id is not None else "key"
        delivered = conn.execute(
            f"SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE {column} = %(v)s"
            " AND origin <> 'replay' AND NOT (message_id = ANY(%(pending)s))",  # type: ignore[arg-type]
            {**params, "pending": pending_ids},
        ).fetchall()
        results += [CancelResult(mid, "already_delivered") for (mid,) in delivered]
    if not results:
        results.append(CancelResult(message_id, "not_found"))
    return results


def count_matching(conn: psycopg.Connection, *, keys: list[str] | None = None, where: str | None = None) -> int:
    """How many pending, not yet cancelled messages a bulk cancel would hit (for the CLI's guard)."""
    predicate, params = _predicate(keys, where)
    row = conn.execute(
        f"SELECT count(*) FROM ({PENDING}) p WHERE ({predicate})"  # type: ignore[arg-type]
        " AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = p.id)",
        params,
    ).fetchone()
    return int(row[0]) if row else 0


def cancel_matching(
    conn: psycopg.Connection, cache: PartitionCache, *, keys: list[str] | None = None, where: str | None = None, reason: str = "bulk cancel"
) -> int:
    """Cancel, in one set-based statement, every pending message whose key is in `keys` or which
    satisfies the SQL predicate `where` over (id, deliver_at, key, topic, tags, properties, lane, level).
    `where` is trusted SQL from an operator, e.g. "key IN (SELECT id::text FROM shop.orders WHERE paid)"."""
    predicate, params = _predicate(keys, where)
    with conn.transaction():
        # Find the matching rows first, without the lanes' locks: the scan can take a while (a large set,
        # fresh tables without statistics) and deliverers must not wait for it. Under the locks, each row
        # found is checked again against the cursors only, so one delivered meanwhile is left alone.
        found = conn.execute(
            f"SELECT p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text FROM ({PENDING}) p WHERE ({predicate})"
            " AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = p.id)",  # type: ignore[arg-type]
            params,
        ).fetchall()
        if not found:
            return 0
        cache.ensure(conn, "cancellations", [due for _, due, *_ in found])
        _lock_all_lanes(conn)
        cur = conn.execute(
            f"""
            INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
            SELECT t.id, t.deliver_at, t.key, %(reason)s
            FROM unnest(%(ids)s::bigint[], %(dues)s::timestamptz[], %(keys)s::text[], %(lanes)s::text[],
                        %(levels)s::smallint[], %(xids)s::xid8[]) AS t(id, deliver_at, key, lane, level, xid)
            WHERE {STILL_PENDING}
              AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = t.id)
            """,  # type: ignore[arg-type]
            {"reason": reason, **{name: [row[i] for row in found] for i, name in
                                  enumerate(("ids", "dues", "keys", "lanes", "levels", "xids"))}},
        )
    return cur.rowcount


def _predicate(keys: list[str] | None, where: str | None) -> tuple[str, dict[str, object]]:
    if (keys is None) == (where is None):
        raise ValueError("bulk cancel needs exactly one of keys or where")
    if keys is not None:
        return "p.key = ANY(%(keys)s)", {"keys": list(keys)}
    return str(where).replace("%", "%%"), {}
