-- send: one message in one statement (Store.send). send_one reads the database's clock, takes an id, writes the row
-- send_many would write (a level queue's segment, or the wheel's near table or a far block) into its partition,
-- made on demand, and NOTIFYs the lane's channel with the due time (due_hint) so a sleeping deliverer wakes early.

-- Python's str() of the due time's epoch seconds (shortest form, at least one decimal), as producer._announce
-- writes it. trim_scale drops extract's trailing zeros; an integral value gets '.0'.
CREATE OR REPLACE FUNCTION delaywheel.due_hint(due timestamptz) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT pg_catalog.trim_scale(extract(epoch FROM due))::text
           || CASE WHEN pg_catalog.scale(pg_catalog.trim_scale(extract(epoch FROM due))) = 0 THEN '.0' ELSE '' END
$$;

-- One message in one statement. A due time past the near window goes to a far block, inside it to the wheel,
-- at a fixed delay to its level's queue; a message sent already due is delivered at once (the direct branch),
-- committed durably. Returns the message's id and the clock it was read at.
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

-- send_one as a savepoint of the caller's transaction, in one round trip: a plpgsql block with an EXCEPTION clause is
-- a subtransaction, rolled back on any error (rows, partitions created, NOTIFYs), which comes back as its SQLSTATE and
-- message instead of aborting the caller's transaction; the client raises it (producer.send_one). SAVEPOINT, the
-- statement and RELEASE cost three round trips, and psycopg's pipeline mode cost more than that.
CREATE OR REPLACE FUNCTION delaywheel.send_one_savepoint(
    p_topic text, p_body bytea, p_is_json boolean, p_key text, p_tags text, p_properties text,
    p_lane text, p_level smallint, p_requested_level integer, p_reconsume_times integer,
    p_due_offset_us bigint, p_deliver_at timestamptz, p_now timestamptz,
    p_max_ahead_us bigint, p_past_tolerance_us bigint, p_near_window_us bigint,
    OUT message_id bigint, OUT clock timestamptz, OUT error_state text, OUT error_message text)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT s.message_id, s.clock INTO message_id, clock
    FROM delaywheel.send_one(p_topic, p_body, p_is_json, p_key, p_tags, p_properties, p_lane, p_level,
                             p_requested_level, p_reconsume_times, p_due_offset_us, p_deliver_at, p_now,
                             p_max_ahead_us, p_past_tolerance_us, p_near_window_us) s;
EXCEPTION WHEN OTHERS THEN  -- (not query_canceled: a cancel or statement_timeout still ends the statement)
    GET STACKED DIAGNOSTICS error_state = RETURNED_SQLSTATE, error_message = MESSAGE_TEXT;
END $$;

COMMENT ON FUNCTION delaywheel.send_one(text, bytea, boolean, text, text, text, text, smallint, integer, integer, bigint,
    timestamptz, timestamptz, bigint, bigint, bigint)
    IS 'One message in one statement (Store.send): the clock, the id, the row send_many would write, its partition, the NOTIFY';
