-- Views over the store's tables (installed after the functions: level_queue and wheel_far unpack segments with
-- spread). Their grants are explicit: wheel_state is read and updated, never inserted into.

-- Partitions of a parent with their bounds, for retirement and stats.
CREATE OR REPLACE VIEW delaywheel.partitions AS
SELECT parent.relname AS parent, child.relname AS name,
       (regexp_match(pg_get_expr(child.relpartbound, child.oid), 'FROM \(''(.*)''\) TO'))[1]::timestamptz AS lo,
       (regexp_match(pg_get_expr(child.relpartbound, child.oid), 'TO \(''(.*)''\)'))[1]::timestamptz AS hi
FROM pg_inherits i
JOIN pg_class parent ON parent.oid = i.inhparent
JOIN pg_class child ON child.oid = i.inhrelid
JOIN pg_namespace n ON n.oid = parent.relnamespace
WHERE n.nspname = 'delaywheel';

-- A level queue's messages, one row each, unpacked from its segments.
CREATE OR REPLACE VIEW delaywheel.level_queue AS
SELECT m.id, s.xid, s.level, s.requested_level, m.topic, m.key, m.tags, m.properties::jsonb AS properties,
       m.body, m.is_json,
       s.reconsume_times, s.deliver_at, s.enqueued_at
FROM delaywheel.level_segments s,
     unnest(s.ids, delaywheel.spread(s.topics, s.n), s.keys, delaywheel.spread(s.tags, s.n),
            delaywheel.spread(s.properties, s.n), s.bodies, delaywheel.spread(s.is_json, s.n))
         AS m(id, topic, key, tags, properties, body, is_json);

-- The far blocks' messages, one row each, unpacked from their segments.
CREATE OR REPLACE VIEW delaywheel.wheel_far AS
SELECT m.id, s.xid, m.topic, m.key, m.tags, m.properties::jsonb AS properties, m.body, m.is_json,
       m.due AT TIME ZONE 'UTC' AS deliver_at, s.enqueued_at, s.block
FROM delaywheel.wheel_far_segments s,
     unnest(s.ids, delaywheel.spread(s.topics, s.n), s.keys, delaywheel.spread(s.tags, s.n),
            delaywheel.spread(s.properties, s.n), s.bodies, delaywheel.spread(s.is_json, s.n), s.deliver_ats)
         AS m(id, topic, key, tags, properties, body, is_json, due);

-- Bulk enqueue's claims by source name: which message a source's key became.
CREATE OR REPLACE VIEW delaywheel.idempotency AS
    SELECT s.source, c.key, c.message_id, c.claimed_at
    FROM delaywheel.bulk_claims c JOIN delaywheel.bulk_sources s ON s.id = c.source_id;

-- The wheel's roll state and its cursor, as one row. The cursor's columns are scalar subqueries (one bounded
-- index read each, all from the statement's one snapshot), not a join: a row lock taken through the view (producers'
-- FOR KEY SHARE, a test's FOR UPDATE) then locks `wheel_roll`'s row only, never a cursor entry.
CREATE OR REPLACE VIEW delaywheel.wheel_state AS
SELECT r.singleton, (r.c).cursor_at, (r.c).cursor_id, (r.c).horizon_xid, r.near_until, (r.c).delivered,
       (r.c).updated_at
FROM (SELECT w.singleton, w.near_until,
             (SELECT c FROM delaywheel.wheel_cursor c ORDER BY c.pass DESC LIMIT 1) AS c
      FROM delaywheel.wheel_roll w) r;

REVOKE ALL ON delaywheel.partitions, delaywheel.level_queue, delaywheel.wheel_far, delaywheel.idempotency,
    delaywheel.wheel_state FROM delaywheel_runtime;
GRANT SELECT, INSERT, UPDATE ON delaywheel.partitions, delaywheel.level_queue, delaywheel.wheel_far,
    delaywheel.idempotency TO delaywheel_runtime;
GRANT SELECT, UPDATE ON delaywheel.wheel_state TO delaywheel_runtime;
