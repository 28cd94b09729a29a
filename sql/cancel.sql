-- cancel by id and by key, each in one call: find the message pending (its level queue, the wheel, a far block),
-- wait for the lanes that may be moving it, mark it cancelled once (cancellations, partitioned by due time), and say
-- which were found, which this call marked, and which were already delivered. The pass skips a marked message.

-- cancel(message_id=…): the lookup by id.
CREATE OR REPLACE PROCEDURE delaywheel.cancel_by_id(
    p_v bigint, p_reason text,
    INOUT found_ids bigint[] DEFAULT NULL, INOUT marked_ids bigint[] DEFAULT NULL,
    INOUT delivered_ids bigint[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true), set_config('enable_bitmapscan', 'off', true);
    -- the pending messages, and their cancellations, one per message (a concurrent cancel's insert is waited for;
    -- then this one inserts nothing); in one statement the rows found are pending in the insert's snapshot
    WITH found AS MATERIALIZED ( SELECT p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text FROM (
    -- level segments past their level's checkpoint, then their messages past it (the checkpoint may sit inside one)
    SELECT q.id, s.deliver_at, q.key, q.topic, q.tags, q.properties::jsonb, 'level' AS lane, s.level, s.xid
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL (SELECT "s"."ids"[i], "s"."topics"[least(i, cardinality("s"."topics"))], "s"."keys"[i], "s"."tags"[least(i, cardinality("s"."tags"))], "s"."properties"[least(i, cardinality("s"."properties"))] FROM unnest(array_positions(s.ids, p_v::bigint)) AS i) AS "q"("id", "topic", "key", "tags", "properties")
    WHERE (int8range(s.id_first, s.id_last, '[]') @> p_v::bigint) AND (q.id = p_v) AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    -- the near wheel's rows the wheel cursor has not passed
    SELECT q.id, q.deliver_at, q.key, q.topic, q.tags, q.properties, 'wheel', NULL, q.xid
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE (q.id = p_v) AND ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)
    UNION ALL
    -- far blocks: not rolled yet, so every message pending
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, q.topic, q.tags, q.properties::jsonb, 'wheel', NULL, s.xid
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL (SELECT "s"."ids"[i], "s"."topics"[least(i, cardinality("s"."topics"))], "s"."keys"[i], "s"."tags"[least(i, cardinality("s"."tags"))], "s"."properties"[least(i, cardinality("s"."properties"))], "s"."deliver_ats"[i] FROM unnest(array_positions(s.ids, p_v::bigint)) AS i) AS "q"("id", "topic", "key", "tags", "properties", "due")
    WHERE (int8range(s.id_first, s.id_last, '[]') @> p_v::bigint) AND (q.id = p_v)
) p),
    marked AS (
        INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
        SELECT f.id, f.deliver_at, f.key, p_reason FROM found f
        ON CONFLICT (message_id, due_at) DO NOTHING
        RETURNING message_id)
    SELECT array_agg(f.id), array_agg(m.message_id) FILTER (WHERE m.message_id IS NOT NULL)
    INTO found_ids, marked_ids
    FROM found f LEFT JOIN marked m ON m.message_id = f.id;
    COMMIT;  -- before the wait: a pass that starts now reads the cancellations
    -- the passes in flight of the lanes that may hold the messages: each lane's two turns, one after the other (shared,
    -- each released before the next is taken)
    PERFORM pg_advisory_unlock_shared(k.class, k.key) FROM (
    SELECT k.class, k.key, pg_advisory_lock_shared(k.class, k.key) FROM (
        SELECT l.class + t.turn, l.key, l.class FROM (
        SELECT 1685520416, 0
        UNION
        SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) AND int8range(s.id_first, s.id_last, '[]') @> p_v::bigint) AS l(class, key), unnest(ARRAY[1, 2]) AS t(turn)
    ) AS k(class, key, lane)
    ORDER BY k.lane = 1685520416 DESC, k.key, k.class OFFSET 0) k;
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true);
    -- in a snapshot after the wait: every message with the id or key that reached a topic
    delivered_ids := ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE "message_id" = p_v AND origin <> 'replay');
    -- and, in a snapshot after the wait too, the messages with the id or key cancelled earlier (not set aside),
    -- which a pass may have moved past since: reported as found, so `already_cancelled` (or delivered, if one was)
    found_ids := found_ids || ARRAY(SELECT DISTINCT message_id FROM delaywheel.cancellations WHERE "message_id" = p_v AND NOT starts_with(reason, 'set aside: '));
END
$$;

