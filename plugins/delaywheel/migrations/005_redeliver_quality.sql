-- Redelivery audit (replay, reconcile) and the lateness data contract (Spark, issue 5).

-- Every replay request: who asked, when, which due-time range, from which topic (NULL = all) to which topic.
-- Replayed rows are topic_messages rows with origin = 'replay' and properties.REPLAY_ID = id; a message is
-- replayed into a target topic at most once (the replay skips (message_id, target) pairs already there),
-- so asking twice for the same range records a second request that replays nothing.
CREATE TABLE delaywheel.replays (
    id             bigserial   PRIMARY KEY,
    requested_by   text        NOT NULL,
    requested_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    due_from       timestamptz NOT NULL,
    due_until      timestamptz NOT NULL,           -- exclusive
    source_topic   text,
    target_topic   text,                           -- NULL = each message back to its own topic
    replayed       bigint,                         -- NULL while running
    skipped        bigint,                         -- already replayed to that topic before
    finished_at    timestamptz,
    CHECK (due_from < due_until)
);
-- What the replay dedup probes: replayed rows by message and topic.
CREATE INDEX topic_messages_replayed ON delaywheel.topic_messages (message_id, topic) WHERE origin = 'replay';

-- Every reconcile run: the business rows that need a timer against the pending timers, by key.
CREATE TABLE delaywheel.reconcile_runs (
    id            bigserial   PRIMARY KEY,
    requested_by  text        NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    business      text        NOT NULL,           -- 'table.key_column WHERE predicate'
    topic         text        NOT NULL,
    missing       bigint      NOT NULL,           -- rows needing a timer that had none: created
    stale         bigint      NOT NULL,           -- pending timers no row needs any more: cancelled
    created       bigint      NOT NULL,
    cancelled     bigint      NOT NULL,
    sample        jsonb       NOT NULL,           -- a few keys of each kind, for the report
    finished_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Delivery lateness (delivered_at - deliver_at) per due minute, lane/level and topic.
CREATE TABLE delaywheel.lateness_minutes (
    minute       timestamptz NOT NULL,            -- due time truncated to the minute
    lane         text        NOT NULL,            -- 'level' | 'wheel' | 'direct'
    level        smallint    NOT NULL,            -- 0 for wheel and direct
    topic        text        NOT NULL,
    deliveries   bigint      NOT NULL,
    p50_ms       double precision NOT NULL,
    p95_ms       double precision NOT NULL,
    p99_ms       double precision NOT NULL,
    max_ms       double precision NOT NULL,
    computed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (minute, lane, level, topic)
);

-- Great Expectations results of each lateness-contract run (the full validation result JSON).
CREATE TABLE delaywheel.validation_results (
    id            bigserial   PRIMARY KEY,
    suite         text        NOT NULL,
    window_start  timestamptz NOT NULL,
    window_end    timestamptz NOT NULL,
    success       boolean     NOT NULL,
    failed        text[]      NOT NULL,           -- names of the failed expectations
    result        jsonb       NOT NULL,
    report_path   text,
    validated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX validation_results_window ON delaywheel.validation_results (window_end DESC);
