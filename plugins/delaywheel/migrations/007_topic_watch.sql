-- What the topic watchers (Airflow AssetWatchers on each topic's Asset) have announced: the position in
-- (xid, queue_offset) read order up to which a topic's messages were reported in an Asset event. Only rows
-- below the commit horizon are counted, so a transaction committing late cannot hide behind the mark.
CREATE TABLE delaywheel.topic_watch (
    topic        text        PRIMARY KEY,
    seen_xid     xid8        NOT NULL DEFAULT '0',
    seen_offset  bigint      NOT NULL DEFAULT 0,
    announced    bigint      NOT NULL DEFAULT 0,    -- messages announced so far
    fired_at     timestamptz
);
