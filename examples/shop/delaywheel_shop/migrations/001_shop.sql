-- The order-timeout demo's business schema (`shop`), separate from the store's (`delaywheel`): the first file of the
-- shop's own migrations line (`delaywheel_shop.schema`). It was the store's migrations/006 until the shop became an
-- example beside the library; a database that applied it there records this version without running it again.
-- Stock moves between three buckets and is conserved: initial = on_hand + reserved + sold.

CREATE SCHEMA shop;

CREATE TABLE shop.products (
    sku           text    PRIMARY KEY,
    initial_stock integer NOT NULL,
    on_hand       integer NOT NULL CHECK (on_hand >= 0),
    reserved      integer NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    sold          integer NOT NULL DEFAULT 0 CHECK (sold >= 0)
);

CREATE TABLE shop.orders (
    order_id      bigint      PRIMARY KEY,
    customer      text        NOT NULL,
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'paid', 'cancelled_timeout', 'cancelled_customer')),
    placed_at     timestamptz NOT NULL,
    deadline      timestamptz NOT NULL,   -- placed_at + timeout: unpaid by then means cancelled
    paid_at       timestamptz,
    cancelled_at  timestamptz,
    timeout_message_id bigint,            -- the delaywheel message that fires at the deadline
    timer_key     text GENERATED ALWAYS AS ('order-' || order_id) STORED  -- that message's key (reconcile joins on it)
);
CREATE INDEX orders_status ON shop.orders (status);

CREATE TABLE shop.order_lines (
    order_id  bigint  NOT NULL REFERENCES shop.orders,
    sku       text    NOT NULL REFERENCES shop.products,
    qty       integer NOT NULL CHECK (qty > 0),
    PRIMARY KEY (order_id, sku)
);

CREATE TABLE shop.payments (
    payment_id  bigserial   PRIMARY KEY,
    order_id    bigint      NOT NULL REFERENCES shop.orders,
    paid_at     timestamptz NOT NULL,
    accepted    boolean     NOT NULL       -- false: the order was already cancelled (refund)
);
CREATE INDEX payments_order ON shop.payments (order_id);

-- What simulated customers will do, and when (written by the order generator, acted on over time).
CREATE TABLE shop.customer_plan (
    order_id  bigint      PRIMARY KEY REFERENCES shop.orders,
    action    text        NOT NULL CHECK (action IN ('pay', 'cancel', 'abandon')),
    act_at    timestamptz,                 -- NULL for 'abandon'
    done      boolean     NOT NULL DEFAULT false
);
CREATE INDEX customer_plan_due ON shop.customer_plan (act_at) WHERE NOT done;

-- The sweep's idempotency record: a timeout message is applied once, however often it is redelivered.
CREATE TABLE shop.processed_messages (
    message_id    bigint      PRIMARY KEY,
    order_id      bigint      NOT NULL,
    cancelled     boolean     NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The tables are the application's own, which the store's runtime role runs (README, "Roles"): the demo resets them
-- (TRUNCATE) and the sweep updates them. (A database that had the schema from the store's line got these grants from
-- the store's migrations/017, which granted on `shop` where it existed.)
GRANT USAGE ON SCHEMA shop TO delaywheel_runtime;
GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA shop TO delaywheel_runtime;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA shop TO delaywheel_runtime;
ALTER DEFAULT PRIVILEGES IN SCHEMA shop GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO delaywheel_runtime;
ALTER DEFAULT PRIVILEGES IN SCHEMA shop GRANT USAGE, SELECT ON SEQUENCES TO delaywheel_runtime;
