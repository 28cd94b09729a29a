-- Cancel by id and by key: find the messages pending (a level segment, the near wheel, a far block), mark them
-- cancelled once (cancellations, partitioned by due time), wait for the passes that may have read them without their
-- cancellation, and read which were delivered. Each rule is one function here, which the procedures and ops/cancel.py
-- alike call; the procedures run the steps in one call. The pass skips a marked message.

-- The planner settings of a cancel's reads, for the transaction (set_config(..., true) = SET LOCAL). Sequential scans
-- priced out: the planner prices a BRIN scan (topic_messages' key summaries) by the column's physical correlation,
-- none for random keys, none at all before ANALYZE, and would read whole partitions instead of the page ranges whose
-- summaries may match; JIT, whose compiling takes longer than the lookup. p_find, for the finds (cancel_find_*):
-- bitmap scans priced out too. The far-key summaries they test, one row per send, are read from the index that holds
-- their filters (far_key_summaries_lookup); until autovacuum has marked their pages all-visible the planner prices
-- that index-only scan at a heap page a row and picks a bitmap scan, which is then one page a row indeed, and a
-- generic plan keeps that choice for the session. GIN's bitmap scans (the small far segments' keys) stay: GIN has no
-- other index scan. Not for the topics' search: a BRIN index has only bitmap scans. p_generic: generic plans, for
-- statements planned once per session (prepared, or in a procedure): planning over the near wheel's partitions and
-- the far blocks costs more than running, and a generic plan loses nothing, since no partition is pruned by id or key.
CREATE OR REPLACE FUNCTION delaywheel.lookup_plan(p_find boolean, p_generic boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true),
            CASE WHEN p_find THEN set_config('enable_bitmapscan', 'off', true) END,
            CASE WHEN p_generic THEN set_config('plan_cache_mode', 'force_generic_plan', true) END;
END
$$;

-- May the segment (its key filter and keys) hold key p_v, with hashes (p_h1, p_h2)? The filter is tested before the
-- keys are read: CASE fixes the order, where the planner would run the cheaper-looking `@>` first, reading every
-- segment's keys.
CREATE OR REPLACE FUNCTION delaywheel.segment_may_hold_key(
    p_bloom bytea, p_keys text[], p_v text, p_h1 bigint, p_h2 bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN delaywheel.bloom_may_hold(p_bloom, p_h1, p_h2) THEN p_keys @> ARRAY[p_v] END $$;

-- The finds: the pending messages with an id or a key, as (id, deliver_at, key, lane, level, xid), read only. Pending
-- as pending.py has it (its cursor rules, tests/test_pending.py holds these to them): a level segment's messages past
-- its level's checkpoint (which may sit inside it), the near wheel's rows its cursor has not passed or stragglers, and
-- every message of the far blocks (not rolled yet). The segments that may hold the message are found by their id
-- ranges (GiST), and a segment's messages are read at the positions of the id or key, not unnested and tested one
-- by one. SQL functions, STABLE, a single query: the planner inlines them into the statement that calls them, and
-- plans the whole.

-- By id: the segments whose id range holds it; the near wheel's id index.
CREATE OR REPLACE FUNCTION delaywheel.cancel_find_id(p_v bigint)
RETURNS TABLE (id bigint, deliver_at timestamptz, key text, lane text, level smallint, xid text)
LANGUAGE sql STABLE AS $$
    SELECT q.id, s.deliver_at, q.key, 'level', s.level, s.xid::text
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL (SELECT s.ids[i], s.keys[i] FROM unnest(array_positions(s.ids, p_v)) AS i) AS q(id, key)
    WHERE int8range(s.id_first, s.id_last, '[]') @> p_v AND q.id = p_v AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    SELECT q.id, q.deliver_at, q.key, 'wheel', NULL, q.xid::text
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE q.id = p_v AND ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)
    UNION ALL
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, 'wheel', NULL, s.xid::text
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL (SELECT s.ids[i], s.keys[i], s.deliver_ats[i] FROM unnest(array_positions(s.ids, p_v)) AS i)
        AS q(id, key, due)
    WHERE int8range(s.id_first, s.id_last, '[]') @> p_v AND q.id = p_v
$$;

