-- A pass commits without waiting for its WAL to reach the disk (issue 19, item 4: cancels and deliveries independent
-- of each other). The procedures are those of migrations 028 (wheel_pass) and 029 (level_pass), whose headers say
-- what each does, with one line added before their COMMIT: synchronous_commit off for that transaction only. Inside
-- a caller's transaction (p_commit false) the caller's commit decides, as before. Their copies of the lane's lock
-- became one function, take_lane.
--
-- Why: PostgreSQL releases a transaction's locks only after its commit is flushed, and the flushes of all sessions
-- queue for one WAL write lock. With 700 cancels a second, each a durable commit, beside 1,000 deliveries a second,
-- a pass's commit waited behind their flushes while holding its lane's lock, so the next pass started late and the
-- cancels waiting for the lane waited longer: delivery p99 1.40-1.54 x the run without cancels, and a durable
-- one-row INSERT in the cancels' place 1.21-1.58 x; beside two busy loops 1.59 x
-- (bench/results/2026-11-30-race-pooled-rounds.json). With the passes' commits not waiting: 1.00 x beside the busy
-- loops, and idle every arm's p99 lower, the ratio inside the runs' noise
-- (bench/results/2026-11-30-race-passes-not-waiting.json; DESIGN.md, "The passes' commits, not waiting for their
-- flush").
--
-- Why it loses nothing: a pass writes only what the next pass can write again (the topics' rows, the cursor's entry
-- or the level's checkpoint), all in one transaction, and leaves the wheel rows and level segments it read as they
-- were. A crash of PostgreSQL (not of the deliverer) within about 3 x wal_writer_delay of the pass may undo it whole;
-- the next pass after the restart then delivers the same messages, once: none lost, none twice in a topic, none
-- early. Any later durable commit of any session flushes the pass too (the WAL is flushed in order), so what can
-- see an undone pass is only what read it and committed nothing durable since:
-- - a consumer, whose batch is handed out again after the crash: at least once, as a crash before its ack (its ack
--   travels with its next pull without waiting for the flush either, consume/topics.py);
-- - a cancel answering `already_delivered`: before it answers, it commits a WAL record of its own and waits for
--   that flush (ops/cancel.py, durable_answer), so the delivery it reports cannot be undone after the caller hears
--   of it (a later cancel of the same message would otherwise find it pending again and answer `cancelled`).

-- The lane's lock, shared by both passes (028 and 029 each had a copy of this block): tried, then, if another session
-- holds it, waited for up to p_wait (lock_timeout, for this wait only); 'free', 'waited' or 'busy'. The lock is the
-- transaction's (released at its commit); on 'busy' the failed wait's subtransaction is undone, lock_timeout with it.
CREATE FUNCTION delaywheel.take_lane(p_class integer, p_key integer, p_wait text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_lock_timeout text;
BEGIN
    IF pg_try_advisory_xact_lock(p_class, p_key) THEN
        RETURN 'free';
    END IF;
    v_lock_timeout := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', p_wait, true);
        PERFORM pg_advisory_xact_lock(p_class, p_key);
    EXCEPTION WHEN lock_not_available THEN
        RETURN 'busy';
    END;
    PERFORM set_config('lock_timeout', v_lock_timeout, true);
    RETURN 'waited';
END
$$;

CREATE OR REPLACE PROCEDURE delaywheel.wheel_pass(
    p_injected timestamptz, p_limit integer, p_commit boolean, p_lane_wait text, p_head_window interval,
    p_trim_every bigint, p_lock_class integer, p_lock_key integer, p_topic_days timestamptz[],
    INOUT o_busy boolean DEFAULT NULL, INOUT o_waited boolean DEFAULT NULL, INOUT o_clock timestamptz DEFAULT NULL,
    INOUT o_missing boolean DEFAULT NULL, INOUT o_delivered bigint DEFAULT NULL, INOUT o_skipped bigint DEFAULT NULL,
    INOUT o_next_due timestamptz DEFAULT NULL, INOUT o_more boolean DEFAULT NULL, INOUT o_straggled jsonb DEFAULT NULL,
    INOUT o_summary jsonb DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    -- the statements' parameters (wheel.py's placeholders %(x)s)
    p_now timestamptz; p_clock timestamptz; p_xmin text; p_horizon text; p_cursor_at timestamptz;
    p_cursor_id bigint; p_pass bigint; p_delivered bigint; p_at timestamptz; p_id bigint; p_before timestamptz;
    p_trim_from bigint; p_trim_to bigint;
    v_stragglers bigint; v_moved bigint; v_due_count bigint; v_last_at timestamptz; v_last_id bigint;
BEGIN
    o_busy := false; o_waited := false; o_missing := false; o_delivered := 0; o_skipped := 0; o_more := false;
    -- generic plans; the cancellations probed by their index whatever the statistics said when planned (db.PASS_PLAN)
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true);
    -- the lane's lock; if another holds it, waited for up to p_lane_wait (levels.LANE_WAIT), else busy
    CASE delaywheel.take_lane(p_lock_class, p_lock_key, p_lane_wait)
        WHEN 'busy' THEN o_busy := true; RETURN;
        WHEN 'waited' THEN o_waited := true;
        ELSE NULL;  -- 'free'
    END CASE;
    -- the commit horizon and the clock, then the cursor, each in a snapshot taken with the lock held
    SELECT (
    SELECT coalesce(min(x), min(pg_snapshot_xmax(s.snap)))
    FROM (SELECT pg_current_snapshot() AS snap) s
    LEFT JOIN LATERAL pg_snapshot_xip(s.snap) x ON mod(x::text::bigint, 4294967296) NOT IN (
        SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
        WHERE a.backend_xid IS NOT NULL
          AND (a.usesysid IS NULL
               OR a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))))::text, coalesce(p_injected, clock_timestamp()) INTO p_xmin, p_clock;
    SELECT pass, cursor_at, cursor_id, horizon_xid::text, delivered FROM delaywheel.wheel_cursor ORDER BY pass DESC LIMIT 1 INTO p_pass, p_cursor_at, p_cursor_id, p_horizon, p_delivered;
    p_xmin := greatest(p_xmin::xid8, p_horizon::xid8)::text;  -- the horizon only moves forward
    o_clock := p_clock;
    IF p_clock < p_cursor_at THEN  -- an injected clock went backwards: nothing delivered rather than early
        o_next_due := p_cursor_at;
        RETURN;
    END IF;
    IF NOT date_bin('1 day', p_clock, 'epoch') = ANY(p_topic_days)
       AND delaywheel.partition_named('topic_messages', date_bin('1 day', p_clock, 'epoch')) IS NULL THEN
        o_missing := true;  -- created by the caller in a transaction of its own, then the pass again
        RETURN;
    END IF;
    p_now := p_clock;
    WITH
    -- rows behind the cursor whose transactions committed after the last pass, into the topics
    moved AS (
    INSERT INTO delaywheel.topic_messages
        (topic, message_id, origin, key, tags, properties, body, is_json, deliver_at, delivered_at)
    SELECT topic, id, 'wheel', key, tags, properties, body, is_json, deliver_at,
           coalesce(p_injected::timestamptz, clock_timestamp())
    FROM (
        SELECT * FROM delaywheel.wheel
        WHERE xid >= p_horizon::xid8 AND xid < p_xmin::xid8 AND deliver_at <= p_cursor_at
          AND (deliver_at, id) <= (p_cursor_at, p_cursor_id)
    ) d
    WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
    ORDER BY deliver_at, id
     RETURNING topic, queue_offset, xid)
    SELECT (SELECT count(*) FROM moved), (
        SELECT coalesce(jsonb_object_agg(topic, jsonb_build_array(n, x, lo, hi)), '{}'::jsonb)
        FROM (SELECT topic, count(*) AS n, min(xid::text) AS x, min(queue_offset) AS lo, max(queue_offset) AS hi,
                     pg_notify('delaywheel_topic', topic) AS notified
              FROM moved GROUP BY topic) s
    )
    INTO v_stragglers, o_straggled;
    PERFORM set_config('enable_sort', 'off', true), set_config('jit', 'off', true);  -- after the stragglers' move is planned (wheel.py)
    WITH
    -- the due batch after the cursor, in (deliver_at, id) order
    due AS (
        SELECT * FROM delaywheel.wheel
        WHERE deliver_at >= p_cursor_at AND (deliver_at, id) > (p_cursor_at, p_cursor_id)
          AND deliver_at <= p_now AND xid < p_xmin::xid8
        ORDER BY deliver_at, id
        LIMIT p_limit
    ),
    -- into the topics
    moved AS (
    INSERT INTO delaywheel.topic_messages
        (topic, message_id, origin, key, tags, properties, body, is_json, deliver_at, delivered_at)
    SELECT topic, id, 'wheel', key, tags, properties, body, is_json, deliver_at,
           coalesce(p_injected::timestamptz, clock_timestamp())
    FROM (SELECT * FROM due) d
    WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
    ORDER BY deliver_at, id
     RETURNING topic, queue_offset, xid)
    SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM due),
           (SELECT deliver_at FROM due ORDER BY deliver_at DESC, id DESC LIMIT 1),
           (SELECT id FROM due ORDER BY deliver_at DESC, id DESC LIMIT 1), (
        SELECT coalesce(jsonb_object_agg(topic, jsonb_build_array(n, x, lo, hi)), '{}'::jsonb)
        FROM (SELECT topic, count(*) AS n, min(xid::text) AS x, min(queue_offset) AS lo, max(queue_offset) AS hi,
                     pg_notify('delaywheel_topic', topic) AS notified
              FROM moved GROUP BY topic) s
    )
    INTO v_moved, v_due_count, v_last_at, v_last_id, o_summary;
    o_more := v_due_count = p_limit;  -- a full batch: more is due now
    IF o_more THEN
        p_at := v_last_at; p_id := v_last_id;
    ELSE
        p_at := p_clock; p_id := 9223372036854775807;
    END IF;
    o_delivered := v_stragglers + v_moved;
    o_skipped := v_due_count - v_moved;
    p_pass := p_pass + 1;
    p_delivered := p_delivered + o_delivered;
    INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered) VALUES (p_pass, p_at, p_id, p_xmin::xid8, p_delivered);
    IF p_pass % p_trim_every = 0 THEN
        p_trim_from := p_pass - 2 * p_trim_every;
        p_trim_to := p_pass - p_trim_every;
        DELETE FROM delaywheel.wheel_cursor WHERE pass >= p_trim_from AND pass < p_trim_to;
    END IF;
    IF p_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);  -- the pass's commit: not waiting for its flush (030)
        COMMIT;  -- before the head: the rows are readable without waiting for it
    END IF;
    IF o_more THEN
        o_next_due := p_clock;
        RETURN;
    END IF;
    p_before := p_at + p_head_window;
        SELECT least(
            -- the first near row after the cursor
            near.at,
            -- far blocks pending: when they start
            (SELECT near_until FROM delaywheel.wheel_roll WHERE EXISTS (SELECT FROM delaywheel.wheel_far_segments)),
            -- a straggler behind the cursor: due now
            (SELECT p_clock::timestamptz WHERE (
                SELECT w.xid FROM delaywheel.wheel w
                WHERE w.xid >= p_xmin::xid8 AND w.deliver_at <= p_at
                ORDER BY w.xid LIMIT 1) IS NOT NULL))
        FROM (SELECT (SELECT w.deliver_at FROM delaywheel.wheel w
              WHERE w.deliver_at >= p_at AND (w.deliver_at, w.id) > (p_at, p_id) AND w.deliver_at < p_before
              ORDER BY w.deliver_at, w.id LIMIT 1)) near(at) WHERE near.at IS NOT NULL
    INTO o_next_due;
    IF NOT FOUND THEN
            SELECT least(
                -- the first near row after the cursor
                near.at,
                -- far blocks pending: when they start
                (SELECT near_until FROM delaywheel.wheel_roll WHERE EXISTS (SELECT FROM delaywheel.wheel_far_segments)),
                -- a straggler behind the cursor: due now
                (SELECT p_clock::timestamptz WHERE (
                    SELECT w.xid FROM delaywheel.wheel w
                    WHERE w.xid >= p_xmin::xid8 AND w.deliver_at <= p_at
                    ORDER BY w.xid LIMIT 1) IS NOT NULL))
            FROM (SELECT (SELECT w.deliver_at FROM delaywheel.wheel w
                  WHERE w.deliver_at >= p_at AND (w.deliver_at, w.id) > (p_at, p_id)
                  ORDER BY w.deliver_at, w.id LIMIT 1)) near(at)
        INTO o_next_due;
    END IF;
