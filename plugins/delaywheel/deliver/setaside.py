"""Rows a delivery pass cannot deliver: recorded in `set_aside` with their reason and cancelled (sql/set_aside.sql).

Validation keeps such rows out, so one only reaches a queue some other way (an older producer, a hand-written
INSERT, a restored dump). A pass's statement then fails on its data (SQLSTATE class 22 or 23). The pass was one
transaction, so nothing of it happened; the lane (levels.deliver_level, wheel.advance_wheel, wheel.roll) then finds
the rows of the same window that `delaywheel.undeliverable` explains, under the lane's lock, and records each
here: a `set_aside` row (once: keyed by message id) and a `cancellations` row (reason 'set aside: <reason>'),
which every deliverer's anti-join already skips. Then it passes again. A message is delivered, cancelled or set
aside, never two of them, and the cursors move by the same rules as for a cancelled message. When nothing
explains the failure, the pass's error is raised: a lane never skips a row it cannot name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors, sql

from delaywheel.partitions import PartitionCache

# Errors of the data a statement read (class 22) or wrote (class 23), not of the server or the connection.
POISON = (errors.DataError, errors.IntegrityError)

# What a lane's window query returns per bad row, in this order (`record` writes them).
COLUMNS = (
    "message_id",
    "lane",
    "level",
    "topic",
    "key",
    "deliver_at",
    "reason",
    "detail",
    "tags",
    "properties",
    "body",
    "is_json",
    "reconsume_times",
)


_INSERT = sql.SQL("INSERT INTO delaywheel.set_aside ({}) VALUES ({}) ON CONFLICT (message_id) DO NOTHING").format(
    sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), sql.SQL(", ").join(sql.Placeholder() * len(COLUMNS))
)


def record(conn: psycopg.Connection, cache: PartitionCache, rows: Sequence[Sequence[Any]]) -> int:
    """Set the rows aside (COLUMNS order) inside the caller's transaction; returns how many were given."""
    if not rows:
        return 0
    cache.ensure(conn, "cancellations", [r[5] for r in rows])
    with conn.cursor() as cur:
        cur.executemany(_INSERT, rows)
        cur.executemany(
            "INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)"
            " VALUES (%(id)s, %(due)s, %(key)s, %(reason)s) ON CONFLICT (message_id, due_at) DO NOTHING",  # one per message
            [{"id": r[0], "due": r[5], "key": r[4], "reason": f"set aside: {r[6]}"} for r in rows],
        )
    return len(rows)