-- By key, with its filter hashes and summary slots (ops/cancel.key_params). Segments carry no key index (a
-- per-message entry is what they avoid): `candidates` are the id ranges of the far sends whose summary filter of the
-- key's group lets the key through (far_key_summaries: about one filter per send instead of one per far segment,
-- which adds up with millions pending; read from the index that holds them), of the far segments too small for a
-- filter that hold the key (their partial GIN index), and of the pending level segments that may hold it (levels
-- hold few segments: a send writes one per level). In those ranges a segment's own filter is tested before its keys
-- are read; the near wheel by its key index.
CREATE OR REPLACE FUNCTION delaywheel.cancel_find_key(p_v text, p_h1 bigint, p_h2 bigint, p_slots integer[])
RETURNS TABLE (id bigint, deliver_at timestamptz, key text, lane text, level smallint, xid text)
LANGUAGE sql STABLE AS $$
    WITH candidates AS MATERIALIZED (
        SELECT range_agg(m.r) AS ranges FROM (
            SELECT int8range(f.id_lo, f.id_hi, '[]') FROM delaywheel.far_key_summaries f
            WHERE f.slot = ANY(p_slots) AND delaywheel.bloom_may_hold(f.bloom, p_h1, p_h2)
            UNION ALL
            SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.wheel_far_segments s
            WHERE s.key_bloom IS NULL AND s.keys @> ARRAY[p_v]
            UNION ALL
            SELECT int8range(s.id_first, s.id_last, '[]') FROM delaywheel.level_segments s
            LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
            WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id))
              AND delaywheel.segment_may_hold_key(s.key_bloom, s.keys, p_v, p_h1, p_h2)) AS m(r))
    SELECT q.id, s.deliver_at, q.key, 'level', s.level, s.xid::text
    FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    CROSS JOIN LATERAL (SELECT s.ids[i], s.keys[i] FROM unnest(array_positions(s.keys, p_v)) AS i) AS q(id, key)
    WHERE int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates)
      AND delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) AND q.key = p_v AND (c.level IS NULL OR (
          (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id) AND (s.xid, q.id) > (c.cursor_xid, c.cursor_id)))
    UNION ALL
    SELECT q.id, q.deliver_at, q.key, 'wheel', NULL, q.xid::text
    FROM delaywheel.wheel q, delaywheel.wheel_state s
    WHERE q.key = p_v AND ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)
    UNION ALL
    SELECT q.id, q.due AT TIME ZONE 'UTC', q.key, 'wheel', NULL, s.xid::text
    FROM delaywheel.wheel_far_segments s
    CROSS JOIN LATERAL (SELECT s.ids[i], s.keys[i], s.deliver_ats[i] FROM unnest(array_positions(s.keys, p_v)) AS i)
        AS q(id, key, due)
    WHERE int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates)
      AND delaywheel.bloom_may_hold(s.key_bloom, p_h1, p_h2) AND q.key = p_v
$$;

-- The lanes, as (lock class, key) (locks.py), that may hold the messages with an id or a key: the wheel's
-- (locks.WHEEL_LOCK), and the levels' (locks.LEVEL_LOCK) of the pending level segments that may (by id, their id
-- range; by key, their filter; no far candidates: those are the wheel's). A superset is harmless.
CREATE OR REPLACE FUNCTION delaywheel.cancel_lanes_id(p_v bigint) RETURNS TABLE (class integer, key integer)
LANGUAGE sql STABLE AS $$
    SELECT 1685520416, 0
    UNION
    SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id))
      AND int8range(s.id_first, s.id_last, '[]') @> p_v
$$;

CREATE OR REPLACE FUNCTION delaywheel.cancel_lanes_key(p_v text, p_h1 bigint, p_h2 bigint)
RETURNS TABLE (class integer, key integer)
LANGUAGE sql STABLE AS $$
    SELECT 1685520416, 0
    UNION
    SELECT 1685520400, s.level::int FROM delaywheel.level_segments s
    LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
    WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id))
      AND delaywheel.segment_may_hold_key(s.key_bloom, s.keys, p_v, p_h1, p_h2)
$$;

-- The turns (locks.TURNS) of the lanes (p_classes[i], p_keys[i]) in the cancellers' one order: the wheel's turns,
-- then the levels' ascending, each lane's in turn, so no two cancels deadlock. A caller takes them with a volatile
-- lock function in its select list, evaluated row by row in this order.
CREATE OR REPLACE FUNCTION delaywheel.lane_turns(p_classes integer[], p_keys integer[])
RETURNS TABLE (class integer, key integer)
LANGUAGE sql IMMUTABLE AS $$
    SELECT l.class + t.turn, l.key FROM unnest(p_classes, p_keys) AS l(class, key), unnest(ARRAY[1, 2]) AS t(turn)
    ORDER BY l.class = 1685520416 DESC, l.key, l.class + t.turn
$$;

