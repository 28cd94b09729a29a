"""The order-timeout story (issue 6): business outcomes, idempotent sweep, payment racing the timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from delaywheel_shop import orders
from delaywheel_shop.order_quality import verify

from delaywheel import Store
from tests.helpers import wait_for_lock

TIMEOUT = timedelta(seconds=30)


def expected_status(plan: orders.OrderPlan) -> str:
    if plan.action == "pay" and plan.act_after < TIMEOUT:
        return "paid"
    if plan.action == "cancel":
        return "cancelled_customer"
    return "cancelled_timeout"


def run_story(store: Store, plans: list[orders.OrderPlan], t0, *, step_s: float = 2.0) -> orders.SweepTotals:
    """Drive the story with an injected clock: customers act, timers fall due, the sweep applies them."""
    orders.reset(store, stock_per_sku=10_000)
    for start in range(0, len(plans), 500):
        orders.place_orders(store, plans[start : start + 500], TIMEOUT, now=t0)
    totals = orders.SweepTotals()
    steps = int(2 * TIMEOUT.total_seconds() / step_s) + 2  # late payers act up to 1.8 x timeout
    for step in range(1, steps + 1):
        now = t0 + timedelta(seconds=step * step_s)
        orders.act_customers(store, now=now)
        store.deliver_due(now=now)
        swept = orders.sweep(store, max_messages=300, now=now)
        totals.messages += swept.messages
        totals.cancelled += swept.cancelled
    return totals


def test_story_outcome_matches_the_rules_exactly(store: Store, t0, tmp_path) -> None:
    plans = orders.plan_orders(1, 2000, TIMEOUT)
    totals = run_story(store, plans, t0)
    status = dict(store.conn.execute("SELECT order_id, status FROM shop.orders").fetchall())
    assert {p.order_id: expected_status(p) for p in plans} == status
    # only abandoned and late-paying orders' timers fire; paid and customer-cancelled ones were cancelled
    fired = sum(1 for p in plans if expected_status(p) == "cancelled_timeout")
    assert totals.messages == fired == totals.cancelled
    refused = store.conn.execute("SELECT count(*) FROM shop.payments WHERE NOT accepted").fetchone()[0]
    assert refused == sum(1 for p in plans if p.action == "pay" and p.act_after >= TIMEOUT)
    gap, reserved = store.conn.execute(
        "SELECT sum(initial_stock - on_hand - reserved - sold), sum(reserved) FROM shop.products"
    ).fetchone()
    assert (gap, reserved) == (0, 0)
    verdict = verify(store, tmp_path, since=t0)
    assert verdict.success, verdict.text
    assert (tmp_path / "report.html").read_text().count("passed") >= 8


def test_quality_suite_catches_a_broken_outcome(store: Store, t0, tmp_path) -> None:
    plans = orders.plan_orders(1, 300, TIMEOUT)
    run_story(store, plans, t0)
    victim = next(p.order_id for p in plans if expected_status(p) == "cancelled_timeout")
    store.conn.execute("UPDATE shop.orders SET status = 'paid', cancelled_at = NULL WHERE order_id = %s", (victim,))
    store.conn.execute("UPDATE shop.products SET sold = sold + 1 WHERE sku = 'sku-000'")
    verdict = verify(store, tmp_path, since=t0)
    failed = {r["rule"] for r in verdict.results if not r["success"]}
    assert not verdict.success
    assert "every order unpaid at its deadline is cancelled" in failed
    assert "stock conserved: initial = on hand + reserved + sold" in failed
    assert "FAILED" in (tmp_path / "report.html").read_text()


def test_redelivered_batch_changes_nothing(store: Store, t0) -> None:
    """A crash between the sweep's commit and its ack redelivers the batch: applying it again is a no-op."""
    orders.reset(store, stock_per_sku=1000)
    plans = [orders.OrderPlan(i, "c", [("sku-001", 2)], "abandon", None) for i in range(1, 51)]
    orders.place_orders(store, plans, TIMEOUT, now=t0)
    store.deliver_due(now=t0 + TIMEOUT)
    batch = store.pull(orders.TOPIC, orders.GROUP, 100)
    assert len(batch) == 50
    assert orders.apply_timeouts(store.conn, batch.messages, now=t0 + TIMEOUT) == (50, 0)
    snapshot = store.conn.execute("SELECT on_hand, reserved, sold FROM shop.products WHERE sku = 'sku-001'").fetchone()
    # "crash": no ack, and its lease ends (as when its process dies), so the same batch comes back
    store.release(batch)
    again = store.pull(orders.TOPIC, orders.GROUP, 100)
    assert [m.message_id for m in again.messages] == [m.message_id for m in batch.messages]
    assert orders.apply_timeouts(store.conn, again.messages, now=t0 + TIMEOUT) == (0, 50)
    assert (
        store.conn.execute("SELECT on_hand, reserved, sold FROM shop.products WHERE sku = 'sku-001'").fetchone()
        == snapshot
    )
    assert snapshot == (1000, 0, 0)
    store.ack(again)
    assert len(store.pull(orders.TOPIC, orders.GROUP, 100)) == 0


