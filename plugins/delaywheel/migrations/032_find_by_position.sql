-- A cancel's find reads a segment's messages at the positions of the id or key it looks for (issue 19, item 4).
--
-- Why: `cancel(key=…)` of a timer in a far block, with 10M pending spread over 30 days, took p50 2.27 ms beside two
-- busy loops (1.86 idle), against 1.29 for a near timer: its find cost 1.46 ms of CPU, and a backend that has just
-- used that much waits for the scheduler's tick when it wakes from its commit's flush (DESIGN.md, "The cluster's CPU
-- slice"). Part of it was the segments found: each level segment or far segment whose filter let the key through
-- was unnested whole (up to 1,000 rows, six arrays) and every row tested against the key, and its keys were read
-- twice (`keys @> ARRAY[key]`, then the unnest).
--
-- How: the find now takes the positions of the id or key in the segment (`array_positions(s.ids, id)`,
-- `array_positions(s.keys, key)`) and reads each column's element there (pending.segment_elements; a column shared by
-- the whole segment, one element, at its first). A segment whose filter lets the key through is read for its
-- positions alone: one pass over its keys instead of the `@>` test and the unnest. The answer is the same rows
-- (tests/ops/test_cancel.py; tests/ops/test_cancel_procedures.py holds the procedures to ops/cancel.py's text).
--
-- Measured (bench.cancel_bench --parts, the find both ways interleaved key by key on one store with 10M pending
-- spread over 30 days; bench/RESULTS.md, "cancel"): a far timer's find 0.83 x (0.99 against 1.19 ms). Beside
-- two busy loops a far timer's cancel then took 1.45-1.82 ms in three runs (2.27 before).
--
-- The procedures of 031 are replaced by the same text with the new find, rendered from ops/cancel.py (_FIND_ONE).

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
END
$$;

