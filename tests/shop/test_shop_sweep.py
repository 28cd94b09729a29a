"""The shop sweep as a lease consumer (`dags/shop_order_sweep.py`, issue 19 item 3) against the real store and
Airflow's `dag.test()`: delivered timeouts are applied exactly once (orders cancelled, stock released, each
message recorded, the group's offset at the end), also when a batch was applied before its ack was lost; the
drain-and-stop run (`until_idle`) ends by itself; two sweep tasks overlapping on the group hand it over with
every timer applied once, none twice, none before its deadline."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from delaywheel_shop import orders

from delaywheel import Store
from tests.helpers import delivering

pytestmark = pytest.mark.airflow


@pytest.fixture
def sweep_dag(store_connection: str) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    assert bag.import_errors == {}
    return bag.dags["shop_order_sweep"]


def _left(store: Store) -> int:
    """Timeouts the sweep's group has not acked (a pull by a throwaway connection, not acked)."""
    with Store(store.url) as other:
        batch = other.pull(orders.TOPIC, orders.GROUP, 10_000)
        other.release(batch)
        return len(batch)


def _stock(store: Store) -> tuple[int, int, int]:
    row = store.conn.execute("SELECT on_hand, reserved, sold FROM shop.products WHERE sku = 'sku-001'").fetchone()
    assert row is not None
    return row


def _overdue_orders(store: Store, count: int) -> None:
    """`count` orders placed 60 s ago with a 30-s timeout: the even ones paid in time (their timers cancelled), the
    odd ones abandoned (their timers delivered, overdue)."""
    orders.reset(store, stock_per_sku=100)
    now = store.clock()
    plans = [
        orders.OrderPlan(i, "c", [("sku-001", 1)], "abandon" if i % 2 else "pay", timedelta(seconds=1))
        for i in range(1, count + 1)
    ]
    orders.place_orders(store, plans, timedelta(seconds=30), now=now - timedelta(seconds=60))
    orders.act_customers(store)
    assert store.deliver_due() == count // 2


def test_sweep_dag_applies_delivered_timeouts_once_and_drains_until_idle(sweep_dag: Any, db_url: str) -> None:
    from tests.helpers import run_dag

    with Store(db_url) as store:
        _overdue_orders(store, 20)
        started = time.monotonic()
        _run_id, states, values = run_dag(sweep_dag, until_idle=True)  # the default lease is 360 s: idle ends it
        assert time.monotonic() - started < 60
        assert states == {"sweep": "success"}
        result = values["sweep"]
        assert result["stopped_by"] == "idle", result
        assert (result["handled"], result["acked"], result["cancelled"], result["already_processed"]) == (10, 10, 10, 0)
        status = dict(store.conn.execute("SELECT order_id, status FROM shop.orders").fetchall())
        assert status == {i: "cancelled_timeout" if i % 2 else "paid" for i in range(1, 21)}
        assert _stock(store) == (90, 0, 10)
        processed = store.conn.execute("SELECT order_id, cancelled FROM shop.processed_messages").fetchall()
        assert sorted(processed) == [(i, True) for i in range(1, 21, 2)]
        assert _left(store) == 0  # the group's offset is past every timer

        _run_id, states, values = run_dag(sweep_dag, until_idle=True)  # nothing new: changes nothing
        assert states == {"sweep": "success"}
        assert (values["sweep"]["handled"], values["sweep"]["cancelled"]) == (0, 0)
        assert store.conn.execute("SELECT count(*) FROM shop.processed_messages").fetchone() == (10,)
        assert _stock(store) == (90, 0, 10)


def test_sweep_dag_changes_nothing_for_a_batch_applied_before_its_ack_was_lost(sweep_dag: Any, db_url: str) -> None:
    from tests.helpers import run_dag

    with Store(db_url) as store:
        _overdue_orders(store, 20)
        with Store(db_url) as crashed:  # a sweep that applied a batch and died before acking it
            batch = crashed.pull(orders.TOPIC, orders.GROUP, 4)
            assert orders.apply_timeouts(crashed.conn, batch.messages) == (4, 0)
        _run_id, states, values = run_dag(sweep_dag, until_idle=True, batch_size=3)
        assert states == {"sweep": "success"}
        result = values["sweep"]
        assert (result["handled"], result["cancelled"], result["already_processed"]) == (10, 6, 4), result
        assert result["batches"] == 4  # batch_size reached the consumer: 3 + 3 + 3 + 1
        assert store.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE cancelled) FROM shop.processed_messages"
        ).fetchone() == (10, 10)
        assert _stock(store) == (90, 0, 10)
        assert _left(store) == 0


def test_sweep_lease_handover_applies_every_timer_once(sweep_dag: Any, db_url: str) -> None:
    """Orders keep falling due (1.5 s timeouts, placed over 7 s) while the old sweep's lease ends (4 s) and the new
    one, started 2 s in as a standby, takes the group over: every abandoned order is cancelled once, by one of them,
    no timer is applied twice, and the group's offset ends past every timer."""
    sweep_class = type(sweep_dag.get_task("sweep"))
    old = sweep_class(task_id="old", lease_seconds=4, handover_grace_seconds=10, max_messages=50)
    new = sweep_class(task_id="new", lease_seconds=11, handover_grace_seconds=0, max_messages=50)
    results: dict[str, dict[str, Any]] = {}
    placed: list[int] = []
    stop = threading.Event()
    with Store(db_url) as store:
        orders.reset(store, stock_per_sku=10_000)
    deliverer = delivering(db_url, stop)

    def place() -> None:
        with Store(db_url) as own:
            end, next_id = time.monotonic() + 7, 1
            while time.monotonic() < end:
                plans = [
                    orders.OrderPlan(i, "c", [("sku-001", 1)], "abandon", None) for i in range(next_id, next_id + 5)
                ]
                orders.place_orders(own, plans, timedelta(seconds=1.5))
                placed.extend(p.order_id for p in plans)
                next_id += 5
                time.sleep(0.05)

    def work(op: Any) -> None:
        results[op.task_id] = op.execute({})

    placer = threading.Thread(target=place)
    threads = [threading.Thread(target=work, args=(old,)), threading.Thread(target=work, args=(new,))]
    try:
        placer.start()
        threads[0].start()
        time.sleep(2)
        threads[1].start()
        for t in (placer, *threads):
            t.join(60)
    finally:
        stop.set()
        deliverer.join(30)
    assert results["old"]["handed_over"] and results["old"]["stopped_by"] == "lease"
    assert results["old"]["handled"] > 0 and results["new"]["handled"] > 0, results
    with Store(db_url) as store:
        assert (
            sum(r["handled"] for r in results.values()) == sum(r["cancelled"] for r in results.values()) == len(placed)
        ), results
        assert sum(r["already_processed"] for r in results.values()) == 0
        assert store.conn.execute(
            "SELECT count(*), count(DISTINCT order_id), count(*) FILTER (WHERE cancelled) FROM shop.processed_messages"
        ).fetchone() == (len(placed), len(placed), len(placed))
        assert store.conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'cancelled_timeout'), count(*) FILTER (WHERE cancelled_at < deadline)"
            " FROM shop.orders"
        ).fetchone() == (len(placed), 0)
        assert store.conn.execute("SELECT reserved, on_hand FROM shop.products WHERE sku = 'sku-001'").fetchone() == (
            0,
            10_000,
        )
        assert _left(store) == 0
