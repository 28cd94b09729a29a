-- The timing wheel (RocketMQ 5.x timer messages, without the 3-day cap and never early).
--
-- Near future: `wheel`, partitioned by due time into hourly blocks of fine slots; the advancer reads
-- it in (deliver_at, id) order through its index, so a slot costs the same however much is pending
-- elsewhere. Far future (beyond `near_until`): `wheel_far`, in daily blocks, moved into the near wheel
-- by the roll shortly before they fall due. Delivered blocks are retired by DROP.

CREATE TABLE delaywheel.wheel (
    id              bigint      NOT NULL,
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    topic           text        NOT NULL,
    key             text,
    tags            text,
    properties      jsonb,
    body            bytea       NOT NULL,
    is_json         boolean     NOT NULL,
    deliver_at      timestamptz NOT NULL,
    enqueued_at     timestamptz NOT NULL
) PARTITION BY RANGE (deliver_at);
CREATE INDEX wheel_due ON delaywheel.wheel (deliver_at, id);
CREATE INDEX wheel_xid ON delaywheel.wheel (xid);
CREATE INDEX wheel_id ON delaywheel.wheel (id);
CREATE INDEX wheel_key ON delaywheel.wheel (key) WHERE key IS NOT NULL;

CREATE TABLE delaywheel.wheel_far (LIKE delaywheel.wheel INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (deliver_at);
CREATE INDEX wheel_far_id ON delaywheel.wheel_far (id);
CREATE INDEX wheel_far_key ON delaywheel.wheel_far (key) WHERE key IS NOT NULL;
CREATE INDEX wheel_far_due ON delaywheel.wheel_far (deliver_at);

-- TimerCheckpoint. Invariant: every wheel row with (deliver_at, id) <= (cursor_at, cursor_id) and
-- xid < horizon_xid is delivered or cancelled. Rows committed later for passed times (xid >= horizon)
-- are "stragglers", delivered first by the next pass.
CREATE TABLE delaywheel.wheel_state (
    singleton    boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    cursor_at    timestamptz NOT NULL DEFAULT 'epoch',
    cursor_id    bigint      NOT NULL DEFAULT 0,
    horizon_xid  xid8        NOT NULL DEFAULT '0',
    near_until   timestamptz NOT NULL DEFAULT 'epoch',      -- due times below go to `wheel`, others to `wheel_far`
    delivered    bigint      NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp()
) WITH (fillfactor = 20);
INSERT INTO delaywheel.wheel_state DEFAULT VALUES;
