-- A cancel by key finds the far segments that may hold the key without testing every far segment's filter
-- (issue 19, item 4). With 10 million timers pending, ~13,500 far segments each had their key filter tested,
-- ~0.6 µs apiece: 9-11 ms per cancel, against a target of 2 ms for the whole call.
--
-- A send writes one far segment per far day, so its far keys are spread over ~27 segments. Here a send also writes
-- *summaries*: its far keys (those of its segments with a filter, sql/011) cut by a hash of the key into `buckets`
-- groups (a power of two, ~256-512 keys each, so that a summary's filter, 20 bits a key, stays in its row), one row
-- per group with that group's Bloom filter, the send's id range and its last far day. A cancel by key tests only the rows of
-- the key's group in each bucket count (`slot` = buckets + group: one B-tree range per count), ~one row per send,
-- and reads the far segments of the few sends that pass through the id ranges' GiST index (keyblooms.py).
-- Segments without a filter (fewer than 16 messages: a single send, sql/019) are found by their keys instead, in a
-- partial GIN index that holds only them.
--
-- A summary is of no use once the roll moved its last far day into the near wheel (`last_block` < near_until):
-- producers delete such rows as they write new ones (the runtime may delete from this table only). Until then a
-- cancel may still test one; the segments it points to are gone, and the rolled messages are found in the near
-- wheel, so that costs a filter test and nothing else.

CREATE TABLE delaywheel.far_key_summaries (
    slot       integer     NOT NULL CHECK (slot >= 1),  -- buckets + group; buckets a power of two
    id_lo      bigint      NOT NULL,                    -- the send's far segments lie within [id_lo, id_hi]
    id_hi      bigint      NOT NULL,
    last_block timestamptz NOT NULL,                    -- its last far day
    bloom      bytea       NOT NULL,                    -- Bloom filter of the group's keys, as sql/011's
    CHECK (id_lo <= id_hi)
);
CREATE INDEX far_key_summaries_slot ON delaywheel.far_key_summaries (slot);
CREATE INDEX far_key_summaries_last_block ON delaywheel.far_key_summaries (last_block);

CREATE INDEX wheel_far_segments_unfiltered_keys ON delaywheel.wheel_far_segments USING gin (keys)
    WITH (fastupdate = off) WHERE key_bloom IS NULL;

-- Far segments written before this migration: each its own summary of one group (slot 1: every key).
INSERT INTO delaywheel.far_key_summaries (slot, id_lo, id_hi, last_block, bloom)
SELECT 1, id_first, id_last, block, key_bloom FROM delaywheel.wheel_far_segments WHERE key_bloom IS NOT NULL;

GRANT SELECT, INSERT, DELETE ON delaywheel.far_key_summaries TO delaywheel_runtime;
