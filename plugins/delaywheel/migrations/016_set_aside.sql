-- Rows a delivery pass cannot deliver are set aside, with their reason; the lane goes on (issue 18, finding 3).
--
-- Validation refuses every value PostgreSQL cannot store or cast (NUL, lone surrogates, properties that are not a
-- JSON object of strings), so a bad row only reaches a queue some other way: an older producer, a hand-written
-- INSERT, a restored dump. Before this, one such row stopped its lane for good: a level segment's properties that do
-- not cast to jsonb failed every later pass of the level, and a far segment's failed every roll, hence every wheel
-- pass. Now a pass whose statement fails on bad data finds the rows it cannot deliver (delaywheel.undeliverable),
-- records each here and cancels it (a `cancellations` row, reason 'set aside: …', which every deliverer already
-- anti-joins), and passes again. A message is delivered, cancelled or set aside: never two of them.

CREATE TABLE delaywheel.set_aside (
    message_id      bigint      NOT NULL,
    lane            text        NOT NULL,          -- 'level' | 'wheel'
    level           smallint,                      -- the level, for lane 'level'
    topic           text,
    key             text,
    deliver_at      timestamptz,                   -- its due time
    reason          text        NOT NULL,          -- bad_topic | bad_body | bad_properties (validation's codes)
    detail          text,                          -- PostgreSQL's error for the row
    set_aside_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the rest of the message as it was stored, to repair and re-send it by hand
    tags            text,
    properties      text,                          -- as stored (text: it may not be valid jsonb)
    body            bytea,
    is_json         boolean,
    reconsume_times integer,
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    PRIMARY KEY (message_id)                       -- set aside once
);

-- Why a message as stored in a queue cannot be delivered into topic_messages, or NULL if it can. The reason is one of
-- validation's codes; the detail is PostgreSQL's own message. Used only after a pass failed (never on the fast path).
CREATE FUNCTION delaywheel.undeliverable(
    topic text, body bytea, is_json boolean, properties text, OUT reason text, OUT detail text
) LANGUAGE plpgsql STABLE AS $$
DECLARE
    parsed jsonb;
BEGIN
    IF topic IS NULL THEN
        reason := 'bad_topic'; detail := 'no topic'; RETURN;
    END IF;
    IF body IS NULL OR is_json IS NULL THEN
        reason := 'bad_body'; detail := 'no body or no JSON flag'; RETURN;
    END IF;
    IF properties IS NULL THEN
        RETURN;
    END IF;
    BEGIN
        parsed := properties::jsonb;
    EXCEPTION WHEN data_exception THEN
        reason := 'bad_properties';
        GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
        detail := SQLERRM || coalesce(' (' || nullif(detail, '') || ')', '');
        RETURN;
    END;
    IF jsonb_typeof(parsed) <> 'object' THEN
        reason := 'bad_properties'; detail := 'properties are a JSON ' || jsonb_typeof(parsed) || ', not an object';
    END IF;
END $$;

-- A delivered message's properties are a JSON object (consumers read them as a dict: topics.pull). Validation
-- only ever writes objects; a queue row holding anything else now fails its delivery and is set aside instead of
-- reaching consumers. NOT VALID: rows delivered before are not re-read.
ALTER TABLE delaywheel.topic_messages
    ADD CONSTRAINT topic_messages_properties_object
    CHECK (properties IS NULL OR jsonb_typeof(properties) = 'object') NOT VALID;
