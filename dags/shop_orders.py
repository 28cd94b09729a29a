"""The order-timeout story under Airflow (the README's demo runs the same library code as processes of its own).

- `shop_place_orders` (triggered with a form): the Spark order generator places N orders over a period,
  each with its timeout message enqueued in the same transaction.
- `shop_customers` (continuous): simulated customers carry out their planned payments and cancellations
  as they fall due; paying cancels the order's timer.
- `shop_reconcile` (every 10 minutes): the Spark reconcile mode compares pending orders with pending
  timers: creates a timer for a pending order that has none, cancels the timers of orders no longer pending.
The sweep that applies delivered timeouts is `shop_order_sweep`, a long-running lease consumer (ConsumeOperator).
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Param, task
from delaywheel_shop import orders

from delaywheel.airflow.connections import store_conn_id, topic_stores
from delaywheel.airflow.spark import spark_job

START = datetime(2025, 1, 1)
ORDER_GENERATOR = Path(orders.__file__).with_name("order_generator.py")  # the shop's Spark job
DURATION = r"^\d+(ms|s|m|h|d)$"  # the level table's notation (config.parse_duration), checked in the form
# With several stores (docs/stores.md) the shop lives in the store of its timeouts' topic: its tables beside its timers
# (an order and its timer are written in one transaction), and the sweep (ConsumeOperator) reads that store too.
SHOP_STORE = topic_stores(orders.TOPIC)[0]

with DAG(
    dag_id="shop_place_orders",
    schedule=None,
    start_date=START,
    catchup=False,
    tags=["delaywheel", "shop", "spark"],
    doc_md=__doc__,
    params={
        "orders": Param(100_000, type="integer", minimum=1, description="How many orders to place."),
        "timeout": Param(
            "30m", type="string", pattern=DURATION, description="Payment timeout (e.g. 30m; seconds for a demo)."
        ),
        "period": Param("30s", type="string", pattern=DURATION, description="Spread the orders over this long."),
        "first_id": Param(1, type="integer", minimum=1, description="First order id (ids must be new)."),
    },
):
    spark_job(
        "place_orders",
        ORDER_GENERATOR,
        [
            "--orders",
            "{{ params.orders }}",
            "--timeout",
            "{{ params.timeout }}",
            "--period",
            "{{ params.period }}",
            "--first-id",
            "{{ params.first_id }}",
        ],
        store=SHOP_STORE,
    )

with DAG(
    dag_id="shop_customers",
    schedule="@continuous",
    max_active_runs=1,
    start_date=START,
    catchup=False,
    tags=["delaywheel", "shop"],
    doc_md=__doc__,
    params={"lease_seconds": Param(300, type="integer", minimum=1, description="How long one run acts.")},
):

    @task
    def act(params: dict[str, Any] | None = None) -> dict[str, int]:
        assert params is not None  # Airflow passes the run's params (a context key named in the signature)
        from delaywheel.airflow.hooks import DelayWheelHook  # the postgres provider: when the task runs

        with DelayWheelHook(store_conn_id(SHOP_STORE)).get_store() as store:
            return orders.run_customers(
                store, stop=threading.Event(), every_s=0.2, duration_s=int(params["lease_seconds"])
            )

    act()

with DAG(
    dag_id="shop_reconcile",
    schedule=timedelta(minutes=10),
    start_date=START,
    catchup=False,
    max_active_runs=1,
    tags=["delaywheel", "shop", "spark"],
    doc_md=__doc__,
):
    spark_job(
        "reconcile",
        "redeliver",
        [
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
        ],
        store=SHOP_STORE,
    )
