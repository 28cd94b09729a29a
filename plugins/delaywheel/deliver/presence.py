"""Who delivers which lane, and which lanes nobody delivers: read from the delivery loops' presence locks.

Every live delivery loop (`runner.run`: `delaywheel deliver`, an Airflow lane task) holds a shared
`locks.LANE_PRESENCE_LOCK` per lane it serves, on its listening connection, so a lane's holders in `pg_locks` are its
live deliverers; a crashed loop's session, and its lock, are gone with it. A lane with a message due and no holder is
*unserved*: nothing delivers it until a deliverer starts. `stats` flags such lanes (`ops.stats.collect`), and every
delivery loop logs the ones it finds (`UnservedWatch`; they are other loops' lanes, its own always have a holder).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import psycopg
from psycopg import sql

from delaywheel.config import Settings
from delaywheel.lanes import Lane, all_lanes, lane_name
from delaywheel.locks import LANE_PRESENCE_LOCK, lane_lock_key
from delaywheel.pending import WHEEL_HEAD, level_head

CHECK_EVERY_S = 10.0  # a delivery loop looks for unserved lanes this often (one pg_locks read when all are served)
REPEAT_EVERY_S = 60.0  # ... and repeats its warning this often while some stay unserved

log = logging.getLogger(__name__)

# Live holders of each lane's presence lock in this database (the cluster's other databases have lanes of their own).
_HOLDERS = """
    SELECT objid::bigint AS key, count(DISTINCT pid)::int AS n FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND classid::bigint = %s AND objsubid = 2
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
    GROUP BY objid"""

# The lanes among `keys` (presence keys: a level, 0 for the wheel) whose head is due, with how long it has been.
_DUE = (
    sql.SQL("""
    SELECT h.key, extract(epoch FROM clock_timestamp() - h.due)::float8 AS overdue_s
    FROM (SELECT l.key, CASE WHEN l.key = 0 THEN ({wheel}) ELSE ({level}) END AS due
          FROM unnest(%(keys)s::int[]) AS l(key)) h
    WHERE h.due <= clock_timestamp()
    ORDER BY h.key""")
    .format(wheel=sql.SQL(WHEEL_HEAD), level=level_head(sql.SQL("l.key")))
    .as_string()
)


def deliverers(conn: psycopg.Connection) -> dict[Lane, int]:
    """Live delivery loops per lane (lanes nobody holds are absent)."""
    rows = conn.execute(_HOLDERS, (LANE_PRESENCE_LOCK,)).fetchall()
    return {None if key == 0 else int(key): n for key, n in rows}


def unserved(conn: psycopg.Connection, lanes: Iterable[Lane]) -> dict[Lane, float]:
    """The lanes among `lanes` with a message due and no live deliverer, each with how long its head has been due
    (seconds). Lanes that have a deliverer cost nothing but the read of pg_locks."""
    held = deliverers(conn)
    keys = [lane_lock_key(lane) for lane in lanes if not held.get(lane)]
    if not keys:
        return {}
    return {None if key == 0 else key: overdue for key, overdue in conn.execute(_DUE, {"keys": keys}).fetchall()}


def describe(lanes: dict[Lane, float]) -> str:
    """'level 5 (due 129.0s ago), wheel (due 3.2s ago)': how the log and `stats` name unserved lanes."""
    return ", ".join(f"{lane_name(lane)} (due {overdue:.1f}s ago)" for lane, overdue in lanes.items())


class UnservedWatch:
    """A delivery loop's look-out for lanes left without a deliverer (every lane of the store, not only its own).

    `check` looks every CHECK_EVERY_S. A lane found unserved at two looks in a row is logged as a warning, again every
    REPEAT_EVERY_S (or when the set changes) while it stays so, and once more (info) when every lane is served again: a lane whose deliverer is
    merely starting, as at an Airflow start, is not reported. An error of the look itself (not a lost connection,
    which the loop handles) is logged once and ends the watch: it never stops delivery."""

    def __init__(self, settings: Settings) -> None:
        self.lanes = all_lanes(settings)
        self.next_at = time.monotonic() + CHECK_EVERY_S
        self.seen: set[Lane] = set()  # unserved at the last look
        self.reported: set[Lane] = set()  # the lanes the last warning named
        self.reported_at: float | None = None  # when it was logged
        self.off = False

    def check(self, conn: psycopg.Connection) -> None:
        now = time.monotonic()
        if self.off or now < self.next_at:
            return
        self.next_at = now + CHECK_EVERY_S
        try:
            found = unserved(conn, self.lanes)
        except psycopg.Error as exc:
            if conn.broken:  # the connection is lost: the loop reconnects and looks again later
                raise
            log.warning("delaywheel: cannot look for lanes without a deliverer (%s); not looking again", exc)
            self.off = True
            return
        lasting = {lane: overdue for lane, overdue in found.items() if lane in self.seen}
        self.seen = set(found)
        if lasting:
            if set(lasting) != self.reported or self.reported_at is None or now - self.reported_at >= REPEAT_EVERY_S:
                log.warning("delaywheel: no live deliverer for %s: nothing delivers them", describe(lasting))
                self.reported, self.reported_at = set(lasting), now
        elif self.reported and not found:
            log.info("delaywheel: every lane has a live deliverer again")
            self.reported, self.reported_at = set(), None
