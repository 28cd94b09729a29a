-- The delay-level store (RocketMQ 4.x): level queues, topics, consumer offsets, cancellations.
--
-- Every queue row carries xid = the id of the transaction that wrote it. PostgreSQL commits out of
-- sequence order, so readers order rows by (xid, id) and only read rows whose xid is below the oldest
-- transaction still running (pg_snapshot_xmin): that set only ever grows at its end, so a cursor in
-- (xid, id) order never passes a row that could still appear (PgQ's approach, DESIGN.md §5).
--
-- Hot tables are partitioned by time and retired by DROP of whole partitions, never by row DELETE.

CREATE SEQUENCE delaywheel.message_id_seq AS bigint CACHE 100;
CREATE SEQUENCE delaywheel.topic_offset_seq AS bigint CACHE 100;

-- RocketMQ's SCHEDULE_TOPIC_XXXX: one FIFO queue per level (queue id = level - 1), in one table.
CREATE TABLE delaywheel.level_queue (
    id              bigint      NOT NULL,
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    level           smallint    NOT NULL CHECK (level >= 1),
    requested_level integer     NOT NULL,          -- differs from level when clamped to the maximum
    topic           text        NOT NULL,
    key             text,
    tags            text,
    properties      jsonb,
    body            bytea       NOT NULL,
    is_json         boolean     NOT NULL,
    reconsume_times integer     NOT NULL DEFAULT 0, -- > 0 for consumer retries (%RETRY%<group>)
    deliver_at      timestamptz NOT NULL,          -- fixed at enqueue: changing the level table later
    enqueued_at     timestamptz NOT NULL           -- does not move a pending message
) PARTITION BY RANGE (enqueued_at);
CREATE INDEX level_queue_fifo ON delaywheel.level_queue (level, xid, id);
CREATE INDEX level_queue_id ON delaywheel.level_queue (id);
CREATE INDEX level_queue_key ON delaywheel.level_queue (key) WHERE key IS NOT NULL;

-- offsetTable / delayOffset.json: one cursor per level, advanced in the delivering transaction.
CREATE TABLE delaywheel.level_checkpoint (
    level       smallint    PRIMARY KEY,
    cursor_xid  xid8        NOT NULL DEFAULT '0',
    cursor_id   bigint      NOT NULL DEFAULT 0,
    delivered   bigint      NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
) WITH (fillfactor = 20);  -- tiny, updated every pass: leave room for HOT updates

-- Delivered messages, in delivery order per topic: (xid, queue_offset).
CREATE TABLE delaywheel.topic_messages (
    topic           text        NOT NULL,
    queue_offset    bigint      NOT NULL DEFAULT nextval('delaywheel.topic_offset_seq'),
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    message_id      bigint      NOT NULL,
    origin          text        NOT NULL,          -- level | wheel | direct | replay
    level           smallint,
    key             text,
    tags            text,
    properties      jsonb,
    body            bytea       NOT NULL,
    is_json         boolean     NOT NULL,
    reconsume_times integer     NOT NULL DEFAULT 0,
    deliver_at      timestamptz NOT NULL,          -- due time
    delivered_at    timestamptz NOT NULL           -- when it became visible: lateness = delivered_at - deliver_at
) PARTITION BY RANGE (delivered_at);
CREATE INDEX topic_messages_read ON delaywheel.topic_messages (topic, xid, queue_offset);
CREATE INDEX topic_messages_message ON delaywheel.topic_messages (message_id);

-- Consumer-group offsets per topic, in the same (xid, queue_offset) order.
CREATE TABLE delaywheel.consumer_offsets (
    grp            text        NOT NULL,
    topic          text        NOT NULL,
    cursor_xid     xid8        NOT NULL DEFAULT '0',
    cursor_offset  bigint      NOT NULL DEFAULT 0,
    acked          bigint      NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (grp, topic)
);

-- A cancelled message stays in its queue; deliverers skip it. Partitioned by the message's due day,
-- so a day's cancellations are dropped together once every message due that day is gone.
CREATE TABLE delaywheel.cancellations (
    message_id    bigint      NOT NULL,
    due_at        timestamptz NOT NULL,
    key           text,
    reason        text        NOT NULL,
    cancelled_at  timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY RANGE (due_at);
CREATE INDEX cancellations_message ON delaywheel.cancellations (message_id);

-- Creates the partition of `parent` covering [lo, hi) if it does not exist. Serialised per parent
-- so two sessions creating the same partition do not collide.
CREATE FUNCTION delaywheel.ensure_partition(parent text, lo timestamptz, hi timestamptz)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    name text := parent || '_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MI');
BEGIN
    IF to_regclass('delaywheel.' || name) IS NULL THEN
        PERFORM pg_advisory_xact_lock(hashtext('delaywheel.partition.' || parent));
        IF to_regclass('delaywheel.' || name) IS NULL THEN
            EXECUTE format('CREATE TABLE delaywheel.%I PARTITION OF delaywheel.%I FOR VALUES FROM (%L) TO (%L)',
                           name, parent, lo, hi);
        END IF;
    END IF;
    RETURN name;
END $$;

-- Partitions of a parent with their bounds, for retirement and stats.
CREATE VIEW delaywheel.partitions AS
SELECT parent.relname AS parent, child.relname AS name,
       (regexp_match(pg_get_expr(child.relpartbound, child.oid), 'FROM \(''(.*)''\) TO'))[1]::timestamptz AS lo,
       (regexp_match(pg_get_expr(child.relpartbound, child.oid), 'TO \(''(.*)''\)'))[1]::timestamptz AS hi
FROM pg_inherits i
JOIN pg_class parent ON parent.oid = i.inhparent
JOIN pg_class child ON child.oid = i.inhrelid
JOIN pg_namespace n ON n.oid = parent.relnamespace
WHERE n.nspname = 'delaywheel';
