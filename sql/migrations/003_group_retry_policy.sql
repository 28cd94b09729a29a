-- A consumer group's own retry policy (plugins/delaywheel/consume/retry.py): how many retries a failed message gets
-- before the group's dead-letter topic (NULL: the store's max_reconsume_times) and the delay before each, in
-- milliseconds (NULL: RocketMQ's ladder; a schedule shorter than the retries repeats its last delay). A group without
-- a row follows the ladder. The library checks the bounds with a clear error; these checks keep any row usable.

CREATE TABLE delaywheel.group_retry_policies (
    grp text PRIMARY KEY,
    max_attempts integer CHECK (max_attempts >= 0),
    delays_ms bigint[] CHECK (
        cardinality(delays_ms) >= 1 AND array_ndims(delays_ms) = 1 AND array_position(delays_ms, NULL) IS NULL
        AND 0 < ALL (delays_ms)),
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CHECK (max_attempts IS NOT NULL OR delays_ms IS NOT NULL)
);

-- Set, read and cleared by the runtime (`Store.set_retry_policy`, `clear_retry_policy`): a cleared policy's row goes.
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE delaywheel.group_retry_policies TO delaywheel_runtime;
