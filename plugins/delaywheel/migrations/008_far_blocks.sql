-- Far blocks without B-trees (timing wheel, issue 3).
--
-- A far block (`wheel_far`, one per day beyond `near_until`) is written by producers, read whole once by the
-- roll (a sequential scan, `INSERT ... SELECT` into the near wheel, `DROP`), and otherwise only searched by
-- cancel by id or key. Its B-trees on id, key and due time cost every enqueue an index insert at a random
-- page (most random due times up to 30 days land here) and grew with the pending set: enqueue with 10M
-- pending ran at half the rate of an empty store, and at a quarter of the naive design's.
--
-- BRIN instead: a block is append-only, so the range of pages a producer's batch went to is summarized
-- (minmax-multi on id: ids are handed out in send order; a bloom filter on key) and a lookup reads the
-- summaries plus the few page ranges that may match, in each block. An insert into the block's open last
-- range costs nothing; `autosummarize` summarizes a range once it is full. The near wheel keeps its B-trees:
-- cancels of timers due within days (order timeouts) stay index lookups.
--
-- The due-time index goes without a replacement: nothing reads a far block in due order (the roll moves a
-- whole block; the near wheel's index orders it), and the wheel's next-due time takes `near_until` as the far
-- blocks' lower bound (pending.WHEEL_HEAD).

DROP INDEX delaywheel.wheel_far_id, delaywheel.wheel_far_key, delaywheel.wheel_far_due;

CREATE INDEX wheel_far_id ON delaywheel.wheel_far USING brin (id int8_minmax_multi_ops)
    WITH (pages_per_range = 16, autosummarize = on);
CREATE INDEX wheel_far_key ON delaywheel.wheel_far
    USING brin (key text_bloom_ops (n_distinct_per_range = 1000, false_positive_rate = 0.01))
    WITH (pages_per_range = 16, autosummarize = on);
