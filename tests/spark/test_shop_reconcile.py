"""Issue 6: the Spark reconcile mode against the shop's orders — a pending order whose timer was lost gets a
new one (and is then swept at its deadline), a paid order's leftover timer is cancelled."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import redeliver
from delaywheel_shop import orders

from delaywheel import Store

TIMEOUT = timedelta(minutes=30)


@pytest.mark.usefixtures("shop_schema")  # the shop's own line in the test's database
def test_reconcile_repairs_order_timers(spark: object, store: Store, db_url: str, t0: datetime) -> None:
    orders.reset(store, stock_per_sku=100)
    plans = [orders.OrderPlan(i, "c", [("sku-003", 1)], "abandon", None) for i in range(1, 11)]
    orders.place_orders(store, plans, TIMEOUT, now=t0)
    store.cancel_matching(keys=[orders.timer_key(1), orders.timer_key(2)], reason="lost (simulated)")
    orders.pay(store, [(3, t0 + timedelta(minutes=1))], cancel_timers=False)  # paid, its timer left pending
    argv = [
        "--db-url",
        db_url,
        "--requested-by",
        "test",
        "--now",
        (t0 + timedelta(minutes=2)).isoformat(),
        "--mode",
        "reconcile",
        "--table",
        "shop.orders",
        "--key-column",
        "timer_key",
        "--predicate",
        "status = 'pending'",
        "--topic",
        orders.TOPIC,
        "--due-column",
        "deadline",
    ]

    report = redeliver.main(argv)

    assert (report["missing"], report["created"], report["stale"], report["cancelled"]) == (2, 2, 1, 1)
    assert sorted(report["sample"]["missing"]) == ["order-1", "order-2"]
    assert report["sample"]["stale"] == ["order-3"]
    store.deliver_due(now=t0 + TIMEOUT)
    swept = orders.sweep(store, now=t0 + TIMEOUT)
    assert swept.cancelled == 9  # every pending order, the two repaired ones included; the paid one stays paid
    status = dict(store.conn.execute("SELECT order_id, status FROM shop.orders").fetchall())
    assert status == {i: "paid" if i == 3 else "cancelled_timeout" for i in range(1, 11)}
    assert redeliver.main(argv)["missing"] == 0
