-- Seeks of consumer groups (consume/position.py): each row is one move of a group's offset in one queue of a topic,
-- from where it was to where the seek put it, with what was asked (earliest, latest, a time, an offset), who asked
-- (the caller's text, else the database role) and when; a seek writes one row per queue. Written by the runtime with
-- the move, in its transaction; never updated or deleted by it: an audit trail.
CREATE TABLE delaywheel.group_seeks (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    grp text NOT NULL,
    topic text NOT NULL,
    qid smallint NOT NULL CHECK (qid BETWEEN 0 AND 15),
    target text NOT NULL,
    sought_by text NOT NULL,
    sought_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    from_xid xid8 NOT NULL,
    from_offset bigint NOT NULL,
    to_xid xid8 NOT NULL,
    to_offset bigint NOT NULL
);

CREATE INDEX group_seeks_group ON delaywheel.group_seeks (grp, topic, sought_at);

-- The baseline's default privileges granted SELECT, INSERT and UPDATE: the runtime reads and appends, nothing more.
REVOKE ALL ON TABLE delaywheel.group_seeks FROM delaywheel_runtime;
GRANT SELECT, INSERT ON TABLE delaywheel.group_seeks TO delaywheel_runtime;

-- How many seeks moved the offset: a batch carries the count it read, and its ack moves no offset whose count changed
-- since, so a batch read before a seek does not undo it (consume/topics.py).
ALTER TABLE delaywheel.consumer_offsets ADD COLUMN seeks bigint NOT NULL DEFAULT 0;
