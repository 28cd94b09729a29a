"""Order-timeout sweep: runs whenever delaywheel delivers order timeouts, and applies them.

For each delivered batch of the topic `shop.order-timeout` (pulled by consumer group `shop-sweeper`), one
set-based transaction cancels the orders still unpaid at their deadline and releases their stock; paid or
already cancelled orders stay as they are. The group's offset advances only after that transaction commits,
and each message id is recorded, so a batch delivered again (a run that failed before its ack) changes
nothing. Paying an order cancels its timer, so most timers never fire.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Param, task

from delaywheel import orders
from delaywheel.airflow.hooks import DelayWheelHook
from delaywheel.airflow.operators import topic_asset

with DAG(
    dag_id="shop_order_sweep",
    schedule=[topic_asset(orders.TOPIC)],
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["delaywheel", "shop", "consumer"],
    params={"batch_size": Param(5000, type="integer", minimum=1, description="Timeouts per transaction.")},
):

    @task
    def sweep(params: dict[str, Any]) -> dict[str, int]:
        with DelayWheelHook().get_store() as store:
            totals = orders.sweep(store, max_messages=int(params["batch_size"]))
        return {"batches": totals.batches, "messages": totals.messages, "cancelled": totals.cancelled,
                "already_processed": totals.duplicates}

    sweep()
