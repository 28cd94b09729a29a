-- The store's schema as of 0.1.0 (the baseline every later numbered change builds on): its tables, sequences,
-- indexes and grants. The functions, procedures and views are not here: they live one group to a file in sql/, and
-- migrate installs them after the numbered changes, whenever their text changed.
--
-- Least privilege: the schema belongs to `delaywheel_owner`, which runs the migrations; the store runs as
-- `delaywheel_runtime`, which holds no DDL privilege (its partition maintenance goes through sql/partitions.sql's
-- SECURITY DEFINER functions). Both are group roles; each deployment gives its login roles membership.

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

CREATE TABLE delaywheel.bulk_claims (
    source_id integer NOT NULL,
    key text NOT NULL COLLATE pg_catalog."C",
    message_id bigint NOT NULL,
    claimed_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE delaywheel.bulk_sources (
    id integer NOT NULL,
    source text NOT NULL
);

ALTER TABLE delaywheel.bulk_sources ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME delaywheel.bulk_sources_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE delaywheel.cancellations (
    message_id bigint NOT NULL,
    due_at timestamp with time zone NOT NULL,
    key text,
    reason text NOT NULL,
    cancelled_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
)
PARTITION BY RANGE (due_at);

CREATE TABLE delaywheel.consumer_offsets (
    grp text NOT NULL,
    topic text NOT NULL,
    cursor_xid xid8 DEFAULT '0'::xid8 NOT NULL,
    cursor_offset bigint DEFAULT 0 NOT NULL,
    acked bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE delaywheel.far_key_summaries (
    slot integer NOT NULL,
    id_lo bigint NOT NULL,
    id_hi bigint NOT NULL,
    last_block timestamp with time zone NOT NULL,
    bloom bytea NOT NULL,
    CONSTRAINT far_key_summaries_bloom_size CHECK ((octet_length(bloom) <= 2000)),
    CONSTRAINT far_key_summaries_check CHECK ((id_lo <= id_hi)),
    CONSTRAINT far_key_summaries_slot_check CHECK ((slot >= 1))
)
WITH (autovacuum_vacuum_insert_scale_factor='0.02');

CREATE TABLE delaywheel.lateness_minutes (
    minute timestamp with time zone NOT NULL,
    lane text NOT NULL,
    level smallint NOT NULL,
    topic text NOT NULL,
    deliveries bigint NOT NULL,
    p50_ms double precision NOT NULL,
    p95_ms double precision NOT NULL,
    p99_ms double precision NOT NULL,
    max_ms double precision NOT NULL,
    computed_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE delaywheel.level_checkpoint (
    level smallint NOT NULL,
    cursor_xid xid8 DEFAULT '0'::xid8 NOT NULL,
    cursor_id bigint DEFAULT 0 NOT NULL,
    delivered bigint DEFAULT 0 NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
)
WITH (fillfactor='20');

CREATE TABLE delaywheel.level_segments (
    id_first bigint NOT NULL,
    id_last bigint NOT NULL,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    level smallint NOT NULL,
    requested_level integer NOT NULL,
    reconsume_times integer NOT NULL,
    deliver_at timestamp with time zone NOT NULL,
    enqueued_at timestamp with time zone NOT NULL,
    n integer NOT NULL,
    ids bigint[] NOT NULL,
    topics text[] NOT NULL,
    keys text[] NOT NULL,
    tags text[] NOT NULL,
    properties text[] NOT NULL,
    bodies bytea[] NOT NULL,
    is_json boolean[] NOT NULL,
    key_bloom bytea,
    CONSTRAINT level_segments_check CHECK (((n >= 1) AND (id_first = ids[1]) AND (id_last = ids[n]) AND (cardinality(ids) = n) AND (cardinality(keys) = n) AND (cardinality(bodies) = n) AND ((cardinality(topics) = 1) OR (cardinality(topics) = n)) AND ((cardinality(tags) = 1) OR (cardinality(tags) = n)) AND ((cardinality(properties) = 1) OR (cardinality(properties) = n)) AND ((cardinality(is_json) = 1) OR (cardinality(is_json) = n)))),
    CONSTRAINT level_segments_level_check CHECK ((level >= 1))
)
PARTITION BY RANGE (enqueued_at);
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN ids SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN topics SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN keys SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN tags SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN properties SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN bodies SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN is_json SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.level_segments ALTER COLUMN key_bloom SET STORAGE EXTERNAL;

CREATE SEQUENCE delaywheel.message_id_seq
    START WITH 1
    INCREMENT BY 65536
    NO MINVALUE
    NO MAXVALUE
    CACHE 100;

CREATE TABLE delaywheel.quarantine (
    source text NOT NULL,
    source_file text NOT NULL,
    row_number bigint NOT NULL,
    reason text NOT NULL,
    detail text NOT NULL,
    raw text,
    quarantined_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE delaywheel.reconcile_runs (
    id bigint NOT NULL,
    requested_by text NOT NULL,
    started_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    business text NOT NULL,
    topic text NOT NULL,
    missing bigint NOT NULL,
    stale bigint NOT NULL,
    created bigint NOT NULL,
    cancelled bigint NOT NULL,
    sample jsonb NOT NULL,
    finished_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE SEQUENCE delaywheel.reconcile_runs_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE delaywheel.reconcile_runs_id_seq OWNED BY delaywheel.reconcile_runs.id;

CREATE TABLE delaywheel.replays (
    id bigint NOT NULL,
    requested_by text NOT NULL,
    requested_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    due_from timestamp with time zone NOT NULL,
    due_until timestamp with time zone NOT NULL,
    source_topic text,
    target_topic text,
    replayed bigint,
    skipped bigint,
    finished_at timestamp with time zone,
    CONSTRAINT replays_check CHECK ((due_from < due_until))
);

CREATE SEQUENCE delaywheel.replays_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE delaywheel.replays_id_seq OWNED BY delaywheel.replays.id;

CREATE TABLE delaywheel.retention_floor (
    singleton boolean DEFAULT true NOT NULL,
    topic_messages interval DEFAULT '168:00:00'::interval NOT NULL,
    CONSTRAINT retention_floor_singleton_check CHECK (singleton),
    CONSTRAINT retention_floor_topic_messages_check CHECK ((topic_messages >= '00:00:00'::interval))
);

CREATE TABLE delaywheel.set_aside (
    message_id bigint NOT NULL,
    lane text NOT NULL,
    level smallint,
    topic text,
    key text,
    deliver_at timestamp with time zone,
    reason text NOT NULL,
    detail text,
    set_aside_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    tags text,
    properties text,
    body bytea,
    is_json boolean,
    reconsume_times integer,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL
);

CREATE SEQUENCE delaywheel.topic_offset_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 100;

CREATE TABLE delaywheel.topic_messages (
    topic text NOT NULL,
    queue_offset bigint DEFAULT nextval('delaywheel.topic_offset_seq'::regclass) NOT NULL,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    message_id bigint NOT NULL,
    origin text NOT NULL,
    level smallint,
    key text,
    tags text,
    properties jsonb,
    body bytea NOT NULL,
    is_json boolean NOT NULL,
    reconsume_times integer DEFAULT 0 NOT NULL,
    deliver_at timestamp with time zone NOT NULL,
    delivered_at timestamp with time zone NOT NULL
)
PARTITION BY RANGE (delivered_at);

CREATE TABLE delaywheel.topic_watch (
    topic text NOT NULL,
    seen_xid xid8 DEFAULT '0'::xid8 NOT NULL,
    seen_offset bigint DEFAULT 0 NOT NULL,
    announced bigint DEFAULT 0 NOT NULL,
    fired_at timestamp with time zone
);

CREATE TABLE delaywheel.validation_results (
    id bigint NOT NULL,
    suite text NOT NULL,
    window_start timestamp with time zone NOT NULL,
    window_end timestamp with time zone NOT NULL,
    success boolean NOT NULL,
    failed text[] NOT NULL,
    result jsonb NOT NULL,
    report_path text,
    validated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE SEQUENCE delaywheel.validation_results_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE delaywheel.validation_results_id_seq OWNED BY delaywheel.validation_results.id;

CREATE TABLE delaywheel.wheel (
    id bigint NOT NULL,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    topic text NOT NULL,
    key text,
    tags text,
    properties jsonb,
    body bytea NOT NULL,
    is_json boolean NOT NULL,
    deliver_at timestamp with time zone NOT NULL,
    enqueued_at timestamp with time zone NOT NULL
)
PARTITION BY RANGE (deliver_at);

CREATE TABLE delaywheel.wheel_cursor (
    pass bigint NOT NULL,
    cursor_at timestamp with time zone NOT NULL,
    cursor_id bigint NOT NULL,
    horizon_xid xid8 NOT NULL,
    delivered bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE delaywheel.wheel_far_segments (
    id_first bigint NOT NULL,
    id_last bigint NOT NULL,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    block timestamp with time zone NOT NULL,
    enqueued_at timestamp with time zone NOT NULL,
    n integer NOT NULL,
    ids bigint[] NOT NULL,
    deliver_ats timestamp without time zone[] NOT NULL,
    keys text[] NOT NULL,
    bodies bytea[] NOT NULL,
    topics text[] NOT NULL,
    tags text[] NOT NULL,
    properties text[] NOT NULL,
    is_json boolean[] NOT NULL,
    key_bloom bytea,
    CONSTRAINT wheel_far_segments_check CHECK (((n >= 1) AND (id_first = ids[1]) AND (id_last = ids[n]) AND (cardinality(ids) = n) AND (cardinality(deliver_ats) = n) AND (cardinality(keys) = n) AND (cardinality(bodies) = n) AND ((cardinality(topics) = 1) OR (cardinality(topics) = n)) AND ((cardinality(tags) = 1) OR (cardinality(tags) = n)) AND ((cardinality(properties) = 1) OR (cardinality(properties) = n)) AND ((cardinality(is_json) = 1) OR (cardinality(is_json) = n))))
)
PARTITION BY RANGE (block);
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN ids SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN deliver_ats SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN keys SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN bodies SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN topics SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN tags SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN properties SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN is_json SET STORAGE EXTERNAL;
ALTER TABLE ONLY delaywheel.wheel_far_segments ALTER COLUMN key_bloom SET STORAGE EXTERNAL;

CREATE TABLE delaywheel.wheel_roll (
    singleton boolean DEFAULT true NOT NULL,
    near_until timestamp with time zone DEFAULT '1970-01-01 00:00:00+00'::timestamp with time zone NOT NULL,
    CONSTRAINT wheel_state_singleton_check CHECK (singleton)
)
WITH (fillfactor='20');

ALTER TABLE ONLY delaywheel.reconcile_runs ALTER COLUMN id SET DEFAULT nextval('delaywheel.reconcile_runs_id_seq'::regclass);

ALTER TABLE ONLY delaywheel.replays ALTER COLUMN id SET DEFAULT nextval('delaywheel.replays_id_seq'::regclass);

ALTER TABLE ONLY delaywheel.validation_results ALTER COLUMN id SET DEFAULT nextval('delaywheel.validation_results_id_seq'::regclass);

ALTER TABLE ONLY delaywheel.bulk_claims
    ADD CONSTRAINT bulk_claims_pkey PRIMARY KEY (source_id, key);

ALTER TABLE ONLY delaywheel.bulk_sources
    ADD CONSTRAINT bulk_sources_pkey PRIMARY KEY (id);

ALTER TABLE ONLY delaywheel.bulk_sources
    ADD CONSTRAINT bulk_sources_source_key UNIQUE (source);

ALTER TABLE ONLY delaywheel.consumer_offsets
    ADD CONSTRAINT consumer_offsets_pkey PRIMARY KEY (grp, topic);

ALTER TABLE ONLY delaywheel.lateness_minutes
    ADD CONSTRAINT lateness_minutes_pkey PRIMARY KEY (minute, lane, level, topic);

ALTER TABLE ONLY delaywheel.level_checkpoint
    ADD CONSTRAINT level_checkpoint_pkey PRIMARY KEY (level);

ALTER TABLE ONLY delaywheel.quarantine
    ADD CONSTRAINT quarantine_pkey PRIMARY KEY (source, source_file, row_number);

ALTER TABLE ONLY delaywheel.reconcile_runs
    ADD CONSTRAINT reconcile_runs_pkey PRIMARY KEY (id);

ALTER TABLE ONLY delaywheel.replays
    ADD CONSTRAINT replays_pkey PRIMARY KEY (id);

ALTER TABLE ONLY delaywheel.retention_floor
    ADD CONSTRAINT retention_floor_pkey PRIMARY KEY (singleton);

ALTER TABLE ONLY delaywheel.set_aside
    ADD CONSTRAINT set_aside_pkey PRIMARY KEY (message_id);

ALTER TABLE delaywheel.topic_messages
    ADD CONSTRAINT topic_messages_properties_object CHECK (((properties IS NULL) OR (jsonb_typeof(properties) = 'object'::text))) NOT VALID;

ALTER TABLE ONLY delaywheel.topic_watch
    ADD CONSTRAINT topic_watch_pkey PRIMARY KEY (topic);

ALTER TABLE ONLY delaywheel.validation_results
    ADD CONSTRAINT validation_results_pkey PRIMARY KEY (id);

ALTER TABLE ONLY delaywheel.wheel_cursor
    ADD CONSTRAINT wheel_cursor_pkey PRIMARY KEY (pass);

ALTER TABLE ONLY delaywheel.wheel_roll
    ADD CONSTRAINT wheel_state_pkey PRIMARY KEY (singleton);

CREATE INDEX cancellations_key ON ONLY delaywheel.cancellations USING btree (key) WHERE (key IS NOT NULL);

CREATE UNIQUE INDEX cancellations_once ON ONLY delaywheel.cancellations USING btree (message_id, due_at);

CREATE INDEX far_key_summaries_last_block ON delaywheel.far_key_summaries USING btree (last_block);

CREATE INDEX far_key_summaries_lookup ON delaywheel.far_key_summaries USING btree (slot) INCLUDE (id_lo, id_hi, bloom);

CREATE INDEX level_segments_fifo ON ONLY delaywheel.level_segments USING btree (level, xid, id_last);

CREATE INDEX level_segments_ids ON ONLY delaywheel.level_segments USING gist (int8range(id_first, id_last, '[]'::text));

CREATE INDEX quarantine_reason ON delaywheel.quarantine USING btree (reason, quarantined_at);

CREATE INDEX topic_messages_key ON ONLY delaywheel.topic_messages USING brin (key text_bloom_ops (n_distinct_per_range='1000', false_positive_rate='0.01')) WITH (pages_per_range='16', autosummarize='on');

CREATE INDEX topic_messages_message ON ONLY delaywheel.topic_messages USING btree (message_id);

CREATE INDEX topic_messages_read ON ONLY delaywheel.topic_messages USING btree (topic, xid, queue_offset);

CREATE INDEX topic_messages_replayed ON ONLY delaywheel.topic_messages USING btree (message_id, topic) WHERE (origin = 'replay'::text);

CREATE INDEX validation_results_window ON delaywheel.validation_results USING btree (window_end DESC);

CREATE INDEX wheel_due ON ONLY delaywheel.wheel USING btree (deliver_at, id);

CREATE INDEX wheel_far_segments_ids ON ONLY delaywheel.wheel_far_segments USING gist (int8range(id_first, id_last, '[]'::text));

CREATE INDEX wheel_far_segments_unfiltered_keys ON ONLY delaywheel.wheel_far_segments USING gin (keys) WITH (fastupdate=off) WHERE (key_bloom IS NULL);

CREATE INDEX wheel_id ON ONLY delaywheel.wheel USING btree (id);

CREATE INDEX wheel_key ON ONLY delaywheel.wheel USING btree (key) WHERE (key IS NOT NULL);

CREATE INDEX wheel_xid ON ONLY delaywheel.wheel USING btree (xid);

GRANT USAGE ON SCHEMA delaywheel TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.bulk_claims TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.bulk_sources TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.bulk_sources_id_seq TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.cancellations TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.consumer_offsets TO delaywheel_runtime;

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE delaywheel.far_key_summaries TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.lateness_minutes TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.level_checkpoint TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.level_segments TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.message_id_seq TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.quarantine TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.reconcile_runs TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.reconcile_runs_id_seq TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.replays TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.replays_id_seq TO delaywheel_runtime;

GRANT SELECT ON TABLE delaywheel.retention_floor TO delaywheel_runtime;

GRANT SELECT ON TABLE delaywheel.schema_migrations TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.set_aside TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.topic_offset_seq TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.topic_messages TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.topic_watch TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.validation_results TO delaywheel_runtime;

GRANT SELECT,USAGE ON SEQUENCE delaywheel.validation_results_id_seq TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.wheel TO delaywheel_runtime;

GRANT SELECT,INSERT,DELETE ON TABLE delaywheel.wheel_cursor TO delaywheel_runtime;

GRANT SELECT,INSERT,DELETE,UPDATE ON TABLE delaywheel.wheel_far_segments TO delaywheel_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE delaywheel.wheel_roll TO delaywheel_runtime;

ALTER DEFAULT PRIVILEGES FOR ROLE delaywheel_owner IN SCHEMA delaywheel GRANT SELECT,USAGE ON SEQUENCES  TO delaywheel_runtime;

ALTER DEFAULT PRIVILEGES FOR ROLE delaywheel_owner IN SCHEMA delaywheel GRANT ALL ON FUNCTIONS  TO delaywheel_runtime;

ALTER DEFAULT PRIVILEGES FOR ROLE delaywheel_owner IN SCHEMA delaywheel GRANT SELECT,INSERT,UPDATE ON TABLES  TO delaywheel_runtime;

ALTER DEFAULT PRIVILEGES FOR ROLE delaywheel_owner REVOKE ALL ON FUNCTIONS  FROM PUBLIC;

-- The singletons: the wheel's roll state and its first cursor entry (before every due time), the retention floor.
INSERT INTO delaywheel.wheel_roll (singleton, near_until) VALUES (true, '1970-01-01 00:00:00+00');
INSERT INTO delaywheel.wheel_cursor (pass, cursor_at, cursor_id, horizon_xid, delivered)
    VALUES (0, '1970-01-01 00:00:00+00', 0, '0', 0);
INSERT INTO delaywheel.retention_floor DEFAULT VALUES;
