"""Figures for operators: backlog and checkpoints per level, the wheel's horizons, topics, groups, lateness, and the
rows the store would not take (quarantine) or could not deliver (set aside).

`collect` reads them all in one READ ONLY, REPEATABLE READ transaction, so they describe one moment: the clock is
read after that transaction's snapshot is taken, hence no pass it can see ran later than its `now` (a lag is never
negative). Each query costs what it reads through an index or a segment row, not what is pending, and every figure
is exact but one kind (flagged by the wheel's `estimated_after`):

* a level's backlog is the sum of its pending segments' `n` (a segment holds up to 1,000 messages), plus the part
  of the one segment its checkpoint sits in;
* the far blocks hold segments too: the blocks due after the next 24 h count by `n`; a block that reaches into
  them (only when the roll is overdue) is unnested;
* the near wheel is counted per interval of the time axis (overdue, the next minute, each hour of the next 24 h,
  later) by index-only range scans of `(deliver_at, id)` from the cursor on, plus the stragglers behind it;
* cancellations (set-aside rows included) are subtracted per interval, each found from its own side;
* past a budget of rows counted (EXACT_ROWS, never within the next hour), each later partition of the near wheel
  (4 hours, sql/partitions.sql) adds the live-row count of PostgreSQL's statistics instead, spread evenly over its hours:
  exact in total while they are intact and flushed (a committed insert reaches them within seconds; a crash resets
  them until the next ANALYZE).

The delivered side (lateness over the window, topic depth, group lag) reads `topic_messages`; what retention
dropped before a group read it, `retired_unread`. Who delivers
comes from the delivery loops' presence locks (`deliver.presence`): per lane its live deliverers, and `unserved`
when a message is due and there are none.
"""

from __future__ import annotations

import itertools
import math
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import pq, sql

from delaywheel.config import Settings
from delaywheel.deliver import presence
from delaywheel.lanes import Lane, lane_name
from delaywheel.pending import level_head, not_cancelled

HISTOGRAM_HOURS = 24
EXACT_ROWS = 100_000  # near-wheel rows stats counts one by one beyond the next hour (see _near_estimates)
RECENT = 5  # quarantined and set-aside rows listed, most recent first
MINUTE, HOUR = timedelta(minutes=1), timedelta(hours=1)
_INFINITY = datetime.max.replace(tzinfo=UTC)  # the open ends of the time axis
_EPOCH_DAY = datetime(1970, 1, 2, tzinfo=UTC)  # a cursor before it never moved (wheel_state's default: epoch)


# Lateness of a delivered row: how long after its due time it reached its topic, in seconds (numeric; never below 0
# for the store's own deliveries, invariant 1). Every PostgreSQL report of lateness reads it through this, and its
# percentiles through LATENESS_P50_P99 (the quality job's Spark SQL computes approximate ones from it: quality.py).
LATENESS_S = sql.SQL("extract(epoch FROM delivered_at - deliver_at)")
# p50 and p99 of LATENESS_S, continuous (interpolated between the two nearest rows), as float8[2]: one sort for both.
LATENESS_P50_P99 = sql.SQL("percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY ({})::float8)").format(LATENESS_S)


