-- Topic rows retention dropped before a consumer group had read them, per group and topic: `drop_partition`
-- (sql/partitions.sql) counts them under the partition's lock and adds them here, as the owner, in the transaction
-- that drops the partition. The runtime reads them (stats, the Airflow page, retire's report) and cannot change them;
-- the owner clears a row once it has been dealt with.

CREATE TABLE delaywheel.retired_unread (
    grp text NOT NULL,
    topic text NOT NULL,
    dropped bigint NOT NULL,                -- rows dropped unread, every drop together
    partitions integer NOT NULL,            -- the topic partitions that went with rows this group had not read
    first_dropped_at timestamp with time zone NOT NULL,
    last_dropped_at timestamp with time zone NOT NULL,
    last_dropped bigint NOT NULL,           -- rows the last of those drops took
    last_partition text NOT NULL,           -- the partition it dropped
    last_drop_xid xid8 NOT NULL,            -- the transaction that dropped it (retire reads back its own drop's rows)
    CONSTRAINT retired_unread_pkey PRIMARY KEY (grp, topic),
    CONSTRAINT retired_unread_counts CHECK (dropped >= last_dropped AND last_dropped > 0 AND partitions > 0)
);

-- The schema's default privileges would let the runtime write it: it only reads.
REVOKE ALL ON TABLE delaywheel.retired_unread FROM delaywheel_runtime;
GRANT SELECT ON TABLE delaywheel.retired_unread TO delaywheel_runtime;