def test_placing_orders_writes_nothing_before_the_timers_are_built(
    store: Store, t0, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An order's transaction holds back the commit horizon the sweep reads behind from its first write to its
    commit: send_many's Python work (checking the timers, building their columns) comes before any write, and the
    order rows follow it, carrying their timers' ids."""
    orders.reset(store, stock_per_sku=100)
    seen: list[object] = []
    send_many = Store.send_many

    def observed(self: Store, messages: Any, **kwargs: Any) -> list[int]:
        seen.append(self.conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0])
        return send_many(self, messages, **kwargs)

    monkeypatch.setattr(Store, "send_many", observed)
    plans = [orders.OrderPlan(i, "c", [("sku-004", 1)], "abandon", None) for i in range(1, 4)]
    assert orders.place_orders(store, plans, TIMEOUT, now=t0) == 3
    assert seen == [None]  # inside the order's transaction, which had no transaction id yet: nothing written
    timers = dict(store.conn.execute("SELECT key, id FROM delaywheel.wheel").fetchall())
    rows = store.conn.execute("SELECT order_id, timeout_message_id FROM shop.orders ORDER BY order_id").fetchall()
    assert rows == [(i, timers[orders.timer_key(i)]) for i in range(1, 4)]
    assert store.conn.execute("SELECT on_hand, reserved FROM shop.products WHERE sku = 'sku-004'").fetchone() == (97, 3)


def test_early_stray_timer_does_not_cancel_the_order(store: Store, t0) -> None:
    orders.reset(store, stock_per_sku=100)
    orders.place_orders(store, [orders.OrderPlan(1, "c", [("sku-002", 1)], "abandon", None)], TIMEOUT, now=t0)
    store.send(orders.TOPIC, {"order_id": 1}, key=orders.timer_key(1), now=t0)  # not the order's timer: fires now
    store.send(orders.TOPIC, {"note": "not a timer"}, now=t0)
    assert orders.sweep(store, now=t0 + timedelta(seconds=1)).cancelled == 0
    assert store.conn.execute("SELECT status FROM shop.orders").fetchone()[0] == "pending"


def test_customer_actions_processed_late_keep_the_time_they_were_asked(store: Store, t0, tmp_path) -> None:
    """The customers' worker lags past the deadline: a cancel or payment asked in time still wins over a
    timer that has not been applied yet; the contract holds either way (the failure CI once caught)."""
    orders.reset(store, stock_per_sku=100)
    asked = TIMEOUT / 2
    plans = [
        orders.OrderPlan(1, "c", [("sku-003", 1)], "cancel", asked),
        orders.OrderPlan(2, "c", [("sku-003", 1)], "pay", asked),
        orders.OrderPlan(3, "c", [("sku-003", 1)], "abandon", None),
        orders.OrderPlan(4, "c", [("sku-003", 1)], "abandon", None),
    ]
    orders.place_orders(store, plans, TIMEOUT, now=t0)
    assert orders.customer_cancel(store, [(4, t0 + TIMEOUT)]) == []  # asked at the deadline: too late
    late = t0 + TIMEOUT + timedelta(seconds=1)
    store.deliver_due(now=late)  # every timer delivered; the sweep has not run yet
    assert orders.act_customers(store, now=late) == {"payments": 1, "accepted": 1, "customer_cancels": 1}
    assert orders.sweep(store, now=late).cancelled == 2
    rows = dict(store.conn.execute("SELECT order_id, status FROM shop.orders").fetchall())
    assert rows == {1: "cancelled_customer", 2: "paid", 3: "cancelled_timeout", 4: "cancelled_timeout"}
    assert store.conn.execute("SELECT cancelled_at FROM shop.orders WHERE order_id = 1").fetchone()[0] == t0 + asked
    verdict = verify(store, tmp_path, since=t0)
    assert verdict.success, verdict.text


