-- Cancel by key also reports the messages with that key already delivered, so it searches the topics. With no
-- index on topic_messages.key that was a scan of every delivered message within retention: 1.1 s at 1.9M
-- delivered (bench/wheel_bench, 2026-11-22), whether or not the key had been delivered.
--
-- A bloom summary per 16-page range, as for far blocks (sql/008): topic partitions are append-only and searched
-- by key only by cancel, so a B-tree would cost every delivery a random index insert for a rare lookup. With the
-- summaries, the same lookup took 2 ms. Cancel prices sequential scans out for its transaction (db.LOOKUP_PLAN).
CREATE INDEX topic_messages_key ON delaywheel.topic_messages
    USING brin (key text_bloom_ops (n_distinct_per_range = 1000, false_positive_rate = 0.01))
    WITH (pages_per_range = 16, autosummarize = on);
