-- Redrives of a consumer group's dead-letter topic (`%DLQ%<group>`) back into the group (ops/dlq.py, docs/dlq.md).
--
-- `dlq_redrives`: one row per redrive that sent anything: who asked (the caller's text and the database role), when,
-- how (every waiting row, ids, or a checked predicate, kept as the caller gave it) and how many.
-- `dlq_redriven`: one row per dead letter redriven, with the retry it became. Its key is what makes a redrive happen
-- once per dead letter: a row here is never redriven again nor listed as waiting. Both are written in the redrive's
-- own transaction, with the retries.
CREATE TABLE delaywheel.dlq_redrives (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    grp text NOT NULL,
    requested_by text,
    db_role text NOT NULL DEFAULT session_user,
    redriven_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    how text NOT NULL CHECK (how IN ('all', 'ids', 'where')),
    predicate text CHECK ((how = 'where') = (predicate IS NOT NULL)),
    redriven bigint NOT NULL CHECK (redriven > 0)
);

CREATE INDEX dlq_redrives_group ON delaywheel.dlq_redrives USING btree (grp, id);

CREATE TABLE delaywheel.dlq_redriven (
    grp text NOT NULL,
    message_id bigint NOT NULL,  -- the dead letter's id (its row in topic_messages, topic %DLQ%<grp>)
    redrive_id bigint NOT NULL REFERENCES delaywheel.dlq_redrives (id),
    retry_message_id bigint NOT NULL,  -- the retry it became, in %RETRY%<grp>
    PRIMARY KEY (grp, message_id)
);

CREATE INDEX dlq_redriven_redrive ON delaywheel.dlq_redriven USING btree (redrive_id);

-- The runtime appends to the record and reads it; it neither changes nor removes what is there (the default
-- privileges set by the baseline would grant UPDATE too).
REVOKE ALL ON TABLE delaywheel.dlq_redrives, delaywheel.dlq_redriven FROM delaywheel_runtime;
GRANT SELECT, INSERT ON TABLE delaywheel.dlq_redrives, delaywheel.dlq_redriven TO delaywheel_runtime;
GRANT SELECT, USAGE ON SEQUENCE delaywheel.dlq_redrives_id_seq TO delaywheel_runtime;
