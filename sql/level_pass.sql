-- The level pass: one delivery pass over a level queue in one call. It takes the lane, reads the database's clock,
-- moves the due messages after the level's checkpoint into their topics (skipping cancelled ones) and advances the
-- checkpoint in the same transaction, so a crash neither loses nor duplicates a delivery; the cursor never passes a
-- position an open transaction may still commit (the xid horizon). It commits durably: a consumer or a cancel never
-- reads a delivery a crash could undo. Returns the next due time so the runner sleeps until then.

CREATE OR REPLACE PROCEDURE delaywheel.level_pass(
    p_level integer, p_injected timestamptz, p_limit integer, p_commit boolean, p_setting_aside boolean,
    p_lane_wait text, p_lock_class integer, p_topic_days timestamptz[],
    INOUT o_busy boolean DEFAULT NULL, INOUT o_waited boolean DEFAULT NULL, INOUT o_clock timestamptz DEFAULT NULL,
    INOUT o_missing boolean DEFAULT NULL, INOUT o_moved bigint DEFAULT NULL, INOUT o_due bigint DEFAULT NULL,
    INOUT o_scanned bigint DEFAULT NULL, INOUT o_summary jsonb DEFAULT NULL, INOUT o_next_due timestamptz DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    -- the statements' parameters
    p_now timestamptz; p_xmin text; p_cxid text; p_cid bigint;
BEGIN
    o_busy := false; o_waited := false; o_missing := false; o_moved := 0; o_due := 0; o_scanned := 0;
    -- generic plans, the queue read in cursor order, the cancellations probed by their index (levels.PLAN)
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_sort', 'off', true),
            set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true),
            set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true);
    -- the lane's lock; if another holds it, waited for up to p_lane_wait (levels.LANE_WAIT), else busy
    CASE delaywheel.take_lane(p_lock_class, p_level, p_lane_wait)
        WHEN 'busy' THEN o_busy := true; RETURN;
        WHEN 'waited' THEN o_waited := true;
        ELSE NULL;  -- 'free'
    END CASE;
    -- the commit horizon and the clock, then the checkpoint, each in a snapshot taken with the lock held
    SELECT (
    SELECT coalesce(min(x), min(pg_snapshot_xmax(s.snap)))
    FROM (SELECT pg_current_snapshot() AS snap) s
    LEFT JOIN LATERAL pg_snapshot_xip(s.snap) x ON mod(x::text::bigint, 4294967296) NOT IN (
        SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL
          AND (a.usesysid IS NULL
               OR a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))))::text,
        coalesce(p_injected, clock_timestamp())
    INTO p_xmin, p_now;
    SELECT coalesce(c.cursor_xid::text, '0'), coalesce(c.cursor_id, 0)
    FROM (SELECT) start LEFT JOIN delaywheel.level_checkpoint c ON c.level = p_level
    INTO p_cxid, p_cid;
    o_clock := p_now;
    IF NOT date_bin('1 day', p_now, 'epoch') = ANY(p_topic_days)
       AND delaywheel.partition_named('topic_messages', date_bin('1 day', p_now, 'epoch')) IS NULL THEN
        o_missing := true;  -- created by the caller in a transaction of its own, then the pass again
        RETURN;
    END IF;
    WITH
    -- the batch after the checkpoint, and whether it is due up to each row (FIFO: the due prefix is what moves)
    batch AS (
        SELECT q.*, bool_and(q.deliver_at <= p_now) OVER (ORDER BY q.xid, q.id_last, q.id) AS due
        FROM (
            SELECT s.xid, s.id_last, m.id, s.level, m.topic, m.key, m.tags,
                   -- setting aside (after a pass failed on a row): a row set aside has no properties to cast
                   CASE WHEN p_setting_aside
                             AND EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id) THEN NULL
                        ELSE m.properties::jsonb END AS properties,
                   m.body, m.is_json,
                   s.reconsume_times, s.deliver_at

            FROM delaywheel.level_segments s,
                 unnest(s.ids, delaywheel.spread(s.topics, s.n), s.keys, delaywheel.spread(s.tags, s.n),
                        delaywheel.spread(s.properties, s.n), s.bodies, delaywheel.spread(s.is_json, s.n))
                     AS m(id, topic, key, tags, properties, body, is_json)
            WHERE s.level = p_level AND (s.xid, s.id_last) > (p_cxid::xid8, p_cid) AND s.xid < p_xmin::xid8
              AND (s.xid, m.id) > (p_cxid::xid8, p_cid)
            ORDER BY s.xid, s.id_last, m.id
            LIMIT p_limit
        ) q
    ),
    -- the due prefix: the checkpoint moves past all of it
    due AS (SELECT * FROM batch WHERE due),
    -- into the topics, except the cancelled
    moved AS (
        INSERT INTO delaywheel.topic_messages
            (topic, message_id, origin, level, key, tags, properties, body, is_json, reconsume_times,
             deliver_at, delivered_at)
        SELECT topic, id, 'level', level, key, tags, properties, body, is_json, reconsume_times,
               deliver_at, coalesce(p_injected::timestamptz, clock_timestamp())
        FROM due d
        WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c
                      WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
        ORDER BY xid, id_last, id
        RETURNING topic, queue_offset, xid
    ),
    -- the checkpoint past the due prefix (its row made by the level's first delivery); untouched when nothing was due
    advanced AS (
        INSERT INTO delaywheel.level_checkpoint AS c (level, cursor_xid, cursor_id, delivered, updated_at)
        SELECT p_level, xid, id, (SELECT count(*) FROM moved), clock_timestamp()
        FROM (SELECT xid, id FROM due ORDER BY xid DESC, id_last DESC, id DESC LIMIT 1) last
        ON CONFLICT (level) DO UPDATE SET cursor_xid = excluded.cursor_xid, cursor_id = excluded.cursor_id,
            delivered = c.delivered + excluded.delivered, updated_at = excluded.updated_at
    )
    SELECT (SELECT count(*) FROM moved),
           (SELECT count(*) FROM due),
           (SELECT count(*) FROM batch),
           (
        SELECT coalesce(jsonb_object_agg(topic, jsonb_build_array(n, x, lo, hi)), '{}'::jsonb)
        FROM (SELECT topic, count(*) AS n, min(xid::text) AS x, min(queue_offset) AS lo, max(queue_offset) AS hi,
                     pg_notify('delaywheel_topic', topic) AS notified
              FROM moved GROUP BY topic) s
    )
    INTO o_moved, o_due, o_scanned, o_summary;
    PERFORM set_config('synchronous_commit', 'on', true);  -- this transaction's commit waits for its flush
    IF p_commit THEN
        COMMIT;  -- before the head: the rows are readable once they are on disk
    END IF;
    -- the level's head after the checkpoint the move wrote
    SELECT s.deliver_at FROM delaywheel.level_segments s
    WHERE s.level = p_level
      AND (s.xid, s.id_last) > (
          coalesce((SELECT "cursor_xid" FROM delaywheel.level_checkpoint WHERE level = p_level), '0'),
          coalesce((SELECT "cursor_id" FROM delaywheel.level_checkpoint WHERE level = p_level), 0))
    ORDER BY s.xid, s.id_last LIMIT 1
    INTO o_next_due;
END
$$;
