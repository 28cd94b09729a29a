-- One message in one statement (issue 19, item 5): `Store.send` was six round trips (BEGIN, clock and ids, partition
-- check, near_until, COPY, NOTIFY, COMMIT) plus Arrow arrays for one message. The client applies every rule that does
-- not need the clock (validation.prepare); this function reads the clock, takes the id and writes the one row
-- send_many would write for the message: the topic row (direct), a segment of one (level), a near-wheel row or a far
-- segment of one (wheel), creating its partition if missing. It NOTIFYs as send_many does.
--
-- p_lane is 'direct', 'level' or 'wheel' with the due time p_due_offset_us after the clock (negative: a due time
-- already past), or 'at': the due time is p_deliver_at, placed here against the clock (validation.place's rules:
-- not more than p_max_ahead_us ahead, not more than p_past_tolerance_us behind, direct when due). An 'at' message
-- out of those bounds is not written: message_id is NULL and the client names the rule it broke with the returned
-- clock, so the verdict is validation.place's own.
--
-- These functions run with the caller's rights and search_path: every relation is qualified with its schema and
-- every function they call is pg_catalog's (searched first whatever the path says) or qualified. A `SET search_path`
-- clause would cost each call a quarter of its time (the settings saved and restored, no SQL function inlined).

-- The partition of `parent` holding `at` exists when this returns (created through ensure_partition, sql/017, the
-- runtime's only way to DDL). PartitionCache.ensure's rule: a concurrent creator may make ensure_partition raise
-- duplicate_table, which means the partition is there.
CREATE OR REPLACE FUNCTION delaywheel.partition_ready(parent text, at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    width interval := delaywheel.partition_width(parent);
    lo timestamptz := date_trunc(CASE WHEN width = interval '1 hour' THEN 'hour' ELSE 'day' END, at AT TIME ZONE 'UTC')
                      AT TIME ZONE 'UTC';
BEGIN
    IF to_regclass(format('delaywheel.%I', parent || '_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI'))) IS NULL THEN
        BEGIN
            PERFORM delaywheel.ensure_partition(parent, lo, lo + width);
        EXCEPTION WHEN duplicate_table THEN
            NULL;
        END;
    END IF;
END $$;

-- A due time as producer._notify writes it: Python's str() of its epoch seconds (shortest form, at least one decimal).
-- (extract gives six decimals; trimming them is a fifth of a regexp's cost.)
CREATE OR REPLACE FUNCTION delaywheel.due_hint(due timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN strpos(t, '.') = 0 THEN t || '.0' WHEN right(r, 1) = '.' THEN r || '0' ELSE r END
    FROM (SELECT t, rtrim(t, '0') AS r FROM (SELECT extract(epoch FROM due)::text AS t) a) b
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
    PERFORM pg_notify('delaywheel_enqueue', delaywheel.due_hint(due));  -- producer.NOTIFY_CHANNEL
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
                                        timestamptz, timestamptz, bigint, bigint, bigint) IS
    'One message in one statement (Store.send): the clock, the id, the row send_many would write, its partition, the NOTIFY';

GRANT EXECUTE ON FUNCTION delaywheel.partition_ready(text, timestamptz) TO delaywheel_runtime;
GRANT EXECUTE ON FUNCTION delaywheel.due_hint(timestamptz) TO delaywheel_runtime;
GRANT EXECUTE ON FUNCTION delaywheel.send_one(text, bytea, boolean, text, text, text, text, smallint, integer, integer,
                                              bigint, timestamptz, timestamptz, bigint, bigint, bigint)
    TO delaywheel_runtime;
GRANT EXECUTE ON FUNCTION delaywheel.send_one_savepoint(text, bytea, boolean, text, text, text, text, smallint, integer,
                                                        integer, bigint, timestamptz, timestamptz, bigint, bigint,
                                                        bigint)
    TO delaywheel_runtime;