END
$$;

CREATE OR REPLACE PROCEDURE delaywheel.level_pass(
    p_level integer, p_injected timestamptz, p_limit integer, p_commit boolean, p_setting_aside boolean,
    p_lane_wait text, p_lock_class integer, p_topic_days timestamptz[],
    INOUT o_busy boolean DEFAULT NULL, INOUT o_waited boolean DEFAULT NULL, INOUT o_clock timestamptz DEFAULT NULL,
    INOUT o_missing boolean DEFAULT NULL, INOUT o_moved bigint DEFAULT NULL, INOUT o_due bigint DEFAULT NULL,
    INOUT o_scanned bigint DEFAULT NULL, INOUT o_summary jsonb DEFAULT NULL, INOUT o_next_due timestamptz DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    -- the statements' parameters (levels.py's placeholders %(x)s)
    p_now timestamptz; p_xmin text; p_cxid text; p_cid bigint;
BEGIN
    o_busy := false; o_waited := false; o_missing := false; o_moved := 0; o_due := 0; o_scanned := 0;
    -- generic plans, the queue read in cursor order, the cancellations probed by their index (levels.PLAN)
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_sort', 'off', true), set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true);
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
               OR a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))))::text, coalesce(p_injected, clock_timestamp()) INTO p_xmin, p_now;
    SELECT coalesce(c.cursor_xid::text, '0'), coalesce(c.cursor_id, 0) FROM (SELECT) start LEFT JOIN delaywheel.level_checkpoint c ON c.level = p_level INTO p_cxid, p_cid;
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
            SELECT s.xid, s.id_last, m.id, s.level, m.topic, m.key, m.tags, CASE WHEN p_setting_aside AND EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id) THEN NULL ELSE m.properties::jsonb END AS properties, m.body, m.is_json,
                   s.reconsume_times, s.deliver_at

            FROM delaywheel.level_segments s, unnest("s"."ids", delaywheel.spread("s"."topics", "s".n), "s"."keys", delaywheel.spread("s"."tags", "s".n), delaywheel.spread("s"."properties", "s".n), "s"."bodies", delaywheel.spread("s"."is_json", "s".n)) AS "m"("id", "topic", "key", "tags", "properties", "body", "is_json")
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
        WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
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
    IF p_commit THEN
        PERFORM set_config('synchronous_commit', 'off', true);  -- the pass's commit: not waiting for its flush (030)
        COMMIT;  -- before the head: the rows are readable without waiting for it
    END IF;
    -- the level's head after the checkpoint the move wrote
    SELECT s.deliver_at FROM delaywheel.level_segments s
    WHERE s.level = p_level
      AND (s.xid, s.id_last) > (coalesce((SELECT "cursor_xid" FROM delaywheel.level_checkpoint WHERE level = p_level), '0'), coalesce((SELECT "cursor_id" FROM delaywheel.level_checkpoint WHERE level = p_level), 0))
    ORDER BY s.xid, s.id_last LIMIT 1
    INTO o_next_due;
END
$$;
