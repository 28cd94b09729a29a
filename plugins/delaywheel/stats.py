"""Figures for operators: backlog and checkpoints per level, the wheel's horizons, topics, groups, lateness."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg

from .config import Settings
from .pending import PENDING


def _rows(conn: psycopg.Connection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params)  # type: ignore[arg-type]
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def level_stats(conn: psycopg.Connection, settings: Settings, now: datetime, window: timedelta) -> list[dict[str, Any]]:
    """Per configured level, and per level removed from the table that still holds messages (its delay is
    None): backlog, checkpoint, head due time, oldest overdue age, lateness p50/p99."""
    return _rows(conn, """
        SELECT * FROM (
        SELECT l.level, %(delays)s[l.level] AS delay,
               coalesce(c.cursor_id, 0) AS checkpoint_id, coalesce(c.cursor_xid::text, '0') AS checkpoint_xid,
               coalesce(c.delivered, 0) AS delivered, c.updated_at AS checkpoint_at,
               (SELECT coalesce(sum(CASE WHEN (s.xid, s.id_first) > (coalesce(c.cursor_xid, '0'), coalesce(c.cursor_id, 0))
                                         THEN s.n ELSE (SELECT count(*) FROM unnest(s.ids) i WHERE i > c.cursor_id) END), 0)
                  FROM delaywheel.level_segments s WHERE s.level = l.level
                  AND (s.xid, s.id_last) > (coalesce(c.cursor_xid, '0'), coalesce(c.cursor_id, 0))) AS backlog,
               h.deliver_at AS head_due,
               CASE WHEN h.deliver_at < %(now)s THEN extract(epoch FROM %(now)s - h.deliver_at) END AS oldest_overdue_s,
               lat.p50 AS lateness_p50_s, lat.p99 AS lateness_p99_s, lat.n AS delivered_in_window
        FROM generate_series(1, greatest(%(n)s, (SELECT max(level) FROM delaywheel.level_segments))) AS l(level)
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = l.level
        LEFT JOIN LATERAL (
            SELECT s.deliver_at FROM delaywheel.level_segments s
            WHERE s.level = l.level AND (s.xid, s.id_last) > (coalesce(c.cursor_xid, '0'), coalesce(c.cursor_id, 0))
            ORDER BY s.xid, s.id_last LIMIT 1) h ON true
        LEFT JOIN LATERAL (
            SELECT count(*) AS n,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM t.delivered_at - t.deliver_at)) AS p50,
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM t.delivered_at - t.deliver_at)) AS p99
            FROM delaywheel.topic_messages t
            WHERE t.origin = 'level' AND t.level = l.level AND t.delivered_at >= %(since)s) lat ON true
        ) s WHERE level <= %(n)s OR backlog > 0
        ORDER BY level
        """, {"n": settings.max_level, "now": now, "since": now - window,
              "delays": [d.total_seconds() for d in settings.levels]})


def wheel_stats(conn: psycopg.Connection, settings: Settings, now: datetime, window: timedelta) -> dict[str, Any]:
    """Pending by horizon, overdue, cursor and lag, lateness, and a due-time histogram for the next 24 h."""
    pending = f"""
        SELECT p.deliver_at FROM ({PENDING}) p WHERE p.lane = 'wheel'
          AND NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = p.id AND c.due_at = p.deliver_at)
    """
    summary = _rows(conn, f"""
        SELECT count(*) FILTER (WHERE deliver_at <= %(now)s) AS overdue,
               extract(epoch FROM %(now)s - min(deliver_at) FILTER (WHERE deliver_at <= %(now)s)) AS oldest_overdue_s,
               count(*) FILTER (WHERE deliver_at > %(now)s AND deliver_at <= %(now)s + interval '1 minute') AS next_minute,
               count(*) FILTER (WHERE deliver_at > %(now)s + interval '1 minute' AND deliver_at <= %(now)s + interval '1 hour') AS next_hour,
               count(*) FILTER (WHERE deliver_at > %(now)s + interval '1 hour' AND deliver_at <= %(now)s + interval '1 day') AS next_day,
               count(*) FILTER (WHERE deliver_at > %(now)s + interval '1 day') AS later,
               count(*) AS pending
        FROM ({pending}) p
    """, {"now": now})[0]
    state = _rows(conn, """
        SELECT cursor_at, near_until, delivered, updated_at,
               extract(epoch FROM %(now)s - cursor_at) AS cursor_lag_s
        FROM delaywheel.wheel_state""", {"now": now})[0]
    precision = settings.wheel_precision.total_seconds()
    state["cursor_slot"] = int(state["cursor_at"].timestamp() // precision)
    histogram = _rows(conn, f"""
        SELECT date_trunc('hour', deliver_at) AS hour, count(*) AS due
        FROM ({pending}) p WHERE deliver_at > %(now)s AND deliver_at <= %(now)s + interval '24 hours'
        GROUP BY 1 ORDER BY 1
    """, {"now": now})
    lateness = _rows(conn, """
        SELECT count(*) AS n,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)) AS p50,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)) AS p99
        FROM delaywheel.topic_messages WHERE origin = 'wheel' AND delivered_at >= %(since)s
    """, {"since": now - window})[0]
    return {**summary, **state, "lateness_p50_s": lateness["p50"], "lateness_p99_s": lateness["p99"],
            "delivered_in_window": lateness["n"], "histogram_24h": histogram}


def topic_stats(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Per topic: depth (messages held) and, per consumer group, its lag behind the topic's end."""
    return _rows(conn, """
        SELECT t.topic, t.depth, o.grp AS consumer_group, o.acked,
               (SELECT count(*) FROM delaywheel.topic_messages m WHERE m.topic = t.topic
                  AND (m.xid, m.queue_offset) > (o.cursor_xid, o.cursor_offset)) AS lag
        FROM (SELECT topic, count(*) AS depth FROM delaywheel.topic_messages GROUP BY topic) t
        LEFT JOIN delaywheel.consumer_offsets o ON o.topic = t.topic
        ORDER BY t.topic, o.grp
    """, {})


def lateness(conn: psycopg.Connection, since: datetime) -> dict[str, Any]:
    """Lateness of every delivery since a time, in seconds (the demo's and the benchmarks' figure)."""
    return _rows(conn, """
        SELECT count(*) AS delivered,
               count(*) FILTER (WHERE delivered_at < deliver_at) AS early,
               percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)) AS p50_s,
               percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)) AS p99_s,
               max(extract(epoch FROM delivered_at - deliver_at)) AS max_s
        FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel') AND delivered_at >= %(since)s
    """, {"since": since})[0]
