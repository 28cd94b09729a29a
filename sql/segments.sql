-- Helpers for packed segments: a level queue's and a far block's messages are stored as arrays, one row per
-- send_many batch (level_segments, wheel_far_segments), which the views level_queue and wheel_far unpack.

-- A segment's array with one element per message: a one-element array stands for that value n times.
CREATE OR REPLACE FUNCTION delaywheel.spread(items anyarray, n integer) RETURNS anyarray
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN cardinality(items) = 1 AND n > 1 THEN array_fill(items[1], ARRAY[n]) ELSE items END $$;

-- May a segment hold a key with hashes (h1, h2)? Bits (h1 + i * h2) mod m, i < 4, of its filter (keyblooms.py
-- computes the hashes, for a send's keys and a looked-up key alike). A segment without a filter may hold any key.
CREATE OR REPLACE FUNCTION delaywheel.bloom_may_hold(bloom bytea, h1 bigint, h2 bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT bloom IS NULL OR (
        get_bit(bloom, (h1 % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + h2) % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + 2 * h2) % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + 3 * h2) % (8 * octet_length(bloom)))::int) = 1)
$$;
