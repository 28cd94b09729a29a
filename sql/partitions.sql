-- Partition maintenance: the store's hot tables are partitioned by time and retired by dropping whole partitions
-- (never row DELETEs, which bloat). The runtime role holds no DDL privilege; these SECURITY DEFINER functions, owned
-- by the owner role with a pinned search_path, are its only way to create, lock and drop partitions: they take a
-- parent from a fixed list and a time bound, never a table name.

-- The store's partitioned parents and their partition widths; NULL for anything else. Hours are absolute:
-- '24 hours', not '1 day', whose length depends on the session's time zone. No SET search_path: that clause would
-- keep it from being inlined into its callers; it compares its argument with literals, which resolve in pg_catalog
-- first whatever the caller's path.
CREATE OR REPLACE FUNCTION delaywheel.partition_width(parent_name text) RETURNS interval
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE parent_name
        WHEN 'level_segments' THEN interval '1 hour'
        WHEN 'wheel' THEN interval '4 hours'
        WHEN 'wheel_far_segments' THEN interval '24 hours'
        WHEN 'topic_messages' THEN interval '24 hours'
        WHEN 'cancellations' THEN interval '24 hours'
    END
$$;

-- The start of the partition of width `width` holding `at`: a multiple of the width since the epoch (UTC), as
-- partitions.floor_to computes it. An hour, 4 hours and a day all divide a day, so for those widths this is
-- date_trunc's hour and day.
CREATE OR REPLACE FUNCTION delaywheel.partition_start(at timestamptz, width interval) RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT pg_catalog.date_bin(width, at, timestamptz '1970-01-01 00:00:00+00')
$$;

