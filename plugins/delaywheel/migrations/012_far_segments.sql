-- Far blocks as segments (timing wheel, issue 3), as the level queues in sql/011.
--
-- Most random due times up to 30 days land in a far block, and a far row cost the server about 6 µs: routed to one
-- of ~27 daily partitions, each row paid two BRIN insert calls (a metapage and a revmap lookup each) on top of
-- the 2 µs of a plain row. A far block is written by producers, read whole once by the roll and otherwise only
-- searched by cancel, so nothing needs its messages as rows: a call writes one row per far day (up to 1,000
-- messages), its messages as arrays in send order, due times included (as UTC `timestamp`: binary COPY of a
-- `timestamptz[]` needs that element type, which the encoder does not write). Cancel finds a segment by its id
-- range (GiST) or by its keys' Bloom filter (sql/011); the roll unnests a block into the near wheel.
-- `delaywheel.wheel_far` becomes a view with the old row per message.

CREATE TABLE delaywheel.wheel_far_segments (
    id_first    bigint      NOT NULL,          -- ids[1]
    id_last     bigint      NOT NULL,          -- ids[n]
    xid         xid8        NOT NULL DEFAULT pg_current_xact_id(),
    block       timestamptz NOT NULL,          -- the far day every message of the segment is due in
    enqueued_at timestamptz NOT NULL,
    n           integer     NOT NULL,
    ids         bigint[]    NOT NULL,
    deliver_ats timestamp[] NOT NULL,          -- UTC
    keys        text[]      NOT NULL,
    bodies      bytea[]     NOT NULL,
    -- one element when the same for every message (delaywheel.spread, sql/011)
    topics      text[]      NOT NULL,
    tags        text[]      NOT NULL,
    properties  text[]      NOT NULL,          -- JSON objects as text
    is_json     boolean[]   NOT NULL,
    key_bloom   bytea,                         -- Bloom filter of keys (sql/011); NULL: read the keys
    CHECK (n >= 1 AND id_first = ids[1] AND id_last = ids[n] AND cardinality(ids) = n
           AND cardinality(deliver_ats) = n AND cardinality(keys) = n AND cardinality(bodies) = n
           AND cardinality(topics) IN (1, n) AND cardinality(tags) IN (1, n)
           AND cardinality(properties) IN (1, n) AND cardinality(is_json) IN (1, n))
) PARTITION BY RANGE (block);
ALTER TABLE delaywheel.wheel_far_segments
    ALTER COLUMN ids SET STORAGE EXTERNAL, ALTER COLUMN deliver_ats SET STORAGE EXTERNAL,
    ALTER COLUMN keys SET STORAGE EXTERNAL, ALTER COLUMN bodies SET STORAGE EXTERNAL,
    ALTER COLUMN topics SET STORAGE EXTERNAL, ALTER COLUMN tags SET STORAGE EXTERNAL,
    ALTER COLUMN properties SET STORAGE EXTERNAL, ALTER COLUMN is_json SET STORAGE EXTERNAL,
    ALTER COLUMN key_bloom SET STORAGE EXTERNAL;
CREATE INDEX wheel_far_segments_ids ON delaywheel.wheel_far_segments USING gist (int8range(id_first, id_last, '[]'));

-- Pending far rows move over as segments of one, keeping their xid.
DO $$
DECLARE day timestamptz;
BEGIN
    FOR day IN SELECT DISTINCT lo FROM delaywheel.partitions WHERE parent = 'wheel_far' LOOP
        PERFORM delaywheel.ensure_partition('wheel_far_segments', day, day + interval '1 day');
    END LOOP;
END $$;
INSERT INTO delaywheel.wheel_far_segments
    (id_first, id_last, xid, block, enqueued_at, n, ids, deliver_ats, keys, bodies, topics, tags, properties, is_json)
SELECT f.id, f.id, f.xid, p.lo, f.enqueued_at, 1, ARRAY[f.id], ARRAY[f.deliver_at AT TIME ZONE 'UTC'], ARRAY[f.key],
       ARRAY[f.body], ARRAY[f.topic], ARRAY[f.tags], ARRAY[f.properties::text], ARRAY[f.is_json]
FROM delaywheel.wheel_far f
JOIN delaywheel.partitions p ON p.parent = 'wheel_far' AND f.deliver_at >= p.lo AND f.deliver_at < p.hi;
DROP TABLE delaywheel.wheel_far;

CREATE VIEW delaywheel.wheel_far AS
SELECT m.id, s.xid, m.topic, m.key, m.tags, m.properties::jsonb AS properties, m.body, m.is_json,
       m.due AT TIME ZONE 'UTC' AS deliver_at, s.enqueued_at, s.block
FROM delaywheel.wheel_far_segments s,
     unnest(s.ids, delaywheel.spread(s.topics, s.n), s.keys, delaywheel.spread(s.tags, s.n),
            delaywheel.spread(s.properties, s.n), s.bodies, delaywheel.spread(s.is_json, s.n), s.deliver_ats)
         AS m(id, topic, key, tags, properties, body, is_json, due);
