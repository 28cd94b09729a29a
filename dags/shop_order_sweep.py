"""Order-timeout sweep: a long-running consumer of the order timeouts that cancels unpaid orders as their
timers are delivered.

One task holds consumer group `shop-sweeper` on topic `shop.order-timeout` for a lease (`ConsumeOperator`, as
`delaywheel_consumer_lease_template`), waking on the topic's delivery notifications: an order is cancelled tens of
milliseconds after its timer is delivered, where a run started per delivery (scheduled on the topic's Asset) added
a second or more of Airflow scheduling to every cancellation. A run starts every INTERVAL_S and leases
INTERVAL_S + OVERLAP_S, so the next run's task is running, waiting for its turn, when the old one hands the group
over (a batch is handled under its queues' leases; see the template's docstring). Paused at creation, as the other shop DAGs.

Each delivered batch is applied in one set-based transaction (`orders.apply_timeouts`, on the consumer's own
session): orders still unpaid at their deadline are cancelled and their stock released; paid or already cancelled
orders stay as they are; each message id is recorded in `shop.processed_messages`. The group's offset advances
only after that transaction committed (the ack comes with the next pull), so a batch delivered again (a task
killed between the two, a hand-over) changes nothing. Paying an order cancels its timer, so most timers never fire.

A drain-and-stop run (`airflow dags test shop_order_sweep --conf '{"until_idle": true}'`, the demo's last pass)
handles what is delivered now and ends once a second passes with nothing new.

Returned (XCom): handled, acked, batches, cancelled (orders cancelled by this task), already_processed (messages
applied before: a redelivery), retried, reconnects, and how the task stopped (lease, idle, kill).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Context, Param
from delaywheel_shop import orders

from delaywheel.airflow.operators import ConsumeOperator
from delaywheel.consume.topics import Delivered

INTERVAL_S = 300  # a run (a lease) starts this often
OVERLAP_S = 60  # ... and lasts this much longer, so that the next run's task is running when it lets go


class OrderTimeoutSweepOperator(ConsumeOperator):
    """`ConsumeOperator` on the order timeouts whose handler applies each batch with `orders.apply_timeouts`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(topic=orders.TOPIC, group=orders.GROUP, **kwargs)
        self._cancelled = self._already_processed = 0

    def handle(self, messages: list[Delivered], context: Context) -> Collection[int] | None:
        assert self.store is not None  # set for the duration of execute()
        cancelled, already = orders.apply_timeouts(self.store.conn, messages)
        self._cancelled += cancelled
        self._already_processed += already
        return None  # a batch applies as a whole or raises (then it is retried as a whole)

    def execute(self, context: Context) -> dict[str, Any]:
        self._cancelled = self._already_processed = 0
        result = super().execute(context)
        return {**result, "cancelled": self._cancelled, "already_processed": self._already_processed}


with DAG(
    dag_id="shop_order_sweep",
    schedule=timedelta(seconds=INTERVAL_S),
    max_active_runs=2,  # the running lease and the one taking over
    dagrun_timeout=timedelta(seconds=INTERVAL_S + 2 * OVERLAP_S + 300),  # a stuck run is failed, its task stopped
    start_date=datetime(2025, 1, 1),
    catchup=False,
    doc_md=__doc__,
    tags=["delaywheel", "shop", "consumer"],
    params={
        "lease_seconds": Param(
            INTERVAL_S + OVERLAP_S,
            type="number",
            minimum=1,
            description="The task consumes until this long after the run's scheduled time.",
        ),
        "handover_grace_seconds": Param(
            OVERLAP_S,
            type="number",
            minimum=0,
            description="Past its lease, keep the group up to this long until the next run's sweep is running.",
        ),
        "until_idle": Param(
            False, type="boolean", description="Drain and stop: end once a second passes with nothing delivered."
        ),
        "batch_size": Param(5000, type="integer", minimum=1, description="Timeouts per transaction (at most)."),
    },
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5)},
):
    OrderTimeoutSweepOperator(
        task_id="sweep",
        lease_seconds="{{ params.lease_seconds }}",
        handover_grace_seconds="{{ params.handover_grace_seconds }}",
        until_idle="{{ params.until_idle }}",
        max_messages="{{ params.batch_size }}",
    )
