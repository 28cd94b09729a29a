"""The order-timeout DAGs (issue 6) under `dag.test()` against the real PostgreSQL: the sweep DAG applies
delivered timeouts exactly once; the customers DAG carries out due payments."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from delaywheel import Store, orders

pytestmark = pytest.mark.airflow


@pytest.fixture
def shop_dags(store_connection: str) -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    assert bag.import_errors == {}
    return bag.dags


def test_sweep_dag_cancels_overdue_orders_once(shop_dags: dict[str, Any], db_url: str) -> None:
    sweep = shop_dags["shop_order_sweep"]
    with Store(db_url) as store:
        orders.reset(store, stock_per_sku=100)
        now = store.clock()
        plans = [orders.OrderPlan(i, "c", [("sku-001", 1)], "abandon" if i % 2 else "pay", timedelta(seconds=1))
                 for i in range(1, 21)]
        orders.place_orders(store, plans, timedelta(seconds=30), now=now - timedelta(seconds=60))
        orders.act_customers(store)  # the even orders paid (in time, 59 s ago), their timers cancelled
        assert store.deliver_due() == 10  # the odd orders' timers: overdue

        run = sweep.test()
        assert run.state == "success"
        status = dict(store.conn.execute("SELECT order_id, status FROM shop.orders").fetchall())
        assert status == {i: "cancelled_timeout" if i % 2 else "paid" for i in range(1, 21)}
        assert store.conn.execute("SELECT on_hand, reserved, sold FROM shop.products WHERE sku = 'sku-001'").fetchone() \
            == (90, 0, 10)

        run = sweep.test()  # nothing new: changes nothing
        assert run.state == "success"
        assert store.conn.execute("SELECT count(*) FROM shop.processed_messages").fetchone()[0] == 10
        assert store.conn.execute("SELECT on_hand, reserved, sold FROM shop.products WHERE sku = 'sku-001'").fetchone() \
            == (90, 0, 10)


def test_shop_dags_parse_with_their_spark_tasks(shop_dags: dict[str, Any]) -> None:
    place = shop_dags["shop_place_orders"].get_task("place_orders")
    assert place._conn_id == "spark_default" and place.application.endswith("spark/order_generator.py")
    reconcile = shop_dags["shop_reconcile"].get_task("reconcile")
    assert "--key-column" in reconcile.application_args and "timer_key" in reconcile.application_args
    assert shop_dags["shop_customers"].max_active_runs == 1
