-- Bulk enqueue (Spark, issue 5): bad input is kept with its reason, and re-running an input enqueues nothing new.

-- Rows a bulk job refused: which input, where in it, why (the same reason codes as `send`'s InvalidMessage)
-- and the row itself as text, so an operator can fix and resubmit it. One row per (source, file, row number),
-- so re-running the same input does not quarantine the same row twice.
CREATE TABLE delaywheel.quarantine (
    source          text        NOT NULL,          -- the job's idempotency source (default: the input path)
    source_file     text        NOT NULL,          -- the file (or 'query') the row came from
    row_number      bigint      NOT NULL,          -- 1-based record number within the file (header excluded)
    reason          text        NOT NULL,          -- bad_topic | bad_body | bad_level | too_far | malformed_record | ...
    detail          text        NOT NULL,          -- the sentence InvalidMessage gave
    raw             text,                          -- the input row, as JSON text
    quarantined_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (source, source_file, row_number)
);
CREATE INDEX quarantine_reason ON delaywheel.quarantine (reason, quarantined_at);

-- Idempotency records: a (source, key) claimed here in the transaction that COPYs the message, so a re-run,
-- a retried Spark task or a duplicate row in the input finds the claim and writes nothing.
-- key = the message key, or '<file>#<row number>' for rows without one.
CREATE TABLE delaywheel.idempotency (
    source       text        NOT NULL,
    key          text        NOT NULL,
    message_id   bigint      NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (source, key)
);
