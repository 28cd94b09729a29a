-- Bulk enqueue claims (sql/004) compared in byte order.
--
-- A claim is a unique-index insert at a random place in (source, key), one per input row: the larger part of a
-- bulk enqueue's database time (bench/RESULTS.md, Spark). Under the database's default collation each of the
-- ~25 comparisons of that descent goes through the locale's strcoll; under "C" it is a memcmp, and claims were
-- 10-14 % cheaper (600,000 claims, three runs each). Nothing orders claims; equality is the same bytes either
-- way (both collations are deterministic), so every existing claim still matches exactly the keys it did.
ALTER TABLE delaywheel.idempotency
    ALTER COLUMN source TYPE text COLLATE "C",
    ALTER COLUMN key TYPE text COLLATE "C";
