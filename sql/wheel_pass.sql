-- The wheel pass: one delivery pass over the timing wheel's near table in one call. It takes the wheel's lane, moves
-- the stragglers (rows committed behind the cursor) and the due rows after the cursor into their topics (skipping
-- cancelled ones), logs the cursor in the same transaction, and commits durably. Returns the next due time (a near
-- row, the far blocks' start, or now for a straggler) so the runner sleeps until then.

CREATE OR REPLACE PROCEDURE delaywheel.wheel_pass(
    p_injected timestamptz, p_limit integer, p_commit boolean, p_lane_wait text, p_head_window interval,
    p_trim_every bigint, p_lock_class integer, p_lock_key integer, p_topic_days timestamptz[],
    INOUT o_busy boolean DEFAULT NULL, INOUT o_waited boolean DEFAULT NULL, INOUT o_clock timestamptz DEFAULT NULL,
    INOUT o_missing boolean DEFAULT NULL, INOUT o_delivered bigint DEFAULT NULL, INOUT o_skipped bigint DEFAULT NULL,
    INOUT o_next_due timestamptz DEFAULT NULL, INOUT o_more boolean DEFAULT NULL, INOUT o_straggled jsonb DEFAULT NULL,
    INOUT o_summary jsonb DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    -- the statements' parameters
    p_now timestamptz; p_clock timestamptz; p_xmin text; p_horizon text; p_cursor_at timestamptz;
    p_cursor_id bigint; p_pass bigint; p_delivered bigint; p_at timestamptz; p_id bigint; p_before timestamptz;
    p_trim_from bigint; p_trim_to bigint;
    v_stragglers bigint; v_moved bigint; v_due_count bigint; v_last_at timestamptz; v_last_id bigint;
BEGIN
    o_busy := false; o_waited := false; o_missing := false; o_delivered := 0; o_skipped := 0; o_more := false;
    -- generic plans; the cancellations probed by their index whatever the statistics said when planned (db.PASS_PLAN)
    PERFORM set_config('plan_cache_mode', 'force_generic_plan', true), set_config('enable_seqscan', 'off', true),
            set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true);
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
               OR a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database()))))::text,
        coalesce(p_injected, clock_timestamp())
    INTO p_xmin, p_clock;
    SELECT pass, cursor_at, cursor_id, horizon_xid::text, delivered
    FROM delaywheel.wheel_cursor ORDER BY pass DESC LIMIT 1
    INTO p_pass, p_cursor_at, p_cursor_id, p_horizon, p_delivered;
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
    WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c
                      WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
    ORDER BY deliver_at, id
     RETURNING topic, queue_offset, xid)
    SELECT (SELECT count(*) FROM moved), (
        SELECT coalesce(jsonb_object_agg(topic, jsonb_build_array(n, x, lo, hi)), '{}'::jsonb)
        FROM (SELECT topic, count(*) AS n, min(xid::text) AS x, min(queue_offset) AS lo, max(queue_offset) AS hi,
                     pg_notify('delaywheel_topic', topic) AS notified
              FROM moved GROUP BY topic) s
    )
    INTO v_stragglers, o_straggled;
    -- after the stragglers' move is planned: they have no index in due order
    PERFORM set_config('enable_sort', 'off', true), set_config('jit', 'off', true);
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
    WHERE NOT EXISTS (SELECT 1 FROM delaywheel.cancellations c
                      WHERE c.message_id = "d"."id" AND c.due_at = "d"."deliver_at")
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
    INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered)
    VALUES (p_pass, p_at, p_id, p_xmin::xid8, p_delivered);
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
