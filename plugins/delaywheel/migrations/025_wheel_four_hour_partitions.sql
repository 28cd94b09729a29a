-- The near wheel in 4-hour partitions instead of hourly ones (issue 19, item 4). Nothing prunes the wheel's
-- partitions for a lookup by key or id (they are by due time), so a cancel opened and locked every one of them with
-- its key index: a near window of ~93 hourly partitions was most of a `cancel(key=…)` (p50 2.1 ms with 10M pending,
-- 0.94 ms on the same store with 24 partitions left; bench/results/2026-11-28-wheel-partition-width.json). Nothing
-- reads the wheel a partition at a time: passes walk the (deliver_at, id) index from the cursor, the head looks
-- within an hour of it, the roll and retire take whatever bounds a partition has. The price: retire drops a
-- partition once its last row is passed, so delivered rows stay on disk up to 4 hours instead of 1
-- (docs/capacity.md).
--
-- A store migrated from hourly partitions keeps them. First each 4-hour block holding one is given the rest of its
-- hours, by the hourly ensure_partition before it is replaced: a block is then whole hours or nothing, so that a
-- partition starting where a block starts still means the block is there (what ensure_partition and partition_ready
-- look for). Retire drops only partitions already passed, which no send can need again. ensure_partition, asked for a
-- block whose start was dropped, creates only what no partition covers.

-- The start of the partition of width `width` holding `at`: a multiple of the width since the epoch (UTC), as
-- partitions.floor_to computes it. An hour, 4 hours and a day all divide a day, so for those widths this is
-- date_trunc's hour and day.
CREATE OR REPLACE FUNCTION delaywheel.partition_start(at timestamptz, width interval) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.date_bin(width, at, timestamptz '1970-01-01 00:00:00+00')
$$;

-- The name ensure_partition gives the partition of `parent` starting at `lo` (sql/001's rule).
CREATE OR REPLACE FUNCTION delaywheel.partition_name(parent text, lo timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT parent || '_p' || pg_catalog.to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI')
$$;

DO $$
DECLARE
    hour timestamptz;
BEGIN
    FOR hour IN
        SELECT DISTINCT b.block + interval '1 hour' * h.i
        FROM (SELECT delaywheel.partition_start(p.lo, interval '4 hours') AS block
              FROM delaywheel.partitions p WHERE p.parent = 'wheel' AND p.hi - p.lo < interval '4 hours') b,
             generate_series(0, 3) h(i)
        ORDER BY 1
    LOOP
        PERFORM delaywheel.ensure_partition('wheel', hour, hour + interval '1 hour');  -- sql/017: if missing
    END LOOP;
END $$;

CREATE OR REPLACE FUNCTION delaywheel.partition_width(parent_name text) RETURNS interval
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE parent_name
        WHEN 'level_segments' THEN interval '1 hour'
        WHEN 'wheel' THEN interval '4 hours'
        WHEN 'wheel_far_segments' THEN interval '24 hours'
        WHEN 'topic_messages' THEN interval '24 hours'
        WHEN 'cancellations' THEN interval '24 hours'
    END
$$;

-- Creates the partition of `parent` covering [lo, hi) if none starts at lo (serialised per parent); where partitions
-- of an earlier width cover part of the range, one partition for each part they leave, named by where it starts.
-- Only the store's parents, and only one whole aligned width (UTC), as `partitions.PartitionCache` asks for.
CREATE OR REPLACE FUNCTION delaywheel.ensure_partition(parent text, lo timestamptz, hi timestamptz)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    width interval := delaywheel.partition_width(parent);
    name text;
    piece record;
    piece_name text;
BEGIN
    IF width IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of the store', quote_literal(parent)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lo IS NULL OR NOT isfinite(lo) OR hi IS DISTINCT FROM lo + width
       OR lo <> delaywheel.partition_start(lo, width) THEN
        RAISE EXCEPTION 'a partition of % covers one whole % (UTC), not [%, %)', parent, width, lo, hi
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    name := delaywheel.partition_name(parent, lo);
    IF to_regclass(format('delaywheel.%I', name)) IS NULL THEN
        PERFORM pg_advisory_xact_lock(hashtext('delaywheel.partition.' || parent));
        IF to_regclass(format('delaywheel.%I', name)) IS NULL THEN
            FOR piece IN
                SELECT lower(g) AS lo, upper(g) AS hi FROM unnest(
                    tstzmultirange(tstzrange(ensure_partition.lo, ensure_partition.hi))
                    - coalesce((SELECT range_agg(tstzrange(p.lo, p.hi)) FROM delaywheel.partitions p
                                WHERE p.parent = ensure_partition.parent
                                  AND p.lo < ensure_partition.hi AND p.hi > ensure_partition.lo),
                               '{}'::tstzmultirange)) g
            LOOP
                piece_name := delaywheel.partition_name(parent, piece.lo);
                EXECUTE format('CREATE TABLE delaywheel.%I PARTITION OF delaywheel.%I FOR VALUES FROM (%L) TO (%L)',
                               piece_name, parent, piece.lo, piece.hi);
                -- Rows go in and out through the parent, whose grants are the ones checked; the store names a
                -- partition itself only to read it (the roll, retire), so that is all it may do to one.
                EXECUTE format('GRANT SELECT ON delaywheel.%I TO delaywheel_runtime', piece_name);
            END LOOP;
        END IF;
    END IF;
    RETURN name;
END $$;

-- The partition of `parent` holding `at` exists when this returns (sql/019, for any width now).
CREATE OR REPLACE FUNCTION delaywheel.partition_ready(parent text, at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    width interval := delaywheel.partition_width(parent);
    lo timestamptz := delaywheel.partition_start(at, width);
BEGIN
    IF to_regclass(format('delaywheel.%I', delaywheel.partition_name(parent, lo))) IS NULL THEN
        BEGIN
            PERFORM delaywheel.ensure_partition(parent, lo, lo + width);
        EXCEPTION WHEN duplicate_table THEN
            NULL;
        END;
    END IF;
END $$;