-- Wait for the delivery passes running now of these lanes (run after the cancellations committed: a pass that starts
-- later reads them). A pass in flight holds one of its lane's two turns, so each turn is taken in order. Shared, so
-- cancels never wait for each other, and held for no time at all: session locks, each released in this statement
-- (the inner query takes one, the outer one lets it go before the next is taken). A cancel granted a turn as the
-- pass holding it commits may keep it until its process runs; the next pass takes the other turn meanwhile, so it
-- does not wait for that cancel. Under a transaction's lock such a wait would last to the end of that transaction.
CREATE OR REPLACE FUNCTION delaywheel.await_lanes(p_classes integer[], p_keys integer[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared(t.class, t.key) FROM (
        SELECT t.class, t.key, pg_advisory_lock_shared(t.class, t.key)
        FROM delaywheel.lane_turns(p_classes, p_keys) t OFFSET 0) t;
END
$$;

-- Take the turns of these lanes until the transaction ends (a cancel inside a caller's transaction, which cannot
-- commit its cancellations first): deliverers of those lanes wait for that, or report busy.
CREATE OR REPLACE FUNCTION delaywheel.hold_lanes(p_classes integer[], p_keys integer[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(t.class, t.key) FROM delaywheel.lane_turns(p_classes, p_keys) t;
END
$$;

-- After the wait, what became of the messages with an id or a key, in one snapshot: those delivered into a topic (by
-- message_id's B-tree, or key's BRIN bloom summaries), and those cancelled earlier (cancellations_once's B-tree on
-- message_id, or the partial one on key). Once a pass has moved past a cancelled message it is no longer pending, and
-- a repeated cancel reports it `already_cancelled` from here rather than `not_found`. A message a pass set aside
-- (deliver.setaside) was not cancelled by a caller and is left out.
CREATE OR REPLACE FUNCTION delaywheel.cancel_settled_id(p_v bigint)
RETURNS TABLE (delivered bigint[], cancelled bigint[])
LANGUAGE sql STABLE AS $$
    SELECT ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages
                 WHERE message_id = p_v AND origin <> 'replay'),
           ARRAY(SELECT DISTINCT message_id FROM delaywheel.cancellations
                 WHERE message_id = p_v AND NOT starts_with(reason, 'set aside: '))
$$;

CREATE OR REPLACE FUNCTION delaywheel.cancel_settled_key(p_v text)
RETURNS TABLE (delivered bigint[], cancelled bigint[])
LANGUAGE sql STABLE AS $$
    SELECT ARRAY(SELECT DISTINCT message_id FROM delaywheel.topic_messages
                 WHERE key = p_v AND origin <> 'replay'),
           ARRAY(SELECT DISTINCT message_id FROM delaywheel.cancellations
                 WHERE key = p_v AND NOT starts_with(reason, 'set aside: '))
$$;

-- cancel(message_id=…) and cancel(key=…) outside a transaction, each one call: find the pending messages and insert
-- their cancellations, one per message (a concurrent cancel's insert is waited for; then this one inserts nothing), in
-- one statement, so the rows found are pending in the insert's snapshot; COMMIT, before the wait, so a pass that
-- starts now reads the cancellations; wait for the passes in flight of the lanes that may hold the messages (worked
-- out after the commit: a level segment found is still pending there unless a pass that moved past it has committed,
-- and the search after sees what such a pass delivered); then, in a snapshot after the wait, the messages with the id
-- or key delivered, and those cancelled earlier, reported as found (`already_cancelled`, or delivered if one was).
-- found_ids: the messages found pending, then those; each array NULL when empty. If the insert fails, nothing is
-- committed and no lane is waited for.
CREATE OR REPLACE PROCEDURE delaywheel.cancel_by_id(
    p_v bigint, p_reason text,
    INOUT found_ids bigint[] DEFAULT NULL, INOUT marked_ids bigint[] DEFAULT NULL,
    INOUT delivered_ids bigint[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM delaywheel.lookup_plan(true, true);
    WITH found AS MATERIALIZED (SELECT * FROM delaywheel.cancel_find_id(p_v)),
    marked AS (
        INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
        SELECT f.id, f.deliver_at, f.key, p_reason FROM found f
        ON CONFLICT (message_id, due_at) DO NOTHING
        RETURNING message_id)
    SELECT array_agg(f.id), array_agg(m.message_id) FILTER (WHERE m.message_id IS NOT NULL)
    INTO found_ids, marked_ids
    FROM found f LEFT JOIN marked m ON m.message_id = f.id;
    COMMIT;
    PERFORM delaywheel.await_lanes(array_agg(l.class), array_agg(l.key)) FROM delaywheel.cancel_lanes_id(p_v) l;
    PERFORM delaywheel.lookup_plan(false, true);
    SELECT s.delivered, found_ids || s.cancelled INTO delivered_ids, found_ids
    FROM delaywheel.cancel_settled_id(p_v) s;
END
$$;

CREATE OR REPLACE PROCEDURE delaywheel.cancel_by_key(
    p_v text, p_h1 bigint, p_h2 bigint, p_slots integer[], p_reason text,
    INOUT found_ids bigint[] DEFAULT NULL, INOUT marked_ids bigint[] DEFAULT NULL,
    INOUT delivered_ids bigint[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM delaywheel.lookup_plan(true, true);
    WITH found AS MATERIALIZED (SELECT * FROM delaywheel.cancel_find_key(p_v, p_h1, p_h2, p_slots)),
    marked AS (
        INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)
        SELECT f.id, f.deliver_at, f.key, p_reason FROM found f
        ON CONFLICT (message_id, due_at) DO NOTHING
        RETURNING message_id)
    SELECT array_agg(f.id), array_agg(m.message_id) FILTER (WHERE m.message_id IS NOT NULL)
    INTO found_ids, marked_ids
    FROM found f LEFT JOIN marked m ON m.message_id = f.id;
    COMMIT;
    PERFORM delaywheel.await_lanes(array_agg(l.class), array_agg(l.key))
    FROM delaywheel.cancel_lanes_key(p_v, p_h1, p_h2) l;
    PERFORM delaywheel.lookup_plan(false, true);
    SELECT s.delivered, found_ids || s.cancelled INTO delivered_ids, found_ids
    FROM delaywheel.cancel_settled_key(p_v) s;
END
$$;
