-- Announcements per lane (issue 19; DESIGN.md "Waking on time").
--
-- A producer announced every new due time on one channel, `delaywheel_enqueue`, and every deliverer listened to it.
-- Under Airflow each lane is its own task, so each of the 18 level tasks woke for every batch of wheel timers (and
-- read the level heads when the announced time fell due): ~1,800 wake-ups and head queries a second at 1,000 timers/s
-- for levels that held nothing (bench/RESULTS.md, "Airflow long-running consumer"). Now a producer announces on the
-- lane's own channel, `delaywheel_enqueue_wheel` or `delaywheel_enqueue_<level>` (producer.lane_channel), and a
-- deliverer listens to its lanes' channels and to `delaywheel_enqueue`, which stays the channel for a producer that
-- does not say the lane. Only send_one's NOTIFY changes; the rest of the function is sql/019's.

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
        -- FOR KEY SHARE waits for a roll in progress and reads its near_until (producer._write_wheel says why)
        SELECT s.near_until INTO near_until FROM delaywheel.wheel_state s FOR KEY SHARE;
        near_until := greatest(near_until, date_trunc('day', (clock + interval '1 microsecond' * p_near_window_us)
                                                      AT TIME ZONE 'UTC') AT TIME ZONE 'UTC');
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