-- cancel(key=…): the lookup by key, with the key's filter hashes and summary slots (ops/cancel.key_params).
CREATE OR REPLACE PROCEDURE delaywheel.cancel_by_key(
    p_v text, p_h1 bigint, p_h2 bigint, p_slots integer[], p_reason text,
    INOUT found_ids bigint[] DEFAULT NULL, INOUT marked_ids bigint[] DEFAULT NULL,
    INOUT delivered_ids bigint[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true), set_config('enable_bitmapscan', 'off', true);
    -- the pending messages, and their cancellations, one per message (a concurrent cancel's insert is waited for;
    -- then this one inserts nothing); in one statement the rows found are pending in the insert's snapshot
    WITH found AS MATERIALIZED (
WITH candidates AS MATERIALIZED (
    SELECT range_agg(m.r) AS ranges FROM (
        SELECT int8range(f.id_lo, f.id_hi, '[]') FROM delaywheel.far_key_summaries f
        WHERE f.slot = ANY(p_slots::int[]) AND delaywheel.bloom_may_hold(f.bloom, p_h1, p_h2)
        UNION ALL
        SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.wheel_far_segments s
        WHERE s.key_bloom IS NULL AND s.keys @> ARRAY[p_v::text]
        UNION ALL
        SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) AND CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) THEN s.keys @> ARRAY[p_v::text] END) AS m(r))
 SELECT p.id, p.deliver_at, p.key, p.lane, p.level, p.xid::text FROM (
    -- level segments past their level's checkpoint, then their messages past it (the checkpoint may sit inside one)
    SELECT q.id, s.deliver_at, q.key, q.topic, q.tags, q.properties::jsonb, 'level' AS lane, s.level, s.xid
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL (SELECT "s"."ids"[i], "s"."topics"[least(i, cardinality("s"."topics"))], "s"."keys"[i], "s"."tags"[least(i, cardinality("s"."tags"))], "s"."properties"[least(i, cardinality("s"."properties"))] FROM unnest(array_positions(s.keys, p_v::text)) AS i) AS "q"("id", "topic", "key", "tags", "properties")
    WHERE (int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates) AND delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2)) AND (q.key = p_v) AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    -- the near wheel's rows the wheel cursor has not passed
    SELECT q.id, q.deliver_at, q.key, q.topic, q.tags, q.properties, 'wheel', NULL, q.xid
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE (q.key = p_v) AND ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)
    UNION ALL
    -- far blocks: not rolled yet, so every message pending
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, q.topic, q.tags, q.properties::jsonb, 'wheel', NULL, s.xid
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL (SELECT "s"."ids"[i], "s"."topics"[least(i, cardinality("s"."topics"))], "s"."keys"[i], "s"."tags"[least(i, cardinality("s"."tags"))], "s"."properties"[least(i, cardinality("s"."properties"))], "s"."deliver_ats"[i] FROM unnest(array_positions(s.keys, p_v::text)) AS i) AS "q"("id", "topic", "key", "tags", "properties", "due")
    WHERE (int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates) AND delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2)) AND (q.key = p_v)
) p),
    marked AS (
        INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
        SELECT f.id, f.deliver_at, f.key, p_reason FROM found f
        ON CONFLICT (message_id, due_at) DO NOTHING
        RETURNING message_id)
    SELECT array_agg(f.id), array_agg(m.message_id) FILTER (WHERE m.message_id IS NOT NULL)
    INTO found_ids, marked_ids
    FROM found f LEFT JOIN marked m ON m.message_id = f.id;
    COMMIT;  -- before the wait: a pass that starts now reads the cancellations
    -- the passes in flight of the lanes that may hold the messages: each lane's two turns, one after the other (shared,
    -- each released before the next is taken)
    PERFORM pg_advisory_unlock_shared(k.class, k.key) FROM (
    SELECT k.class, k.key, pg_advisory_lock_shared(k.class, k.key) FROM (
        SELECT l.class + t.turn, l.key, l.class FROM (
        SELECT 1685520416, 0
        UNION
        SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) AND CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) THEN s.keys @> ARRAY[p_v::text] END) AS l(class, key), unnest(ARRAY[1, 2]) AS t(turn)
    ) AS k(class, key, lane)
    ORDER BY k.lane = 1685520416 DESC, k.key, k.class OFFSET 0) k;
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true);
    -- in a snapshot after the wait: every message with the id or key that reached a topic
    delivered_ids := ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE "key" = p_v AND origin <> 'replay');
    -- and, in a snapshot after the wait too, the messages with the id or key cancelled earlier (not set aside),
    -- which a pass may have moved past since: reported as found, so `already_cancelled` (or delivered, if one was)
    found_ids := found_ids || ARRAY(SELECT DISTINCT message_id FROM delaywheel.cancellations WHERE "key" = p_v AND NOT starts_with(reason, 'set aside: '));
END
$$;