-- The name ensure_partition gives the partition of `parent` starting at `lo`.
CREATE OR REPLACE FUNCTION delaywheel.partition_name(parent text, lo timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT parent || '_p' || pg_catalog.to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI')
$$;

-- The partition of a parent starting at `lower_bound` (NULL if there is none); raises for an unknown parent.
CREATE OR REPLACE FUNCTION delaywheel.partition_named(parent_name text, lower_bound timestamptz) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found text;
BEGIN
    IF delaywheel.partition_width(parent_name) IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of the store', quote_literal(parent_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- ensure_partition's name for it, if that is a partition of the parent starting there (cheap); else by bounds
    found := parent_name || '_p' || to_char(lower_bound AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI');
    IF EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhrelid = to_regclass(format('delaywheel.%I', found))
                 AND i.inhparent = to_regclass(format('delaywheel.%I', parent_name))
                 AND pg_get_expr(c.relpartbound, c.oid) LIKE 'FOR VALUES FROM (' || quote_literal(lower_bound) || ')%') THEN
        RETURN found;
    END IF;
    SELECT p.name INTO found FROM delaywheel.partitions p WHERE p.parent = parent_name AND p.lo = lower_bound;
    RETURN found;
END $$;

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

-- The partition of `parent` holding `at` exists when this returns (send_one's partition, made on demand).
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

-- Per consumer group and topic, the rows of the topic_messages partition `partition_name` the group has not read:
-- those past its offset on the topic, (xid, queue_offset) > (cursor_xid, cursor_offset); groups are those with an
-- offsets row for the topic (a group that never acked one has none). Counted up to `up_to` rows per group (NULL: all),
-- so a check that only asks whether any is unread stops at the first. One index range per group's queue from its offset (the
-- queue index, topic_messages_queue): a group that read everything costs one probe, one that read nothing a pass over its
-- topic's part of the index. Only groups with unread rows are returned. The one definition of "unread" at retirement:
-- partition_undrained and drop_partition both read it.
CREATE OR REPLACE FUNCTION delaywheel.partition_unread(partition_name text, up_to bigint DEFAULT NULL)
RETURNS TABLE (grp text, topic text, unread bigint)
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_inherits i
                   WHERE i.inhrelid = to_regclass(format('delaywheel.%I', partition_name))
                     AND i.inhparent = 'delaywheel.topic_messages'::regclass) THEN
        RAISE EXCEPTION '% is not a partition of delaywheel.topic_messages', quote_literal(partition_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY EXECUTE format(
        'SELECT o.grp, o.topic, sum(u.n)::bigint FROM delaywheel.consumer_offsets o'
        ' CROSS JOIN LATERAL (SELECT count(*) AS n FROM (SELECT FROM delaywheel.%I t WHERE t.topic = o.topic'
        '     AND t.qid = o.qid AND (t.xid, t.queue_offset) > (o.cursor_xid, o.cursor_offset) LIMIT $1) r) u'
        ' WHERE u.n > 0 GROUP BY o.grp, o.topic ORDER BY o.grp, o.topic', partition_name) USING up_to;
END $$;

-- Why the partition `partition_name` of `parent_name` ([lower_bound, upper_bound)) may not be dropped yet, or NULL if
-- it may. Run under the partition's ACCESS EXCLUSIVE lock (drop_partition), so no transaction still writes into it. A
-- cursor that cannot be read (NULL) counts as not passed.
CREATE OR REPLACE FUNCTION delaywheel.partition_undrained(parent_name text, partition_name text,
                                                          lower_bound timestamptz, upper_bound timestamptz)
RETURNS text LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
    found text;
    unread_floor interval;
BEGIN
    IF parent_name = 'level_segments' THEN
        EXECUTE format('SELECT count(*) FROM delaywheel.%I s'
                       ' LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level'
                       ' WHERE (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) IS NOT FALSE',
                       partition_name) INTO n;
        IF n > 0 THEN
            RETURN format('it holds %s segments of messages that their level''s deliverer has not passed', n);
        END IF;
    ELSIF parent_name = 'wheel' THEN
        EXECUTE format('SELECT count(*) FROM delaywheel.%I q LEFT JOIN delaywheel.wheel_state s ON true'
                       ' WHERE ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)'
                       ' IS NOT FALSE', partition_name) INTO n;
        IF n > 0 THEN
            RETURN format('it holds %s timers that the wheel''s cursor has not passed', n);
        END IF;
    ELSIF parent_name = 'wheel_far_segments' THEN
        -- the roll copies a block's last messages into the near wheel, then drops it in the same transaction
        EXECUTE format('SELECT count(*) FROM delaywheel.%I s, unnest(s.ids, s.deliver_ats) AS m(id, due)'
                       ' WHERE NOT EXISTS (SELECT 1 FROM delaywheel.wheel w'
                       '                   WHERE w.id = m.id AND w.deliver_at = m.due AT TIME ZONE ''UTC'')'
                       '   AND NOT EXISTS (SELECT 1 FROM delaywheel.set_aside x WHERE x.message_id = m.id)',
                       partition_name) INTO n;
        IF n > 0 THEN
            RETURN format('it holds %s far timers that the roll has not moved into the near wheel', n);
        END IF;
    ELSIF parent_name = 'cancellations' THEN
        -- a cancellation is keyed by its message's due time: it is needed while any message due before the
        -- partition's end is pending (retire's rule)
        IF EXISTS (SELECT 1 FROM delaywheel.level_segments s
                   LEFT JOIN delaywheel.level_checkpoint c ON c.level = s.level
                   WHERE s.deliver_at < upper_bound
                     AND (c.level IS NULL OR (s.xid, s.id_last) > (c.cursor_xid, c.cursor_id)) IS NOT FALSE)
           OR EXISTS (SELECT 1 FROM delaywheel.wheel q LEFT JOIN delaywheel.wheel_state s ON true
                      WHERE q.deliver_at < upper_bound
                        AND ((q.deliver_at, q.id) > (s.cursor_at, s.cursor_id) OR q.xid >= s.horizon_xid)
                            IS NOT FALSE)
           OR EXISTS (SELECT 1 FROM delaywheel.wheel_far_segments f WHERE f.block < upper_bound) THEN
            RETURN format('messages due before %s are still pending, and its cancellations may be theirs', upper_bound);
        END IF;
    ELSIF parent_name = 'topic_messages' THEN
        SELECT r.topic_messages INTO unread_floor FROM delaywheel.retention_floor r;
        IF upper_bound <= clock_timestamp() - unread_floor THEN
            RETURN NULL;  -- past the retention floor: goes, read or not
        END IF;
        -- a group that has not read a row of its topic here
        SELECT u.grp || ' on ' || u.topic INTO found FROM delaywheel.partition_unread(partition_name, 1) u LIMIT 1;
        IF found IS NOT NULL THEN
            RETURN format('consumer group %s has not read all of its rows', found);
        END IF;
        -- a topic no group reads yet: a new group starts at its first row (each topic once, by the read index)
        EXECUTE format('WITH RECURSIVE t(topic) AS ('
                       '    (SELECT p.topic FROM delaywheel.%1$I p ORDER BY p.topic LIMIT 1)'
                       '    UNION ALL'
                       '    SELECT (SELECT p.topic FROM delaywheel.%1$I p WHERE p.topic > t.topic ORDER BY p.topic LIMIT 1)'
                       '    FROM t WHERE t.topic IS NOT NULL)'
                       ' SELECT t.topic FROM t WHERE t.topic IS NOT NULL AND NOT EXISTS ('
                       '    SELECT 1 FROM delaywheel.consumer_offsets o WHERE o.topic = t.topic) LIMIT 1',
                       partition_name) INTO found;
        IF found IS NOT NULL THEN
            RETURN format('no consumer group has read topic %s, and it is within the retention floor (%s)',
                          quote_literal(found), unread_floor);
        END IF;
    END IF;
    RETURN NULL;
