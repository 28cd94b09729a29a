-- Least privilege (DESIGN.md "Roles"): the schema belongs to `delaywheel_owner`, which runs the migrations; the
-- store runs as `delaywheel_runtime`, which holds no DDL privilege at all. Both are group roles (NOLOGIN): the
-- grants below name them, and each deployment gives its own login roles membership (the embedded cluster:
-- `delaywheel_migrator` and `delaywheel_app`; docker-compose likewise).
--
-- The runtime does partition maintenance on its hot path (producers and deliverers create partitions, the wheel's
-- roll and `retire` lock and drop them). That DDL goes through the SECURITY DEFINER functions below, owned by the
-- owner, with a pinned search_path, taking a parent from a fixed list and a time bound: never a table name. They
-- are the only way the runtime reaches DDL. `migrate` runs this file as `delaywheel_owner` (SET ROLE), so
-- everything here, and every partition these functions create, is owned by it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'delaywheel_owner')
       OR NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'delaywheel_runtime') THEN
        RAISE EXCEPTION 'the roles delaywheel_owner and delaywheel_runtime do not exist, and this role may not create them'
            USING HINT = 'as a superuser: CREATE ROLE delaywheel_owner NOLOGIN; CREATE ROLE delaywheel_runtime NOLOGIN; '
                         'GRANT delaywheel_owner TO <the role running migrate>; GRANT CREATE ON DATABASE <db> TO '
                         'delaywheel_owner; then run migrate again (README, "Roles")';
    END IF;
END $$;

-- The partitioned parents of the store and their partition widths; NULL for anything else. Hours are absolute:
-- '24 hours', not '1 day', whose length depends on the session's time zone.
CREATE OR REPLACE FUNCTION delaywheel.partition_width(parent_name text) RETURNS interval
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE parent_name
        WHEN 'level_segments' THEN interval '1 hour'
        WHEN 'wheel' THEN interval '1 hour'
        WHEN 'wheel_far_segments' THEN interval '24 hours'
        WHEN 'topic_messages' THEN interval '24 hours'
        WHEN 'cancellations' THEN interval '24 hours'
    END
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

-- Creates the partition of `parent` covering [lo, hi) if it does not exist (serialised per parent). Only the
-- store's parents, and only a whole aligned hour or day (UTC), as `partitions.PartitionCache` asks for.
CREATE OR REPLACE FUNCTION delaywheel.ensure_partition(parent text, lo timestamptz, hi timestamptz)
RETURNS text LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    width interval := delaywheel.partition_width(parent);
    name text;
BEGIN
    IF width IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of the store', quote_literal(parent)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF lo IS NULL OR NOT isfinite(lo) OR hi IS DISTINCT FROM lo + width
       OR lo <> date_trunc(CASE WHEN width = interval '1 hour' THEN 'hour' ELSE 'day' END, lo AT TIME ZONE 'UTC')
                AT TIME ZONE 'UTC' THEN
        RAISE EXCEPTION 'a partition of % covers one whole % (UTC), not [%, %)', parent, width, lo, hi
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    name := parent || '_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI');
    IF to_regclass(format('delaywheel.%I', name)) IS NULL THEN
        PERFORM pg_advisory_xact_lock(hashtext('delaywheel.partition.' || parent));
        IF to_regclass(format('delaywheel.%I', name)) IS NULL THEN
            EXECUTE format('CREATE TABLE delaywheel.%I PARTITION OF delaywheel.%I FOR VALUES FROM (%L) TO (%L)',
                           name, parent, lo, hi);
            -- Rows go in and out through the parent, whose grants are the ones checked; the store names a
            -- partition itself only to read it (the roll, retire), so that is all it may do to one.
            EXECUTE format('GRANT SELECT ON delaywheel.%I TO delaywheel_runtime', name);
        END IF;
    END IF;
    RETURN name;
END $$;

-- Takes ACCESS EXCLUSIVE on a parent (lower_bound NULL: the whole table) or on its partition starting at
-- lower_bound, until the caller's transaction ends; false if there is no such partition. NOWAIT and lock_timeout
-- raise lock_not_available (55P03), as LOCK TABLE does.
CREATE OR REPLACE FUNCTION delaywheel.lock_partition(parent_name text, lower_bound timestamptz DEFAULT NULL,
                                          nowait boolean DEFAULT false)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target text := CASE WHEN lower_bound IS NULL THEN parent_name
                        ELSE delaywheel.partition_named(parent_name, lower_bound) END;
BEGIN
    IF delaywheel.partition_width(parent_name) IS NULL THEN
        RAISE EXCEPTION '% is not a partitioned table of the store', quote_literal(parent_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF target IS NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('LOCK TABLE delaywheel.%I IN ACCESS EXCLUSIVE MODE', target) || CASE WHEN nowait THEN ' NOWAIT' ELSE '' END;
    RETURN true;
END $$;

-- Drops the partition of a parent starting at lower_bound (retire: drained; the roll: moved to the near wheel);
-- false if there is none. Never a parent, never any other table.
CREATE OR REPLACE FUNCTION delaywheel.drop_partition(parent_name text, lower_bound timestamptz)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target text := delaywheel.partition_named(parent_name, lower_bound);
BEGIN
    IF target IS NULL THEN
        RETURN false;
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

-- What the runtime may do: use the schema (no CREATE), read and write rows (no DELETE: nothing is deleted row by
-- row; no TRUNCATE, REFERENCES or TRIGGER), draw ids, call the functions. Nothing else: the functions above are its
-- only way to DDL.
REVOKE ALL ON SCHEMA delaywheel FROM PUBLIC;
GRANT USAGE ON SCHEMA delaywheel TO delaywheel_runtime;
GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA delaywheel TO delaywheel_runtime;
REVOKE INSERT, UPDATE ON delaywheel.schema_migrations FROM delaywheel_runtime;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA delaywheel TO delaywheel_runtime;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA delaywheel FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA delaywheel TO delaywheel_runtime;
-- ... and on whatever later migrations and the functions above create (objects of the role running this file).
ALTER DEFAULT PRIVILEGES IN SCHEMA delaywheel GRANT SELECT, INSERT, UPDATE ON TABLES TO delaywheel_runtime;
ALTER DEFAULT PRIVILEGES IN SCHEMA delaywheel GRANT USAGE, SELECT ON SEQUENCES TO delaywheel_runtime;
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
ALTER DEFAULT PRIVILEGES IN SCHEMA delaywheel GRANT EXECUTE ON FUNCTIONS TO delaywheel_runtime;

-- The example application's schema (sql/006): its tables are the application's own, which the demo resets
-- (TRUNCATE) and the sweep updates.
DO $$
BEGIN
    IF to_regnamespace('shop') IS NOT NULL THEN
        GRANT USAGE ON SCHEMA shop TO delaywheel_runtime;
        GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA shop TO delaywheel_runtime;
        GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA shop TO delaywheel_runtime;
        ALTER DEFAULT PRIVILEGES IN SCHEMA shop GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES
            TO delaywheel_runtime;
        ALTER DEFAULT PRIVILEGES IN SCHEMA shop GRANT USAGE, SELECT ON SEQUENCES TO delaywheel_runtime;
    END IF;
END $$;
