-- The runtime's partition helpers (017) drop only what is drained, and lock a whole parent only for the roll.
--
-- They took a parent from the fixed list and a time bound and did what they were asked: as the runtime login,
-- `drop_partition('level_segments', <hour>)` dropped 100 pending messages, and the same went for a far block, a day
-- of cancellations still needed and a day of topic rows no group had read; `lock_partition(parent)` (bound NULL) held
-- a whole parent ACCESS EXCLUSIVE, every lane and consumer waiting behind it. Now `drop_partition` locks the partition,
-- asks `partition_undrained` why it may not go, and raises object_in_use with that reason if there is one: a level
-- segment or near-wheel row its lane's cursor has not passed, a far message the roll has not moved into the near
-- wheel (nor set aside), a cancellation a pending message due before the partition's end may still need, a topic row
-- some consumer group has not read (or of a topic no group reads yet). These are the rules `retire` and the roll
-- already follow, checked again where the runtime cannot skip them. A NULL bound is refused by both helpers, except
-- the roll's own lock of the wheel's two parents, taken while it holds the wheel lane's lock (locks.WHEEL_LOCK).
--
-- Topic rows go by retention whether read or not (`topic_retention`, a setting of each process, which the database
-- does not know). So the database keeps its own floor, `retention_floor`, which only the owner may change: a topic
-- partition that ended at least that long ago (by the database's clock) may go unread; a younger one only once every
-- group of every topic in it has read it.

CREATE TABLE delaywheel.retention_floor (
    singleton      boolean  PRIMARY KEY DEFAULT true CHECK (singleton),
    -- how long ago a topic partition must have ended for it to be dropped with rows a group has not read; in hours
    -- (not days, whose length depends on the session's time zone). As the owner, set it to `topic_retention` when
    -- that is shorter than 7 days (docs/operations.md, "Roles").
    topic_messages interval NOT NULL DEFAULT interval '168 hours' CHECK (topic_messages >= interval '0')
);
INSERT INTO delaywheel.retention_floor DEFAULT VALUES;
REVOKE INSERT, UPDATE ON delaywheel.retention_floor FROM delaywheel_runtime;

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
        -- a group that has not read a row of its topic here (by the topic's read index, from the group's offset)
        EXECUTE format('SELECT o.grp || '' on '' || o.topic FROM delaywheel.consumer_offsets o'
                       ' WHERE EXISTS (SELECT 1 FROM delaywheel.%I t WHERE t.topic = o.topic'
                       '               AND (t.xid, t.queue_offset) > (o.cursor_xid, o.cursor_offset))'
                       ' LIMIT 1', partition_name) INTO found;
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
-- caller's lock_timeout applies), so that nothing is written into it between the check and the drop.
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
    EXECUTE format('DROP TABLE delaywheel.%I', target);
    RETURN true;
END $$;