def _rows(conn: psycopg.Connection, query: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    cur = conn.execute(query, params or {})
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def collect(conn: psycopg.Connection, settings: Settings, now: datetime | None, window: timedelta) -> dict[str, Any]:
    """Every figure, from one snapshot. `now` defaults to the database clock read after the snapshot."""
    own = conn.info.transaction_status == pq.TransactionStatus.IDLE
    with conn.transaction():
        if own:  # inside a caller's transaction its isolation stands
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        # Each statement here reads a few index ranges: never worth compiling (db.connect turns JIT off too).
        conn.execute("SET LOCAL jit = off")
        state = _rows(
            conn,
            """
            SELECT clock_timestamp() AS clock, cursor_at, cursor_id,
                   horizon_xid::text::bigint AS horizon_xid, near_until, delivered, updated_at
            FROM delaywheel.wheel_state""",
        )[0]
        now = now or state["clock"]
        lateness = _lateness_by_lane(conn, now - window)
        levels = level_stats(conn, settings, now, lateness)
        wheel = wheel_stats(conn, settings, state, now, lateness)
        return {
            "now": now,
            "levels": levels,
            "wheel": wheel,
            "unserved": _deliverers(conn, levels, wheel),
            "topics": topic_stats(conn),
            "retired_unread": retired_unread_stats(conn),
            "quarantine": quarantine_stats(conn),
            "set_aside": set_aside_stats(conn),
            "horizon_holders": horizon_holders(conn),
            "public_connect": public_connect(conn),
        }


def _deliverers(conn: psycopg.Connection, levels: list[dict[str, Any]], wheel: dict[str, Any]) -> list[str]:
    """Add to each level and to the wheel its live delivery loops (`deliverers`, read from their presence locks when
    the figures are read: pg_locks is no part of the snapshot) and `unserved`: a message is due and nobody delivers
    it. Returns the unserved lanes' names. Such a lane stays so until a deliverer starts (docs/operations.md)."""
    held = presence.deliverers(conn)
    lanes: list[tuple[Lane, dict[str, Any]]] = [*((r["level"], r) for r in levels), (None, wheel)]
    for lane, row in lanes:
        row["deliverers"] = held.get(lane, 0)
        row["unserved"] = row["oldest_overdue_s"] is not None and not row["deliverers"]
    return [lane_name(lane) for lane, row in lanes if row["unserved"]]


_LATENESS_BY_LANE = (
    sql.SQL("""
    SELECT origin, level, n, p[1] AS p50, p[2] AS p99
    FROM (SELECT origin, CASE WHEN origin = 'level' THEN level END AS level, count(*) AS n, {p50_p99} AS p
          FROM delaywheel.topic_messages
          WHERE origin IN ('level', 'wheel') AND delivered_at >= %(since)s
          GROUP BY 1, 2) l""")
    .format(p50_p99=LATENESS_P50_P99)
    .as_string()
)


def _lateness_by_lane(conn: psycopg.Connection, since: datetime) -> dict[tuple[str, int | None], dict[str, Any]]:
    """Lateness of the deliveries since `since`, per level and for the wheel: one pass over the window."""
    rows = _rows(conn, _LATENESS_BY_LANE, {"since": since})
    return {(r["origin"], r["level"]): r for r in rows}


def _seconds(later: datetime, earlier: datetime | None) -> float | None:
    """`later - earlier` in seconds, never below 0 (an injected clock may sit behind a pass)."""
    return None if earlier is None else max(0.0, (later - earlier).total_seconds())


# Per level: its checkpoint, its backlog (pending segments' n, and the part of the one its checkpoint sits in) and its
# head (pending.level_head).
_LEVELS = (
    sql.SQL("""
        SELECT l.level, (%(delays)s::float8[])[l.level] AS delay,
               coalesce(c.cursor_id, 0) AS checkpoint_id, coalesce(c.cursor_xid::text, '0')::bigint AS checkpoint_xid,
               coalesce(c.delivered, 0) AS delivered, c.updated_at AS checkpoint_at,
               (SELECT coalesce(sum(CASE WHEN (s.xid, s.id_first) > (coalesce(c.cursor_xid, '0'), coalesce(c.cursor_id, 0))
                                         THEN s.n ELSE (SELECT count(*) FROM unnest(s.ids) i WHERE i > c.cursor_id) END), 0)
                  FROM delaywheel.level_segments s WHERE s.level = l.level
                  AND (s.xid, s.id_last) > (coalesce(c.cursor_xid, '0'), coalesce(c.cursor_id, 0)))::bigint AS backlog,
               ({head}) AS head_due
        FROM generate_series(1, greatest(%(n)s, (SELECT max(level) FROM delaywheel.level_segments))) AS l(level)
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = l.level
        ORDER BY l.level""")
    .format(head=level_head(sql.SQL("l.level")))
    .as_string()
)


def level_stats(
    conn: psycopg.Connection, settings: Settings, now: datetime, lateness: dict[tuple[str, int | None], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per configured level, and per level removed from the table that still holds messages (its delay is
    None): backlog, checkpoint, head due time, lag (age of the oldest message due and not delivered, 0 when none
    is), lateness p50/p99 over the window. The backlog counts messages not yet passed by the checkpoint (cancelled
    ones included: the pass skips them)."""
    rows = _rows(conn, _LEVELS, {"n": settings.max_level, "delays": [d.total_seconds() for d in settings.levels]})
    out = []
    for row in rows:
        if row["level"] > settings.max_level and row["backlog"] == 0:
            continue
        due = row["head_due"] is not None and row["head_due"] <= now
        late = lateness.get(("level", row["level"]), {})
        out.append(
            {
                **row,
                "oldest_overdue_s": _seconds(now, row["head_due"]) if due else None,
                "lag_s": _seconds(now, row["head_due"]) if due else 0.0,
                "lateness_p50_s": late.get("p50"),
                "lateness_p99_s": late.get("p99"),
                "delivered_in_window": late.get("n", 0),
            }
        )
    return out


def intervals(now: datetime) -> list[tuple[datetime, datetime]]:
    """The time axis the wheel is counted on, each interval (lo, hi]: overdue (up to now), the next minute, the rest
    of the first hour, the next 23 hours one by one, and later. Horizons and the histogram are sums of these."""
    hours = [now + HOUR * i for i in range(1, HISTOGRAM_HOURS + 1)]
    bounds = [now, now + MINUTE, *hours]
    return [(datetime.min.replace(tzinfo=UTC), now), *itertools.pairwise(bounds), (bounds[-1], _INFINITY)]


# Rows ahead of the cursor and before `exact_until` (a partition's start), per interval: index-only range scans of (deliver_at, id).
_NEAR_AHEAD = """
    SELECT b.i::int AS i, (SELECT count(*) FROM delaywheel.wheel w
                     WHERE w.deliver_at > b.lo AND w.deliver_at <= b.hi AND w.deliver_at < %(exact_until)s
                       AND w.deliver_at >= %(cursor_at)s AND (w.deliver_at, w.id) > (%(cursor_at)s, %(cursor_id)s)) AS n
    FROM unnest(%(lo)s::timestamptz[], %(hi)s::timestamptz[]) WITH ORDINALITY AS b(lo, hi, i)
    WHERE b.lo < %(exact_until)s
"""
# The near wheel's partitions ahead of the cursor, with the number of rows the statistics put in each: the
# live rows the cumulative statistics counted (inserts committed since the last VACUUM or ANALYZE counted them), or
# what the last VACUUM/ANALYZE found, whichever is more (rows leave a partition only when it is dropped).
_NEAR_PARTITIONS = """
    SELECT b.lo, b.hi, b.rows FROM (
        SELECT p.bound[1]::timestamptz AS lo, p.bound[2]::timestamptz AS hi,
               greatest(pg_stat_get_live_tuples(c.oid), c.reltuples, 0)::bigint AS rows
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        CROSS JOIN LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''(.*)''\\) TO \\(''(.*)''\\)') AS p(bound)
        WHERE i.inhparent = 'delaywheel.wheel'::regclass) b
    WHERE b.hi > %(cursor_at)s
    ORDER BY b.lo
"""
# The queries below find each row's interval (lo, hi] by binary search in the intervals' starts: width_bucket gives
# the i with lo_i <= x < lo_i+1, so x less one microsecond (timestamptz's resolution) lands in (lo_i, lo_i+1].
# Rows behind the cursor committed after its pass (xid >= horizon_xid): the next pass delivers them first.
_STRAGGLERS = (
    sql.SQL("""
    SELECT width_bucket(w.deliver_at - interval '1 microsecond', %(lo)s::timestamptz[]) AS i, count(*) AS n,
           min(w.deliver_at) AS first
    FROM delaywheel.wheel w
    WHERE w.xid >= %(horizon)s::text::xid8 AND w.deliver_at <= %(cursor_at)s AND (w.deliver_at, w.id) <= (%(cursor_at)s, %(cursor_id)s)
      AND {not_cancelled}
    GROUP BY 1
""")
    .format(not_cancelled=not_cancelled("w"))
    .as_string()
)
# The first near-wheel row ahead of the cursor that is not cancelled (the lag's start; pending.wheel_head, what
# waiters read, counts a cancelled row too: a pass wakes for it and skips it).
_HEAD = (
    sql.SQL("""
    SELECT w.deliver_at FROM delaywheel.wheel w
    WHERE w.deliver_at >= %(cursor_at)s AND (w.deliver_at, w.id) > (%(cursor_at)s, %(cursor_id)s)
      AND {not_cancelled}
    ORDER BY w.deliver_at, w.id LIMIT 1
""")
    .format(not_cancelled=not_cancelled("w"))
    .as_string()
)
# Far blocks due wholly after `later`: counted by their segments. Any other block (the roll is overdue) by its rows.
_FAR = """
    SELECT NULL::int AS i, coalesce(sum(s.n), 0)::bigint AS n, NULL::timestamptz AS first
    FROM delaywheel.wheel_far_segments s WHERE s.block > %(later)s
    UNION ALL
    SELECT width_bucket(d.due AT TIME ZONE 'UTC' - interval '1 microsecond', %(lo)s::timestamptz[]), count(*),
           min(d.due AT TIME ZONE 'UTC')
    FROM delaywheel.wheel_far_segments s CROSS JOIN LATERAL unnest(s.deliver_ats) AS d(due)
    WHERE s.block <= %(later)s
    GROUP BY 1
"""
# Cancelled (or set-aside) wheel messages still in the queue ahead of the cursor, per interval: found from the
# cancellations (due from the cursor on: older days are pruned). One due after every queued level message
# can only be a wheel message's and is counted as it is; an earlier one is looked up by id in the near wheel or far
# blocks (a level message's is not a wheel message's).
_CANCELLED = """
    SELECT width_bucket(c.due_at - interval '1 microsecond', %(lo)s::timestamptz[]) AS i, count(*) AS n
    FROM delaywheel.cancellations c
    WHERE c.due_at >= %(cursor_at)s
      AND (c.due_at > coalesce((SELECT max(l.deliver_at) FROM delaywheel.level_segments l), '-infinity')
           OR EXISTS (SELECT 1 FROM delaywheel.wheel w WHERE w.id = c.message_id AND w.deliver_at = c.due_at
                        AND (w.deliver_at, w.id) > (%(cursor_at)s, %(cursor_id)s))
           OR EXISTS (SELECT 1 FROM delaywheel.wheel_far_segments s  -- its far day, then its id range
                      WHERE s.block = date_trunc('day', c.due_at, 'UTC')
                        AND int8range(s.id_first, s.id_last, '[]') @> c.message_id AND c.message_id = ANY(s.ids)))
    GROUP BY 1
"""


def wheel_stats(
    conn: psycopg.Connection,
    settings: Settings,
    state: dict[str, Any],
    now: datetime,
    lateness: dict[tuple[str, int | None], dict[str, Any]],
) -> dict[str, Any]:
    """Pending by horizon, overdue and lag, the last pass, lateness, and the due-time histogram of the next 24 h."""
    axis = intervals(now)
    params = {
        "lo": [lo for lo, _ in axis],
        "hi": [hi for _, hi in axis],
        "later": now + HOUR * HISTOGRAM_HOURS,
        "cursor_at": state["cursor_at"],
        "cursor_id": state["cursor_id"],
        "horizon": state["horizon_xid"],
    }
    counts: list[float] = [0] * len(axis)
    firsts: list[datetime] = []
    estimated = _near_estimates(conn, params, now, axis, counts)
    for row in _rows(conn, _NEAR_AHEAD, params):
        counts[row["i"] - 1] += row["n"]
    for row in _rows(conn, _CANCELLED, params):
        counts[row["i"] - 1] -= row["n"]
    for row in _rows(conn, _STRAGGLERS, params) + _rows(conn, _FAR, params):
        counts[(row["i"] or len(axis)) - 1] += row["n"]
        if row["first"] is not None:
            firsts.append(row["first"])
    head = conn.execute(_HEAD, params).fetchone()
    if head:
        firsts.append(head[0])
    head_due = min(firsts, default=None)
    if head_due is None and counts[-1]:  # only far blocks after the next 24 h pending: not read row by row
        head_due = state["near_until"]
    whole = [round(n) for n in counts]
    overdue = whole[0]
    started = state["cursor_at"] > _EPOCH_DAY
    late = lateness.get(("wheel", None), {})
    due_now = head_due is not None and head_due <= now and overdue > 0
    return {
        "estimated_after": estimated,
        "pending": sum(whole),
        "overdue": overdue,
        "next_minute": whole[1],
        "next_hour": whole[2],
        "next_day": sum(whole[3:-1]),
        "later": whole[-1],
        "head_due": head_due,
        "oldest_overdue_s": _seconds(now, head_due) if due_now else None,
        "lag_s": _seconds(now, head_due) if due_now else 0.0,
        "cursor_at": state["cursor_at"],
        "cursor_slot": int(state["cursor_at"].timestamp() // settings.wheel_precision.total_seconds()),
        "near_until": state["near_until"],
        "delivered": state["delivered"],
        "last_pass_at": state["updated_at"] if started else None,
        # by the database clock even when `now` is injected: the pass stamped its commit with that clock
        "since_last_pass_s": _seconds(state["clock"], state["updated_at"]) if started else None,
        "lateness_p50_s": late.get("p50"),
        "lateness_p99_s": late.get("p99"),
        "delivered_in_window": late.get("n", 0),
        "histogram_24h": histogram(now, whole),
    }


def _near_estimates(
    conn: psycopg.Connection,
    params: dict[str, Any],
    now: datetime,
    axis: list[tuple[datetime, datetime]],
    counts: list[float],
) -> datetime | None:
    """Decide how far the near wheel is counted row by row, and add the statistics' figure for the partitions after
    that to `counts`. Returns where estimates start (None: every count exact).

    Counting visits every index entry, so a near wheel holding millions of timers would cost stats about a
    second. Rows up to the end of the next hour are always counted (what operators act on: overdue, lag, the next
    minute and hour); then whole partitions while the rows counted stay within EXACT_ROWS; each later partition adds
    its rows from the statistics, spread evenly over its range."""
    partitions = _rows(conn, _NEAR_PARTITIONS, params)
    exact_until, budget = _INFINITY, EXACT_ROWS
    for part in partitions:
        budget -= part["rows"]
        if part["lo"] >= now + HOUR and budget < 0:
            exact_until = part["lo"]
            break
    params["exact_until"] = exact_until
    if exact_until == _INFINITY:
        return None
    for part in partitions:
        if part["lo"] < exact_until or not part["rows"]:
            continue
        width = (part["hi"] - part["lo"]).total_seconds()
        for i, (lo, hi) in enumerate(axis):
            overlap = (min(hi, part["hi"]) - max(lo, part["lo"])).total_seconds()
            if overlap > 0:
                counts[i] += part["rows"] * overlap / width
    return exact_until


def histogram(now: datetime, counts: list[int]) -> list[dict[str, Any]]:
    """24 buckets of one hour from `now`, each (start, end]: the first adds the next minute and the rest of its hour."""
    hourly = [counts[1] + counts[2], *counts[3 : 3 + HISTOGRAM_HOURS - 1]]
    return [{"start": now + HOUR * i, "end": now + HOUR * (i + 1), "due": n} for i, n in enumerate(hourly)]


def topic_stats(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Per topic: depth (messages held) and, per consumer group, its lag behind the topic's end."""
    return _rows(
        conn,
        """
        SELECT t.topic, t.depth, o.grp AS consumer_group, sum(o.acked)::bigint AS acked,
               sum((SELECT count(*) FROM delaywheel.topic_messages m WHERE m.topic = t.topic AND m.qid = o.qid
                  AND (m.xid, m.queue_offset) > (o.cursor_xid, o.cursor_offset)))::bigint AS lag
        FROM (SELECT topic, count(*) AS depth FROM delaywheel.topic_messages GROUP BY topic) t
        LEFT JOIN delaywheel.consumer_offsets o ON o.topic = t.topic
        GROUP BY t.topic, t.depth, o.grp
        ORDER BY t.topic, o.grp
    """,
    )


def retired_unread_stats(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Per consumer group and topic, the rows retention dropped before the group read them (delaywheel.retired_unread,
    counted by each drop), the latest drop first; empty while retention has dropped nothing unread."""
    return _rows(
        conn,
        """
        SELECT grp AS consumer_group, topic, dropped, partitions, first_dropped_at, last_dropped_at, last_dropped,
               last_partition
        FROM delaywheel.retired_unread ORDER BY last_dropped_at DESC, grp, topic""",
    )


def quarantine_stats(conn: psycopg.Connection) -> dict[str, Any]:
    """Bulk-enqueue input rows refused (delaywheel.quarantine): counts by reason and the most recent few, through the
    (reason, quarantined_at) index."""
    by_reason = _rows(
        conn,
        """
        SELECT reason, count(*) AS count, max(quarantined_at) AS last_at
        FROM delaywheel.quarantine GROUP BY reason ORDER BY count(*) DESC, reason""",
    )
    recent = _rows(
        conn,
        """
        SELECT q.* FROM unnest(%(reasons)s::text[]) AS r(reason)
        CROSS JOIN LATERAL (
            SELECT source, source_file, row_number, reason, left(detail, 300) AS detail, quarantined_at
            FROM delaywheel.quarantine q WHERE q.reason = r.reason ORDER BY quarantined_at DESC LIMIT %(n)s) q
        ORDER BY q.quarantined_at DESC LIMIT %(n)s""",
        {"reasons": [r["reason"] for r in by_reason], "n": RECENT},
    )
    return {"total": sum(r["count"] for r in by_reason), "by_reason": by_reason, "recent": recent}


def set_aside_stats(conn: psycopg.Connection) -> dict[str, Any]:
    """Queued messages a delivery pass could not deliver (delaywheel.set_aside): counts by reason and the most recent few.
    A store not yet migrated that far has none."""
    row = conn.execute("SELECT to_regclass('delaywheel.set_aside') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return {"total": 0, "by_reason": [], "recent": []}
    by_reason = _rows(
        conn,
        """
        SELECT reason, count(*) AS count, max(set_aside_at) AS last_at
        FROM delaywheel.set_aside GROUP BY reason ORDER BY count(*) DESC, reason""",
    )
    recent = _rows(
        conn,
        """
        SELECT message_id, lane, level, topic, key, deliver_at, reason, left(detail, 300) AS detail, set_aside_at
        FROM delaywheel.set_aside ORDER BY set_aside_at DESC LIMIT %(n)s""",
        {"n": RECENT},
    )
    return {"total": sum(r["count"] for r in by_reason), "by_reason": by_reason, "recent": recent}


HOLDING_S = 1.0  # a transaction with an xid open this long is named as holding the commit horizon back
# Sessions of this database whose open transaction has an xid (db.COMMIT_HORIZON waits for them: no lane delivers and
# no consumer reads past it until they end), oldest first, once open HOLDING_S or of unknown age. Who, from where
# and since when are shown for sessions the reader may see (its own role's; every one with pg_read_all_stats).
_HORIZON_HOLDERS = """
SELECT a.pid, a.usename AS role, a.application_name, host(a.client_addr) AS client_addr, a.state,
       extract(epoch FROM clock_timestamp() - a.xact_start) AS age_s, age(a.backend_xid) AS xids_since
FROM pg_stat_activity a
WHERE a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() AND a.usesysid IS NOT NULL
  AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND (a.xact_start IS NULL OR a.xact_start < clock_timestamp() - make_interval(secs => %(holding_s)s))
ORDER BY age(a.backend_xid) DESC
LIMIT %(n)s"""


def horizon_holders(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """The sessions holding the commit horizon back (`_HORIZON_HOLDERS`): what an operator ends, or bounds with
    `idle_in_transaction_session_timeout`, when deliveries stall with messages due (docs/operations.md)."""
    return _rows(conn, _HORIZON_HOLDERS, {"holding_s": HOLDING_S, "n": RECENT})


def public_connect(conn: psycopg.Connection) -> bool:
    """Whether any login may connect to the store's database (PUBLIC keeps CONNECT): one that does can take the
    lanes' advisory locks or hold the commit horizon back, stopping every lane and consumer (docs/operations.md)."""
    row = conn.execute("SELECT has_database_privilege('public', current_database(), 'CONNECT')").fetchone()
    return bool(row and row[0])


def as_json(value: Any) -> Any:
    """The one JSON form of the figures (CLI `stats --json` and the web API): numbers as numbers (Decimal to int
    when whole, else float; NaN and infinities to null), times as ISO 8601 strings."""
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return str(value)
