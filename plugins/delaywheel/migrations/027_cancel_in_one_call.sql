-- A cancel outside a transaction in one statement (issue 19, item 4): `CALL delaywheel.cancel_by_key(…)` or
-- `cancel_by_id(…)` does what ops/cancel.py sent as a pipeline of seven statements (BEGIN, the lookup's plan settings,
-- the lookup and insert of its cancellations, COMMIT, the wait for the passes in flight, the search's plan settings,
-- the search of the topics). Already one round trip, but each statement cost the caller about 0.1 ms of Python
-- (psycopg builds a cursor, converts and binds it): 0.76 ms of a cancel's 1.6 ms of CPU idle, and 1.4 ms in the
-- bench of 700 cancels a second beside 1,000 deliveries, where the cancels share two cores with the deliverer. As one
-- CALL the caller spends 0.29 ms (bench/RESULTS.md, cancel); the server's share is the same work as before.
--
-- A procedure rather than a function, because it commits: the cancellations are committed before the wait starts,
-- so a pass that starts during the wait skips the messages (DESIGN.md, "Cancellation"). So it is called outside a
-- transaction block only (a Store's connection is autocommit); inside a caller's transaction ops/cancel.py takes the
-- lanes' locks instead, as before. A procedure that commits may have no SET clause, so the plan settings are set for
-- each of its two transactions as the pipeline set them (set_config, local): generic plans, which its statements
-- keep for the session as the prepared statements did.
--
-- The three queries are the library's own, rendered from ops/cancel.py with each placeholder %(x)s as the parameter
-- p_x: the lookup (_FIND_ONE), the wait for the lanes that may hold the messages found (_lane_wait of
-- _LANES_MAY_HOLD) and the search of the topics (_DELIVERED). tests/ops/test_cancel_procedures.py renders them again
-- and finds each in the procedures as installed, so a change to the queries in Python fails there until a migration
-- installs it here too. If the insert finds no `cancellations` partition for a message's due day, the CALL fails
-- before its COMMIT, having changed nothing, and ops/cancel.py creates the partition and cancels in three steps.

-- cancel(message_id=…): the lookup by id.
CREATE PROCEDURE delaywheel.cancel_by_id(
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
    CROSS JOIN LATERAL unnest("s"."ids", delaywheel.spread("s"."topics", "s".n), "s"."keys", delaywheel.spread("s"."tags", "s".n), delaywheel.spread("s"."properties", "s".n)) AS "q"("id", "topic", "key", "tags", "properties")
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
    CROSS JOIN LATERAL unnest("s"."ids", delaywheel.spread("s"."topics", "s".n), "s"."keys", delaywheel.spread("s"."tags", "s".n), delaywheel.spread("s"."properties", "s".n), "s"."deliver_ats") AS "q"("id", "topic", "key", "tags", "properties", "due")
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
    -- the passes in flight of the lanes that may hold the messages, waited for (shared, released at once)
    PERFORM pg_advisory_unlock_shared(k.class, k.key) FROM (
    SELECT k.class, k.key, pg_advisory_lock_shared(k.class, k.key) FROM (
        SELECT 1685520416, 0
        UNION
        SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) AND int8range(s.id_first, s.id_last, '[]') @> p_v::bigint) AS k(class, key)
    ORDER BY k.class = 1685520416 DESC, k.key OFFSET 0) k;
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true);
    -- in a snapshot after the wait: every message with the id or key that reached a topic
    delivered_ids := ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE "message_id" = p_v AND origin <> 'replay');
END
$$;

-- cancel(key=…): the lookup by key, with the key's filter hashes and summary slots (ops/cancel.key_params).
CREATE PROCEDURE delaywheel.cancel_by_key(
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
    CROSS JOIN LATERAL unnest("s"."ids", delaywheel.spread("s"."topics", "s".n), "s"."keys", delaywheel.spread("s"."tags", "s".n), delaywheel.spread("s"."properties", "s".n)) AS "q"("id", "topic", "key", "tags", "properties")
    WHERE (int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates) AND CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) THEN s.keys @> ARRAY[p_v::text] END) AND (q.key = p_v) AND (c.level IS NULL OR (
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
    CROSS JOIN LATERAL unnest("s"."ids", delaywheel.spread("s"."topics", "s".n), "s"."keys", delaywheel.spread("s"."tags", "s".n), delaywheel.spread("s"."properties", "s".n), "s"."deliver_ats") AS "q"("id", "topic", "key", "tags", "properties", "due")
    WHERE (int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates) AND CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) THEN s.keys @> ARRAY[p_v::text] END) AND (q.key = p_v)
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
    -- the passes in flight of the lanes that may hold the messages, waited for (shared, released at once)
    PERFORM pg_advisory_unlock_shared(k.class, k.key) FROM (
    SELECT k.class, k.key, pg_advisory_lock_shared(k.class, k.key) FROM (
        SELECT 1685520416, 0
        UNION
        SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
        LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
        WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) AND CASE WHEN delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) THEN s.keys @> ARRAY[p_v::text] END) AS k(class, key)
    ORDER BY k.class = 1685520416 DESC, k.key OFFSET 0) k;
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true);
    -- in a snapshot after the wait: every message with the id or key that reached a topic
    delivered_ids := ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages WHERE "key" = p_v AND origin <> 'replay');
END
$$;