END $$;

-- Takes ACCESS EXCLUSIVE on the partition of a parent starting at lower_bound, until the caller's transaction ends;
-- false if there is no such partition. NOWAIT and lock_timeout raise lock_not_available (55P03), as LOCK TABLE does.
-- A whole parent (lower_bound NULL) only for the roll: the wheel's two parents, by the session holding the wheel lane's
-- lock (a runtime that holds it stops the wheel lane already).
CREATE OR REPLACE FUNCTION delaywheel.lock_partition(parent_name text, lower_bound timestamptz DEFAULT NULL,
                                          nowait boolean DEFAULT false)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target text;
BEGIN
    IF delaywheel.partition_width(parent_name) IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of the store', quote_literal(parent_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lower_bound IS NULL THEN
        IF parent_name NOT IN ('wheel', 'wheel_far_segments') OR NOT EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks l
            WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted AND l.mode = 'ExclusiveLock'
              AND l.classid = 1685520416 AND l.objid = 0 AND l.objsubid = 2) THEN  -- locks.WHEEL_LOCK
            RAISE EXCEPTION 'lock_partition(%, NULL): a partition is named by its lower bound, not NULL',
                            quote_literal(parent_name)
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'only the wheel''s roll, holding the wheel lane''s lock, locks the parents wheel and '
                             'wheel_far_segments whole';
        END IF;
        target := parent_name;
    ELSE
        target := delaywheel.partition_named(parent_name, lower_bound);
    END IF;
    IF target IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('LOCK TABLE delaywheel.%I IN ACCESS EXCLUSIVE MODE', target) || CASE WHEN nowait THEN ' NOWAIT' ELSE '' END;
    RETURN true;
END $$;

-- Drops the partition of a parent starting at lower_bound once it is drained (partition_undrained: retire's and the
-- roll's rules); false if there is none. Never a parent, never any other table. It locks the partition first (the
-- caller's lock_timeout applies), so that nothing is written into it between the check and the drop. A topic partition
-- past the retention floor goes with rows groups have not read: those are counted per group and topic into
-- retired_unread first, in the dropping transaction, so no drop loses unread rows uncounted.
CREATE OR REPLACE FUNCTION delaywheel.drop_partition(parent_name text, lower_bound timestamptz)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target text;
    upper_bound timestamptz;
    reason text;
BEGIN
    IF lower_bound IS NULL THEN
        RAISE EXCEPTION 'drop_partition(%, NULL): a partition is named by its lower bound, not NULL',
                        quote_literal(parent_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    target := delaywheel.partition_named(parent_name, lower_bound);
    IF target IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('LOCK TABLE delaywheel.%I IN ACCESS EXCLUSIVE MODE', target);
    SELECT p.hi INTO upper_bound FROM delaywheel.partitions p WHERE p.parent = parent_name AND p.name = target;
    reason := delaywheel.partition_undrained(parent_name, target, lower_bound, upper_bound);
    IF reason IS NOT NULL THEN
        RAISE EXCEPTION 'partition % of % is not drained: %', target, parent_name, reason
            USING ERRCODE = 'object_in_use',
                  HINT = 'only a drained partition is dropped: retire leaves this one for a later run, once its '
                         'messages are delivered, its cancellations unneeded and its topic rows read or past '
                         'delaywheel.retention_floor';
    END IF;
    IF parent_name = 'topic_messages' THEN
        INSERT INTO delaywheel.retired_unread AS r (grp, topic, dropped, partitions, first_dropped_at, last_dropped_at,
                                                    last_dropped, last_partition, last_drop_xid)
        SELECT u.grp, u.topic, u.unread, 1, c.at, c.at, u.unread, target, pg_current_xact_id()
        FROM delaywheel.partition_unread(target) u, (SELECT clock_timestamp() AS at) c
        ON CONFLICT (grp, topic) DO UPDATE
        SET dropped = r.dropped + excluded.dropped, partitions = r.partitions + 1,
            last_dropped_at = excluded.last_dropped_at, last_dropped = excluded.last_dropped,
            last_partition = excluded.last_partition, last_drop_xid = excluded.last_drop_xid;
    END IF;
    EXECUTE format('DROP TABLE delaywheel.%I', target);
    RETURN true;
END $$;

-- brin_summarize_new_values needs the table's owner (PostgreSQL 17: MAINTAIN); the store's BRIN indexes only.
CREATE OR REPLACE FUNCTION delaywheel.summarize_brin(brin_index regclass) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_class c
                   JOIN pg_am a ON a.oid = c.relam AND a.amname = 'brin'
                   JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'delaywheel'
                   WHERE c.oid = brin_index AND c.relkind = 'i') THEN
        RAISE EXCEPTION '% is not a BRIN index of the store', brin_index USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN brin_summarize_new_values(brin_index);
END $$;
