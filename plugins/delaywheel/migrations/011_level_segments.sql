-- Level queues as segments, and message ids handed out in blocks (store, issue 2).
--
-- A level queue row cost a send more than the message itself: the FIFO B-tree (level, xid, id) and the BRIN
-- summaries added 2.7 µs to the 1.6 µs of a plain COPY row (bench/RESULTS.md, store), so send_many could not
-- come near a raw COPY whatever the client did. Every message a producer hands over in one call for one level
-- shares that call's transaction, clock reading and delay, hence its xid and due time: RocketMQ's queue
-- entries of one batch. So a call writes one row per level (up to 1,000 messages: a *segment*), its messages
-- as arrays in send order; the FIFO index, the partition routing and the row header are paid once per segment.
-- The arrays are stored out of line and uncompressed (STORAGE EXTERNAL): compressing them cost more per
-- message than the whole row (pglz, and lz4 too) for bodies that are mostly small.
--
-- Queue order is unchanged: (xid, id) over the messages, i.e. segments in (xid, id_last) order (the segments
-- one transaction writes for a level hold ascending, disjoint id ranges) and, within one, the ids in order.
-- The level checkpoint keeps the (xid, id) of the last message passed, which may sit inside a segment.
-- `delaywheel.level_queue` becomes a view with the old row per message, for everything that reads messages
-- rather than delivers them (cancel by predicate, quality checks, stats, tests).

CREATE TABLE delaywheel.level_segments (
    id_first        bigint      NOT NULL,          -- ids[1]
    id_last         bigint      NOT NULL,          -- ids[n]: segments are read in (xid, id_last) order
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    level           smallint    NOT NULL CHECK (level >= 1),
    requested_level integer     NOT NULL,          -- differs from level when clamped to the maximum
    reconsume_times integer     NOT NULL,          -- > 0 for consumer retries (%RETRY%<group>)
    deliver_at      timestamptz NOT NULL,          -- fixed at enqueue, for every message of the segment
    enqueued_at     timestamptz NOT NULL,
    n               integer     NOT NULL,          -- messages in the segment (backlogs count without reading arrays)
    ids             bigint[]    NOT NULL,          -- ascending
    -- topics, tags, properties and is_json hold one element when every message of the segment has the same
    -- (the usual batch: one topic, no properties), read through delaywheel.spread: storing 1,000 copies cost
    -- the server a quarter of its time per message
    topics          text[]      NOT NULL,
    keys            text[]      NOT NULL,          -- NULL elements: no key
    tags            text[]      NOT NULL,
    properties      text[]      NOT NULL,          -- JSON objects as text, read as jsonb (NULL elements: none)
    bodies          bytea[]     NOT NULL,
    is_json         boolean[]   NOT NULL,
    key_bloom       bytea,                         -- Bloom filter of keys (keyblooms.py); NULL: read the keys
    CHECK (n >= 1 AND id_first = ids[1] AND id_last = ids[n] AND cardinality(ids) = n
           AND cardinality(keys) = n AND cardinality(bodies) = n AND cardinality(topics) IN (1, n)
           AND cardinality(tags) IN (1, n) AND cardinality(properties) IN (1, n) AND cardinality(is_json) IN (1, n))
) PARTITION BY RANGE (enqueued_at);
ALTER TABLE delaywheel.level_segments
    ALTER COLUMN ids SET STORAGE EXTERNAL, ALTER COLUMN topics SET STORAGE EXTERNAL,
    ALTER COLUMN keys SET STORAGE EXTERNAL, ALTER COLUMN tags SET STORAGE EXTERNAL,
    ALTER COLUMN properties SET STORAGE EXTERNAL, ALTER COLUMN bodies SET STORAGE EXTERNAL,
    ALTER COLUMN is_json SET STORAGE EXTERNAL, ALTER COLUMN key_bloom SET STORAGE EXTERNAL;
CREATE INDEX level_segments_fifo ON delaywheel.level_segments (level, xid, id_last);
-- cancel by id: the segment whose id range holds the message (ranges of concurrent segments overlap)
CREATE INDEX level_segments_ids ON delaywheel.level_segments USING gist (int8range(id_first, id_last, '[]'));

-- Pending messages move over as segments of one, keeping their xid: the checkpoints compare against it.
DO $$
DECLARE hour timestamptz;
BEGIN
    FOR hour IN SELECT DISTINCT date_trunc('hour', enqueued_at) FROM delaywheel.level_queue LOOP
        PERFORM delaywheel.ensure_partition('level_segments', hour, hour + interval '1 hour');
    END LOOP;
END $$;
INSERT INTO delaywheel.level_segments
    (id_first, id_last, xid, level, requested_level, reconsume_times, deliver_at, enqueued_at,
     n, ids, topics, keys, tags, properties, bodies, is_json)
SELECT id, id, xid, level, requested_level, reconsume_times, deliver_at, enqueued_at, 1,
       ARRAY[id], ARRAY[topic], ARRAY[key], ARRAY[tags], ARRAY[properties::text], ARRAY[body], ARRAY[is_json]
FROM delaywheel.level_queue;
DROP TABLE delaywheel.level_queue;

-- A segment's array with one element per message: a one-element array stands for that value n times.
CREATE FUNCTION delaywheel.spread(items anyarray, n integer) RETURNS anyarray
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT CASE WHEN cardinality(items) = 1 AND n > 1 THEN array_fill(items[1], ARRAY[n]) ELSE items END $$;

-- May a segment hold a key with hashes (h1, h2)? Bits (h1 + i * h2) mod m, i < 4, of its filter (keyblooms.py
-- computes the hashes, for a send's keys and a looked-up key alike). A segment without a filter may hold any key.
CREATE FUNCTION delaywheel.bloom_may_hold(bloom bytea, h1 bigint, h2 bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT bloom IS NULL OR (
        get_bit(bloom, (h1 % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + h2) % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + 2 * h2) % (8 * octet_length(bloom)))::int) = 1
        AND get_bit(bloom, ((h1 + 3 * h2) % (8 * octet_length(bloom)))::int) = 1)
$$;

CREATE VIEW delaywheel.level_queue AS
SELECT m.id, s.xid, s.level, s.requested_level, m.topic, m.key, m.tags, m.properties::jsonb AS properties,
       m.body, m.is_json,
       s.reconsume_times, s.deliver_at, s.enqueued_at
FROM delaywheel.level_segments s,
     unnest(s.ids, delaywheel.spread(s.topics, s.n), s.keys, delaywheel.spread(s.tags, s.n),
            delaywheel.spread(s.properties, s.n), s.bodies, delaywheel.spread(s.is_json, s.n))
         AS m(id, topic, key, tags, properties, body, is_json);

-- Ids in blocks of 65,536: a call takes one nextval per block instead of one per message (0.6 µs of a
-- send_many's budget), and numbers its messages within it. Ids stay unique and ascending per session; they
-- are no longer dense. New blocks start above every id handed out so far.
DO $$
DECLARE next_id bigint;
BEGIN
    -- last_value covers the values sessions hold in their caches too
    SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END INTO next_id FROM delaywheel.message_id_seq;
    EXECUTE format('ALTER SEQUENCE delaywheel.message_id_seq INCREMENT BY 65536 RESTART WITH %s', next_id);
END $$;
