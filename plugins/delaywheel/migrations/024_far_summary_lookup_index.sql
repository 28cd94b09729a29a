-- A cancel by key reads the far-key summaries (sql/020) from one index (issue 19, item 4; DESIGN.md, "Lookup cost").
--
-- The lookup tests the key's group in every send's summaries, ~one row per send (500 with 10M timers pending in
-- batches of 20,000). Through the B-tree on `slot` each of those rows was a heap page of its own (a send writes its
-- groups' rows side by side, and a lookup wants one group of each send): 498 pages. The index below holds the row's
-- id range and filter beside its slot, so the same rows are read as an index-only scan, side by side in its leaf
-- pages: 85 pages, and that part of a lookup took 0.61 ms instead of 1.84
-- (bench/results/2026-11-27-far-summary-index.json). It replaces the index on `slot` alone: a send writes as many
-- entries, larger ones (its cost did not change measurably).
--
-- A B-tree entry holds at most ~2.7 kB, and a filter is sized by its group's keys (20 bits a key), so a filter is
-- now capped at 2,000 bytes (keyblooms.SUMMARY_MAX_BYTES; the CHECK is the backstop): only a group of more than
-- ~800 keys meets the cap (a send of more than ~800,000 far keys, or keys chosen to share one group), and its filter
-- then lets more keys through, which costs a lookup a segment test, never a miss. A filter written before, larger than
-- that, becomes one that lets every key through (8 bytes of ones): its send's far segments are tested by their own
-- filters instead.
--
-- Index-only scans read the heap for pages not yet marked all-visible; autovacuum marks them after 2 % of the table is
-- new rather than 20 %, so the summaries of the last few hundred sends are all that may need it.

UPDATE delaywheel.far_key_summaries SET bloom = '\xffffffffffffffff'::bytea WHERE octet_length(bloom) > 2000;
ALTER TABLE delaywheel.far_key_summaries
    ADD CONSTRAINT far_key_summaries_bloom_size CHECK (octet_length(bloom) <= 2000),
    SET (autovacuum_vacuum_insert_scale_factor = 0.02);
CREATE INDEX far_key_summaries_lookup ON delaywheel.far_key_summaries (slot) INCLUDE (id_lo, id_hi, bloom);
DROP INDEX delaywheel.far_key_summaries_slot;
