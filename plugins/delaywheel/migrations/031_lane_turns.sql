-- Two turns per lane (issue 19, item 4): a pass no longer waits for the cancels that waited for the pass before it.
--
-- Why: a cancel waits for the passes in flight of its lanes by taking the lane's lock shared and letting it go at once
-- (027). PostgreSQL grants the requests queued behind a pass when the pass commits, before their processes run, so
-- the next pass found the lock still held by cancels that had not yet been scheduled to let it go, and waited for
-- them: 57-207 passes a run idle, 582-842 beside two busy loops, with 700 cancels a second beside 1,000 deliveries
-- (bench/results/2026-11-30-race-passes-not-waiting.json). The floor (a durable one-row INSERT per cancel, no lane
-- lock) has none.
--
-- How: each lane has, beside its lock, two turns (locks.TURNS: the lock's class + 1 and + 2, the same second key).
-- A pass holds its lane's lock, so passes, rolls and set-asides of a lane still run one at a time, and one turn,
-- whichever is free, for its transaction. A cancel no longer takes the lane's lock: it waits on the two turns, one
-- after the other, each taken shared and let go before the next. The cancels queued behind a pass are granted its
-- turn at its commit; the next pass takes the other turn meanwhile, and the cancels, moving on to that turn, queue
-- behind it. A pass waits (levels.LANE_WAIT) only when both turns are held: by a cancel inside a caller's transaction,
-- which holds both until that ends (cancel._lane_hold), or by cancels stalled on a turn for a whole pass.
--
-- Why a cancel's answer stays true: the pass in flight when the cancel's cancellations committed holds one of the two
-- turns from before that commit to its own; the cancel, taking both after its commit, waits for it whichever it is. A
-- pass that takes its turn later reads the cancellations. A cancel may now also wait for a pass that started after
-- its commit (the other turn's): harmless, a pass long.
--
-- Measured (bench/results/2026-11-30-lane-turns.json; DESIGN.md, "Two turns per lane"): with 700 cancels a second
-- beside 1,000 deliveries, 0-2 passes a run waited idle and 2-4 beside two busy loops, and the delivery p99 with the
-- cancels was 0.84 and 0.78 x the runs without them idle (two benches) and 0.82 x beside the loops. Every pass now
-- enters a subtransaction (below): 1.01-1.02 x a pass's time, 6-7 µs.
--
-- The procedures of 027 are replaced by the same text with the new wait, rendered from ops/cancel.py (_lane_wait of
-- _LANES_MAY_HOLD; tests/ops/test_cancel_procedures.py holds them to it). The passes' procedures (030) call take_lane
-- and are unchanged.

-- The lane's lock, then a turn: both tried; if either is held, waited for up to p_wait (lock_timeout, for these waits
-- only): the lane's lock, then the first turn (a turn tried again first, as the other may be free by then). 'free',
-- 'waited' or 'busy'. The locks are the transaction's (released at its commit); on 'busy' the subtransaction is undone,
-- the locks it took and lock_timeout with it, so a busy pass holds nothing.
CREATE OR REPLACE FUNCTION delaywheel.take_lane(p_class integer, p_key integer, p_wait text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text := current_setting('lock_timeout');
BEGIN
    BEGIN
        IF pg_try_advisory_xact_lock(p_class, p_key) THEN
            IF pg_try_advisory_xact_lock(p_class + 1, p_key) OR pg_try_advisory_xact_lock(p_class + 2, p_key) THEN
                RETURN 'free';
            END IF;
        END IF;
        PERFORM set_config('lock_timeout', p_wait, true);
        PERFORM pg_advisory_xact_lock(p_class, p_key);
        IF NOT (pg_try_advisory_xact_lock(p_class + 1, p_key) OR pg_try_advisory_xact_lock(p_class + 2, p_key)) THEN
            PERFORM pg_advisory_xact_lock(p_class + 1, p_key);
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        RETURN 'busy';
    END;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN 'waited';
END
$$;

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

