-- A lighter single send (issue 19, item 5). `Store.send` inside a caller's transaction had drifted to 1.9 x a
-- single-row INSERT against its 2 x target. Timed per function (track_functions, 3,000 sends each in its own
-- transaction), send_one_savepoint took 166 us on the server, and 78 us of it went to two helpers that were meant to
-- be inlined and were not: partition_width (32 us: its `SET search_path` clause keeps it out of line) and due_hint
-- (46 us: a FROM clause, and declared IMMUTABLE over extract(), which is STABLE). A SQL function that is not inlined is
-- planned again in each transaction that calls it (plpgsql keeps a simple expression's state per transaction), which
-- is why a loop of calls in one transaction had shown partition_ready at 4 us. partition_width loses its SET clause,
-- and due_hint is one expression of the volatility of what it calls: both are inlined, and send_one_savepoint took
-- 119 us.
--
-- partition_width runs inside ensure_partition, lock_partition and drop_partition (SECURITY DEFINER, each with its own
-- `SET search_path = pg_catalog, pg_temp`, under which an inlined body is parsed) and with the caller's rights
-- elsewhere: it compares its argument with literals, which resolves in pg_catalog first whatever the caller's path.
--
-- send_one reads the roll's bound unlocked and takes FOR KEY SHARE only for a far timer, as send_many does since
-- bench/results/2026-11-27-consumer-after-horizon-and-near-lock.json: a near timer's send no longer writes a row lock
-- (a WAL record) and no longer waits for a roll in progress. The rest of send_one is sql/022's.

ALTER FUNCTION delaywheel.partition_width(text) RESET search_path;  -- its body is sql/025's

-- sql/019's due_hint in one expression: Python's str() of the due time's epoch seconds (shortest form, at least one
-- decimal), as producer._announce writes it. trim_scale drops extract's trailing zeros; an integral value gets '.0'.
CREATE OR REPLACE FUNCTION delaywheel.due_hint(due timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT pg_catalog.trim_scale(extract(epoch FROM due))::text
           || CASE WHEN pg_catalog.scale(pg_catalog.trim_scale(extract(epoch FROM due))) = 0 THEN '.0' ELSE '' END
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
