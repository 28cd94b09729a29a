"""What "pending" and "next due" mean for each lane, as SQL: one definition for cancelling, retiring,
stats, and the Airflow sensors and triggers (the cursor rules are in levels.py and wheel.py)."""

# Pending = not yet passed by its lane's cursor (the cursor rules of levels.py and wheel.py). `pending()` narrows
# it with a condition on segments `s` (level segments and far blocks: their id-range GiST indexes, say) and one
# on each message `q` (id, key, topic, tags, properties; in the near wheel by its own indexes).
# A near-wheel row `q` not yet passed by the wheel cursor `s` (wheel_state): ahead of it, or a straggler.
WHEEL_PENDING = "((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)"
_PENDING = """
    SELECT q.id, s.deliver_at, q.key, q.topic, q.tags, q.properties::jsonb, 'level' AS lane, s.level, s.xid
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL unnest(s.ids, s.keys, delaywheel.spread(s.topics, s.n), delaywheel.spread(s.tags, s.n),
                              delaywheel.spread(s.properties, s.n)) AS q(id, key, topic, tags, properties)
    WHERE ({segments}) AND ({rows}) AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    SELECT q.id, q.deliver_at, q.key, q.topic, q.tags, q.properties, 'wheel', NULL, q.xid
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE ({rows}) AND {wheel_pending}
    UNION ALL
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, q.topic, q.tags, q.properties::jsonb, 'wheel', NULL, s.xid
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL unnest(s.ids, s.deliver_ats, s.keys, delaywheel.spread(s.topics, s.n), delaywheel.spread(s.tags, s.n),
                              delaywheel.spread(s.properties, s.n)) AS q(id, due, key, topic, tags, properties)
    WHERE ({segments}) AND ({rows})
"""


def pending(segments: str = "true", rows: str = "true") -> str:
    return _PENDING.format(segments=segments, rows=rows, wheel_pending=WHEEL_PENDING)


PENDING = pending()
# A level segment not yet passed as a whole, for the counts that need no message of it (retire, stats).
SEGMENT_PENDING = "(c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id))"
# The same rule for rows already found, checked against the cursors alone (no scan of the queues).
STILL_PENDING = """
    CASE WHEN t.lane = 'level' THEN NOT EXISTS (
             SELECT 1 FROM delaywheel.level_checkpoint c
             WHERE c.level = t.level AND (t.xid, t.id) <= (c.cursor_xid, c.cursor_id))
         ELSE EXISTS (
             SELECT 1 FROM delaywheel.wheel_state s
             WHERE (t.deliver_at, t.id) > (s.cursor_at, s.cursor_id) OR t.xid >= s.horizon_xid) END
"""

# When the head of one lane falls due, read without writing anything (sensors and triggers only look).
# A level is FIFO with one delay, so its head is the first message after its checkpoint (its segment's due time); the wheel's next due
# time is the first row after its cursor, or "now" while stragglers wait, or, with only far blocks pending,
# `near_until`: every far row is due at or after it, and far blocks have no index in due order (migrations/008),
# so a waiter wakes when the far blocks start, never after their first row is due. (A near_until already
# past means the roll is overdue: the head is then in the past, and the next pass rolls.)
# Cursors are read in subqueries, and stragglers found as the first row in xid order rather than by EXISTS
# (which drops ORDER BY ... LIMIT): either way the planner walks an index from the cursor, even on a fresh
# partition without statistics, instead of scanning every delivered row (a sensor polls this every second).
LEVEL_HEAD = """
    SELECT s.deliver_at FROM delaywheel.level_segments s
    WHERE s.level = %(level)s
      AND (s.xid, s.id_last) > (coalesce((SELECT cursor_xid FROM delaywheel.level_checkpoint WHERE level = %(level)s), '0'),
                                coalesce((SELECT cursor_id FROM delaywheel.level_checkpoint WHERE level = %(level)s), 0))
    ORDER BY s.xid, s.id_last LIMIT 1
"""
WHEEL_HEAD = """
    SELECT least(
        (SELECT w.deliver_at FROM delaywheel.wheel w
          WHERE w.deliver_at >= (SELECT cursor_at FROM delaywheel.wheel_state)
            AND (w.deliver_at, w.id) > ((SELECT cursor_at FROM delaywheel.wheel_state),
                                        (SELECT cursor_id FROM delaywheel.wheel_state))
          ORDER BY w.deliver_at, w.id LIMIT 1),
        (SELECT near_until FROM delaywheel.wheel_state WHERE EXISTS (SELECT FROM delaywheel.wheel_far_segments)),
        (SELECT clock_timestamp() WHERE (
            SELECT w.xid FROM delaywheel.wheel w
            WHERE w.xid >= (SELECT horizon_xid FROM delaywheel.wheel_state)
              AND w.deliver_at <= (SELECT cursor_at FROM delaywheel.wheel_state)
            ORDER BY w.xid LIMIT 1) IS NOT NULL))
"""