def test_a_payment_made_in_time_but_processed_after_the_sweep_fails_the_quality_check(
    store: Store, t0, tmp_path
) -> None:
    """The customers' worker falls so far behind that the sweep applies an order's timeout before it processes that
    order's on-time payment: the outcome rules allow the refusal (the order was unpaid at its deadline), but a customer
    who paid in time was refused, so the check fails, naming it, and the summary counts it apart from late payers."""
    orders.reset(store, stock_per_sku=100)
    plans = [
        orders.OrderPlan(1, "c", [("sku-005", 1)], "pay", TIMEOUT / 2),
        orders.OrderPlan(2, "c", [("sku-005", 1)], "pay", TIMEOUT * 1.5),
    ]
    orders.place_orders(store, plans, TIMEOUT, now=t0)
    swept = t0 + TIMEOUT + timedelta(seconds=0.5)
    store.deliver_due(now=swept)
    assert orders.sweep(store, now=swept).cancelled == 2  # before the customers' worker got to either payment
    late = t0 + TIMEOUT * 2
    assert orders.act_customers(store, now=late) == {"payments": 2, "accepted": 0, "customer_cancels": 0}
    verdict = verify(store, tmp_path, since=t0)
    assert not verdict.success
    assert verdict.failures == [
        "QUALITY FAILED: no payment made in time is refused: the customers kept up with their plan"
    ]
    assert (verdict.summary["late_payments_refused"], verdict.summary["in_time_payments_refused"]) == (1, 1)
    assert "1 payments made in time were refused" in verdict.text


def test_the_customers_loop_cancels_the_settled_orders_timers_before_it_returns(store: Store) -> None:
    """`run_customers` cancels timers on a second connection, off the tick's path: every paid or customer-cancelled
    order's timer is cancelled by the time it returns, and none of them is delivered."""
    orders.reset(store, stock_per_sku=1000)
    plans = [
        orders.OrderPlan(i, "c", [("sku-006", 1)], "pay" if i % 3 else "cancel", timedelta(milliseconds=10 * i))
        for i in range(1, 31)
    ]
    orders.place_orders(store, plans, TIMEOUT)
    totals = orders.run_customers(store, stop=threading.Event(), every_s=0.05, duration_s=1.0)
    assert totals == {"payments": 20, "accepted": 20, "customer_cancels": 10}
    cancelled = store.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone()[0]
    assert cancelled == 30
    far = store.clock() + 2 * TIMEOUT
    store.deliver_due(now=far)
    assert len(store.pull(orders.TOPIC, orders.GROUP, 100)) == 0


@pytest.mark.parametrize("round_", range(3))
def test_payment_racing_the_timeout_ends_paid_or_cancelled_never_both(db_url: str, t0, round_: int) -> None:
    n = 200
    with Store(db_url) as setup:
        orders.reset(setup, stock_per_sku=10_000)
        plans = [orders.OrderPlan(i, "c", [(f"sku-{i % 50:03d}", 1)], "abandon", None) for i in range(1, n + 1)]
        orders.place_orders(setup, plans, TIMEOUT, now=t0)
        setup.deliver_due(now=t0 + TIMEOUT)  # every timer is in the topic: the sweep and the payers race
    deadline = t0 + TIMEOUT
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def payer() -> None:
        try:
            with Store(db_url) as store:
                start.wait()
                for i in range(1, n + 1, 10):  # paid just before the deadline, arriving now
                    orders.pay(store, [(o, deadline - timedelta(milliseconds=1)) for o in range(i, min(i + 10, n + 1))])
        except BaseException as exc:
            errors.append(exc)

    def sweeper() -> None:
        try:
            with Store(db_url) as store:
                start.wait()
                while orders.sweep(store, max_messages=7, now=deadline).messages:
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=payer), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    with Store(db_url) as check:
        rows = check.conn.execute(
            """SELECT o.status, bool_or(p.accepted) AS accepted
               FROM shop.orders o LEFT JOIN shop.payments p USING (order_id) GROUP BY o.order_id, o.status"""
        ).fetchall()
        assert len(rows) == n
        for status, accepted in rows:
            assert status in ("paid", "cancelled_timeout")
            assert (status == "paid") == bool(accepted)
        gap, reserved = check.conn.execute(
            "SELECT sum(initial_stock - on_hand - reserved - sold), sum(reserved) FROM shop.products"
        ).fetchone()
        assert (gap, reserved) == (0, 0)


