-- Every transaction that writes rows into a topic commits durably: a row reaches a consumer only once its commit is
-- on disk. The passes are those of 030 with one change before their COMMIT: synchronous_commit is set on for that
-- transaction (030 set it off), also when the pass runs inside a caller's transaction (p_commit false), whose commit
-- then waits for its flush whatever the session's setting. send_one's direct branch does the same.
--
-- Why: PostgreSQL makes a commit that does not wait for its flush visible at once. A consumer could read a pass's
-- rows and ack them; a crash then undid the pass, and the transaction ids it had used were handed out again after
-- the restart, so the rows delivered again sorted before the group's offset (xid, queue_offset) and the group never
-- read them. A cancel after such a crash also found pending, and cancelled, a message a consumer had handled.
-- With the commit flushed before it becomes visible, what a consumer or a cancel reads can no longer be undone.

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
    PERFORM set_config('synchronous_commit', 'on', true);  -- this transaction's commit waits for its flush
    IF p_commit THEN
        COMMIT;  -- before the head: the rows are readable once they are on disk
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
    PERFORM set_config('synchronous_commit', 'on', true);  -- this transaction's commit waits for its flush
    IF p_commit THEN
        COMMIT;  -- before the head: the rows are readable once they are on disk
    END IF;
    -- the level's head after the checkpoint the move wrote
    SELECT s.deliver_at FROM delaywheel.level_segments s
    WHERE s.level = p_level
      AND (s.xid, s.id_last) > (coalesce((SELECT "cursor_xid" FROM delaywheel.level_checkpoint WHERE level = p_level), '0'), coalesce((SELECT "cursor_id" FROM delaywheel.level_checkpoint WHERE level = p_level), 0))
    ORDER BY s.xid, s.id_last LIMIT 1
    INTO o_next_due;
END
$$;

CREATE OR REPLACE FUNCTION delaywheel.send_one(
    p_topic text, p_body bytea, p_is_json boolean, p_key text, p_tags text, p_properties text,
    p_lane text, p_level smallint, p_requested_level integer, p_reconsume_times integer,
    p_due_offset_us bigint, p_deliver_at timestamptz, p_now timestamptz,
    p_max_ahead_us bigint, p_past_tolerance_us bigint, p_near_window_us bigint,
    OUT message_id bigint, OUT clock timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    lane text := p_lane;
    due timestamptz;
    near_until timestamptz;
    window_end timestamptz;
    block timestamptz;
BEGIN
    clock := coalesce(p_now, clock_timestamp());
    IF lane = 'at' THEN
        IF p_deliver_at > clock + interval '1 microsecond' * p_max_ahead_us
           OR p_deliver_at < clock - interval '1 microsecond' * p_past_tolerance_us THEN
            RETURN;  -- too far or too old: nothing written, message_id NULL
        END IF;
        due := p_deliver_at;
        lane := CASE WHEN due <= clock THEN 'direct' ELSE 'wheel' END;
    ELSE
        due := clock + interval '1 microsecond' * p_due_offset_us;
    END IF;
    message_id := nextval('delaywheel.message_id_seq');  -- a block of producer.ID_BLOCK ids, as send_many takes

    IF lane = 'direct' THEN
        PERFORM set_config('synchronous_commit', 'on', true);  -- a topic row: the commit waits for its flush
        PERFORM delaywheel.partition_ready('topic_messages', clock);
        INSERT INTO delaywheel.topic_messages (topic, message_id, origin, level, key, tags, properties, body, is_json,
                                               reconsume_times, deliver_at, delivered_at)
        VALUES (p_topic, message_id, 'direct', 0, p_key, p_tags, p_properties::jsonb, p_body, p_is_json,
                p_reconsume_times, due, clock);
        PERFORM pg_notify('delaywheel_topic', p_topic);  -- producer.TOPIC_CHANNEL
        RETURN;
    ELSIF lane = 'level' THEN
        PERFORM delaywheel.partition_ready('level_segments', clock);
        INSERT INTO delaywheel.level_segments (level, requested_level, reconsume_times, deliver_at, enqueued_at, id_first,
                                               id_last, n, ids, keys, bodies, topics, tags, properties, is_json, key_bloom)
        VALUES (p_level, p_requested_level, p_reconsume_times, due, clock, message_id, message_id, 1,
                ARRAY[message_id], ARRAY[p_key], ARRAY[p_body], ARRAY[p_topic], ARRAY[p_tags], ARRAY[p_properties],
                ARRAY[p_is_json], NULL);  -- a segment of fewer than keyblooms.MIN_MESSAGES has no filter
    ELSIF lane = 'wheel' THEN
        window_end := date_trunc('day', (clock + interval '1 microsecond' * p_near_window_us) AT TIME ZONE 'UTC')
                      AT TIME ZONE 'UTC';
        -- the roll's bound, unlocked: a near row is in the right place whatever a roll does (arrow_copy._write_wheel)
        SELECT greatest(r.near_until, window_end) INTO near_until FROM delaywheel.wheel_roll r;
        IF due >= near_until THEN
            -- a far timer: FOR KEY SHARE waits for a roll in progress, reads its bound and keeps the next roll out
            SELECT greatest(r.near_until, window_end) INTO near_until FROM delaywheel.wheel_roll r FOR KEY SHARE;
        END IF;
        IF due < near_until THEN
            PERFORM delaywheel.partition_ready('wheel', due);
            INSERT INTO delaywheel.wheel (id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at)
            VALUES (message_id, p_topic, p_key, p_tags, p_properties::jsonb, p_body, p_is_json, due, clock);
        ELSE
            block := date_trunc('day', due AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
            PERFORM delaywheel.partition_ready('wheel_far_segments', block);
            INSERT INTO delaywheel.wheel_far_segments (block, enqueued_at, deliver_ats, id_first, id_last, n, ids, keys,
                                                       bodies, topics, tags, properties, is_json, key_bloom)
            VALUES (block, clock, ARRAY[due AT TIME ZONE 'UTC'], message_id, message_id, 1, ARRAY[message_id],
                    ARRAY[p_key], ARRAY[p_body], ARRAY[p_topic], ARRAY[p_tags], ARRAY[p_properties], ARRAY[p_is_json],
                    NULL);
        END IF;
    ELSE
        RAISE EXCEPTION 'send_one: unknown lane %', quote_literal(p_lane) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- the lane's own channel (producer.lane_channel): only that lane's deliverers wake
    PERFORM pg_notify('delaywheel_enqueue_' || CASE WHEN lane = 'level' THEN p_level::text ELSE 'wheel' END,
                      delaywheel.due_hint(due));
END $$;
