-- Setting aside: a message a pass cannot deliver is moved to set_aside with its reason, never stopping its lane.

-- Why a message as stored in a queue cannot be delivered into topic_messages, or NULL if it can. The reason is one of
-- validation's codes; the detail is PostgreSQL's own message. Used only after a pass failed (never on the fast path).
CREATE OR REPLACE FUNCTION delaywheel.undeliverable(
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
