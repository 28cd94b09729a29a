-- The shop's settling operations as one named function each (orders.py calls them): a customers' tick, a payment,
-- a customer's cancellation and the sweep's batch of timeouts each run as one statement, one round trip.
--
-- Why: a delivered timeout becomes readable to the sweep only once every older writing transaction has ended (the
-- store's commit horizon). These transactions ran from Python, a round trip per step, and on a busy 2-core machine
-- the client waited for a CPU between steps with its transaction id held: in `make demo` beside two busy loops one
-- customers' tick held it for 1.06 s ("idle in transaction" between its statements), while the sweep had nothing it
-- could read. Inside one function the steps follow each other in the server.
--
-- Lock order, so that the sweep, the customers and the order generator never deadlock one another: every
-- transaction takes the orders it may change first, then their products, each in ascending order (the ORDER BY
-- below, whatever order the ids come in), before it updates any of them: an UPDATE ... FROM locks rows in whatever
-- order its join yields them. The locks are the ones those UPDATEs take (FOR NO KEY UPDATE): FOR UPDATE would also
-- wait on the key-share locks that inserting order lines takes on their products, unordered.
--
-- Every function is planned afresh on each call (plan_cache_mode): the demo's tables start empty, and a plan cached
-- for empty tables rescanned the customers' locking subquery once per row (DESIGN.md, "Order timeouts").

-- When each payment was processed, beside when it was made (paid_at): how far the customers' worker runs behind.
ALTER TABLE shop.payments ADD COLUMN processed_at timestamptz NOT NULL DEFAULT clock_timestamp();

CREATE FUNCTION shop.lock_orders(ids bigint[]) RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    PERFORM 1 FROM shop.orders WHERE order_id = ANY(ids) ORDER BY order_id FOR NO KEY UPDATE;
END $$;

CREATE FUNCTION shop.lock_stock(ids bigint[]) RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    PERFORM 1 FROM shop.products WHERE sku IN (SELECT sku FROM shop.order_lines WHERE order_id = ANY(ids))
    ORDER BY sku FOR NO KEY UPDATE;
END $$;

-- Move the orders' reserved stock to sold (sell) or back on hand.
CREATE FUNCTION shop.release_stock(ids bigint[], sell boolean) RETURNS void LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    PERFORM shop.lock_stock(ids);
    UPDATE shop.products p SET reserved = p.reserved - l.qty,
        sold = p.sold + CASE WHEN sell THEN l.qty ELSE 0 END,
        on_hand = p.on_hand + CASE WHEN sell THEN 0 ELSE l.qty END
    FROM (SELECT sku, sum(qty) AS qty FROM shop.order_lines WHERE order_id = ANY(ids) GROUP BY sku) l
    WHERE p.sku = l.sku;
END $$;

-- Move the orders still pending whose deadline had not passed when the customer asked (the request's own time, not
-- when it is processed) to `new_status` ('paid': paid_at, 'cancelled_customer': cancelled_at, stamped with that
-- time); returns their ids.
CREATE FUNCTION shop.settle_in_time(ids bigint[], asked timestamptz[], new_status text) RETURNS bigint[]
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    settled bigint[];
BEGIN
    PERFORM shop.lock_orders(ids);
    WITH s AS (
        UPDATE shop.orders o SET status = new_status,
            paid_at = CASE WHEN new_status = 'paid' THEN r.at ELSE o.paid_at END,
            cancelled_at = CASE WHEN new_status = 'paid' THEN o.cancelled_at ELSE r.at END
        FROM unnest(ids, asked) AS r(id, at)
        WHERE o.order_id = r.id AND o.status = 'pending' AND r.at < o.deadline
        RETURNING o.order_id)
    SELECT coalesce(array_agg(order_id), '{}') INTO settled FROM s;
    RETURN settled;
END $$;

-- Payments (order id, time paid): accepted for orders still pending whose deadline had not passed when the customer
-- paid, refused otherwise (a refund); every payment is recorded. Returns the ids accepted.
CREATE FUNCTION shop.pay(ids bigint[], paid timestamptz[]) RETURNS bigint[]
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    accepted_ids bigint[] := shop.settle_in_time(ids, paid, 'paid');
BEGIN
    INSERT INTO shop.payments (order_id, paid_at, accepted)
    SELECT p.id, p.at, p.id = ANY(accepted_ids) FROM unnest(ids, paid) AS p(id, at);
    PERFORM shop.release_stock(accepted_ids, true);
    RETURN accepted_ids;
END $$;

-- Customers' cancellations (order id, time asked), honoured like payments. Returns the ids cancelled.
CREATE FUNCTION shop.customer_cancel(ids bigint[], asked timestamptz[]) RETURNS bigint[]
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    cancelled_ids bigint[] := shop.settle_in_time(ids, asked, 'cancelled_customer');
BEGIN
    PERFORM shop.release_stock(cancelled_ids, false);
    RETURN cancelled_ids;
END $$;

-- The simulated customers' tick: every planned action due at `now` (skipping plans another tick holds), payments
-- and cancellations settled together, their locks taken at once, in order. Returns how many payments were made and
-- the orders paid and cancelled (whose timers the caller cancels after commit).
CREATE FUNCTION shop.act_customers(now timestamptz, OUT payments integer, OUT paid bigint[], OUT cancelled bigint[])
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    asked bigint[];
    payers bigint[];
    pay_times timestamptz[];
    cancellers bigint[];
    cancel_times timestamptz[];
BEGIN
    WITH due AS (
        UPDATE shop.customer_plan SET done = true WHERE order_id IN (
            SELECT order_id FROM shop.customer_plan WHERE NOT done AND act_at <= now FOR UPDATE SKIP LOCKED)
        RETURNING order_id, action, act_at)
    SELECT coalesce(array_agg(order_id), '{}'),
           coalesce(array_agg(order_id) FILTER (WHERE action = 'pay'), '{}'),
           coalesce(array_agg(act_at) FILTER (WHERE action = 'pay'), '{}'),
           coalesce(array_agg(order_id) FILTER (WHERE action = 'cancel'), '{}'),
           coalesce(array_agg(act_at) FILTER (WHERE action = 'cancel'), '{}')
    INTO asked, payers, pay_times, cancellers, cancel_times FROM due;
    PERFORM shop.lock_orders(asked);
    PERFORM shop.lock_stock(asked);
    payments := cardinality(payers);
    paid := CASE WHEN payments > 0 THEN shop.pay(payers, pay_times) ELSE '{}' END;
    cancelled := CASE WHEN cardinality(cancellers) > 0 THEN shop.customer_cancel(cancellers, cancel_times) ELSE '{}' END;
END $$;

-- The sweep's transaction for a delivered batch (message id, order id per timer): cancel the orders still unpaid
-- whose deadline has passed at `now` (a stray or early timer never cancels too soon) and release their stock; a
-- message seen before changes nothing. Returns (orders cancelled, messages already processed).
CREATE FUNCTION shop.apply_timeouts(message_ids bigint[], order_ids bigint[], now timestamptz,
                                    OUT orders_cancelled integer, OUT duplicates integer)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    fresh_messages bigint[];
    fresh_orders bigint[];
    touched bigint[];
    timed_out bigint[];
BEGIN
    SELECT coalesce(array_agg(m), '{}'), coalesce(array_agg(o), '{}') INTO fresh_messages, fresh_orders
    FROM unnest(message_ids, order_ids) AS t(m, o)
    WHERE NOT EXISTS (SELECT 1 FROM shop.processed_messages p WHERE p.message_id = t.m);
    SELECT coalesce(array_agg(DISTINCT o ORDER BY o), '{}') INTO touched FROM unnest(fresh_orders) o;
    PERFORM shop.lock_orders(touched);
    WITH c AS (
        UPDATE shop.orders SET status = 'cancelled_timeout', cancelled_at = coalesce(now, clock_timestamp())
        WHERE order_id = ANY(touched) AND status = 'pending' AND deadline <= coalesce(now, clock_timestamp())
        RETURNING order_id)
    SELECT coalesce(array_agg(order_id), '{}') INTO timed_out FROM c;
    PERFORM shop.release_stock(timed_out, false);
    INSERT INTO shop.processed_messages (message_id, order_id, cancelled)
    SELECT m, o, o = ANY(timed_out) FROM unnest(fresh_messages, fresh_orders) AS t(m, o);
    orders_cancelled := cardinality(timed_out);
    duplicates := cardinality(message_ids) - cardinality(fresh_messages);
END $$;

GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA shop TO delaywheel_runtime;
