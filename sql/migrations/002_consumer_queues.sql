-- Competing consumers: a topic is read as QUEUES (16) queues by key, each consumed by one member of a group at a time.
--
-- A row's queue (qid) is a hash of its key, or of its id when it has none: messages with one key share a queue, so a
-- group handles them in order, one at a time, while its members handle other queues in parallel (RocketMQ's queues
-- by key hash). The constant 16 is consume/queues.py's QUEUES; a test holds them equal.
ALTER TABLE delaywheel.topic_messages
    ADD COLUMN qid smallint GENERATED ALWAYS AS ((hashtext(coalesce(key, message_id::text)) & 15)::smallint) STORED;

-- A queue's read: the group's rows past its offset in that queue, in commit order.
CREATE INDEX topic_messages_queue ON delaywheel.topic_messages USING btree (topic, qid, xid, queue_offset);

-- A group's offset per queue. A store's offsets so far were one per (group, topic): the same position in every
-- queue, as a queue's rows are a subsequence of the topic's.
ALTER TABLE delaywheel.consumer_offsets DROP CONSTRAINT consumer_offsets_pkey;
ALTER TABLE delaywheel.consumer_offsets ADD COLUMN qid smallint NOT NULL DEFAULT 0;
INSERT INTO delaywheel.consumer_offsets (grp, topic, qid, cursor_xid, cursor_offset, acked, updated_at)
SELECT o.grp, o.topic, q, o.cursor_xid, o.cursor_offset, 0, o.updated_at
FROM delaywheel.consumer_offsets o CROSS JOIN generate_series(1, 15) q;
ALTER TABLE delaywheel.consumer_offsets ADD PRIMARY KEY (grp, topic, qid);
ALTER TABLE delaywheel.consumer_offsets ADD CONSTRAINT consumer_offsets_qid CHECK (qid BETWEEN 0 AND 15);

-- Who consumes a group's queue, until when: a member takes a queue with rows to read and no live lease, holds it while
-- it handles a batch (renewed with each pull), and gives it back with its ack. A member that dies, or whose handler
-- outlives the lease, loses the queue to another member once the lease has expired (a member whose server process
-- ended, at once); its late ack is refused.
CREATE TABLE delaywheel.consumer_leases (
    grp text NOT NULL,
    topic text NOT NULL,
    qid smallint NOT NULL CHECK (qid BETWEEN 0 AND 15),
    holder text,
    pid integer,  -- the holder's server process: a lease whose process is gone is free at once
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    taken_at timestamptz,
    taken bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (grp, topic, qid)
);
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE delaywheel.consumer_leases TO delaywheel_runtime;

-- A group's live members on a topic: each pull says it is alive until its lease ends; a member's share of the queues
-- is 16 / live members, rounded up (delaywheel.take_queues), so queues spread over the members as they come and go.
CREATE TABLE delaywheel.consumer_members (
    grp text NOT NULL,
    topic text NOT NULL,
    holder text NOT NULL,
    pid integer NOT NULL,  -- its server process: a member whose process is gone counts no more
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (grp, topic, holder)
);
GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE delaywheel.consumer_members TO delaywheel_runtime;