def test_customers_take_all_their_order_locks_in_one_ascending_pass(db_url: str, t0) -> None:
    """A cancellation (order 1) and a payment (order 2) fall due in one customers' transaction while the sweep
    holds order 1 and then wants order 2. The customers must wait for order 1 before taking order 2: CI once
    deadlocked when they locked the payments' orders first and the cancellations' after."""
    with Store(db_url) as setup:
        orders.reset(setup, stock_per_sku=100)
        orders.place_orders(
            setup,
            [
                orders.OrderPlan(1, "c", [("sku-001", 1)], "cancel", timedelta(seconds=1)),
                orders.OrderPlan(2, "c", [("sku-002", 1)], "pay", timedelta(seconds=1)),
            ],
            TIMEOUT,
            now=t0,
        )
    outcome: list[dict[str, int]] = []
    with psycopg.connect(db_url, autocommit=True) as sweep, Store(db_url) as customers:
        pid = customers.conn.info.backend_pid
        worker = threading.Thread(target=lambda: outcome.append(orders.act_customers(customers, now=t0 + TIMEOUT / 2)))
        with sweep.transaction():
            sweep.execute("SELECT 1 FROM shop.orders WHERE order_id = 1 FOR NO KEY UPDATE")
            worker.start()
            wait_for_lock(sweep, pid, "the customers' transaction (for order 1)")
            sweep.execute("SET LOCAL lock_timeout = '5s'")  # order 2 must be free: the customers hold nothing yet
            sweep.execute("SELECT 1 FROM shop.orders WHERE order_id = 2 FOR NO KEY UPDATE")
        worker.join(30)
    assert outcome == [{"payments": 1, "accepted": 1, "customer_cancels": 1}]


def test_a_missed_lateness_contract_names_the_figure(store: Store, t0, tmp_path) -> None:
    """The demo prints verify()'s failures on stderr and exits 1: each names the figure, its value and the limit."""
    plans = [orders.OrderPlan(i, "c", [("sku-001", 1)], "abandon", None) for i in range(1, 102)]
    for round_, (late_s, straggler_s, expected) in enumerate(
        (
            (1.5, 1.5, "CONTRACT FAILED: cancellation lateness p99 1.50 s > 1 s"),
            (0.5, 4.0, "CONTRACT FAILED: cancellation lateness max 4.00 s > 3 s"),
        )
    ):
        start = t0 + timedelta(hours=round_)  # the wheel's cursor only moves forward
        orders.reset(store, stock_per_sku=1000)
        orders.place_orders(store, plans[:100], TIMEOUT, now=start)
        orders.place_orders(store, plans[100:], TIMEOUT, now=start + timedelta(seconds=10))
        store.deliver_due(now=start + TIMEOUT)
        orders.sweep(store, now=start + TIMEOUT + timedelta(seconds=late_s))  # 100 cancellations late_s late
        store.deliver_due(now=start + timedelta(seconds=10) + TIMEOUT)
        orders.sweep(store, now=start + timedelta(seconds=10 + straggler_s) + TIMEOUT)  # and one straggler_s late
        verdict = verify(store, tmp_path / str(round_), since=start)
        assert not verdict.success
        assert verdict.failures == [expected], verdict.text
        assert verdict.summary["cancellation_lateness_max_ms"] == straggler_s * 1000


def test_customers_tick_stays_fast_when_first_planned_on_tables_recorded_empty(store: Store, db_url: str, t0) -> None:
    """`make demo` right after a restart: autovacuum had recorded the reset tables as empty (0 pages, 0 rows), the
    customers ticked on them from the start, and a statement psycopg had prepared settled on a plan for empty tables
    that rescanned its locking subquery once per row. With the tables filled, one tick held its transaction for two
    minutes (and the commit horizon with it). Every shop statement is planned for the rows there are now."""
    orders.reset(store, stock_per_sku=1000)
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute("VACUUM shop.orders, shop.customer_plan")
        recorded = admin.execute(
            "SELECT relpages, reltuples FROM pg_class WHERE oid = 'shop.customer_plan'::regclass"
        ).fetchone()
    assert recorded == (0, 0)
    for _ in range(12):  # enough runs on empty tables for psycopg to prepare and PostgreSQL to go generic
        orders.act_customers(store, now=t0)
    with store.conn.transaction():  # 50,000 payments due, straight into the tables
        store.conn.execute(
            "INSERT INTO shop.orders (order_id, customer, placed_at, deadline)"
            " SELECT g, 'c', %s, %s FROM generate_series(1, 50000) g",
            (t0, t0 + TIMEOUT),
        )
        store.conn.execute(
            "INSERT INTO shop.customer_plan (order_id, action, act_at)"
            " SELECT g, 'pay', %s FROM generate_series(1, 50000) g",
            (t0 + timedelta(seconds=1),),
        )
    store.conn.execute("SET statement_timeout = '60s'")  # the quadratic plan takes minutes: fail, do not hang
    started = time.monotonic()
    acted = orders.act_customers(store, now=t0 + timedelta(seconds=2))
    assert acted == {"payments": 50000, "accepted": 50000, "customer_cancels": 0}
    assert time.monotonic() - started < 60
    prepared = store.conn.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE '%shop.%'")
    assert prepared.fetchall() == []
