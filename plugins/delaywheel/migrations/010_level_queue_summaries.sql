-- Level queues searched by id and key through BRIN summaries, not B-trees (store, issue 2).
--
-- A level-queue partition (one per enqueue hour) is append-only: deliverers read it in FIFO order through
-- level_queue_fifo (level, xid, id), and it is dropped whole once every level has passed it. Only cancel
-- searches it by id or key. The B-trees on id and key cost every send an index insert each (the key one at a
-- random page): 1.3 and 2.6 µs per message against 1.9 µs for the row itself (bench/store_bench, session 5),
-- for a lookup that happens once per cancelled message.
--
-- The same summaries as far blocks (sql/008): minmax-multi on id (ids are handed out in send order, so a
-- range's ids are close together), a bloom filter on key; a cancel reads the summaries and the one or two
-- 16-page ranges that may hold the message. The FIFO index stays: it is the queue.

DROP INDEX delaywheel.level_queue_id, delaywheel.level_queue_key;

CREATE INDEX level_queue_id ON delaywheel.level_queue USING brin (id int8_minmax_multi_ops)
    WITH (pages_per_range = 16, autosummarize = on);
CREATE INDEX level_queue_key ON delaywheel.level_queue
    USING brin (key text_bloom_ops (n_distinct_per_range = 1000, false_positive_rate = 0.01))
    WITH (pages_per_range = 16, autosummarize = on);
