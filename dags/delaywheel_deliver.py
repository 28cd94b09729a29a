"""delaywheel_deliver: keeps every delay level and the timing wheel delivering, all the time.

One task per configured level (`[delaywheel] levels`, RocketMQ's `messageDelayLevel`; 18 by default)
plus one for the wheel, so each level has its own checkpoint and its own countdown as in RocketMQ, and
one slow level never delays another. Each task holds its lane for a lease (`lease_seconds`), sleeping
exactly until the lane's next due time between passes and waking early on a producer's NOTIFY.

Why `@continuous` with leases: Airflow needs about a second to start a task, so delivering from short
scheduled runs would add that second (plus scheduler latency) to every message's lateness. A
continuous DAG starts the next run as soon as the previous one ends (`max_active_runs=1` is what
`@continuous` requires), and a lease amortises the start cost: lateness stays at the store's own
countdown precision except at the hand-over between runs, once per lease (measured in bench/).
The price is one pool slot per lane, held all the time: the `delaywheel_deliver` pool (levels + 1
slots, created by scripts/airflow.sh) bounds that, so deliverers never starve other DAGs of slots.

Safety does not depend on Airflow: a second deliverer of a lane (a manual run beside the continuous
one, a second scheduler, a zombie worker) is refused the lane's advisory lock and only retries, and
every pass moves messages and checkpoint in one transaction, so nothing is delivered twice or lost.

Parsing reads only the level table (environment / airflow.cfg): no database, no Spark.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param, conf

from delaywheel import load_settings
from delaywheel.airflow.operators import AdvanceWheelOperator, DeliverLevelOperator

POOL = "delaywheel_deliver"
LEVELS = load_settings().levels
LEASE_SECONDS = conf.getfloat("delaywheel", "deliver_lease_seconds", fallback=300.0)


def _label(delay: timedelta) -> str:
    """'1s', '2m', '2h', '500ms': the level table's own notation."""
    ms = int(delay.total_seconds() * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


with DAG(
    dag_id="delaywheel_deliver",
    schedule="@continuous",
    max_active_runs=1,
    max_active_tasks=len(LEVELS) + 1,  # every lane at once (Airflow's default cap is 16)
    is_paused_upon_creation=False,  # delivery is the point of running Airflow here
    start_date=datetime(2025, 1, 1),
    catchup=False,
    doc_md=__doc__,
    tags=["delaywheel"],
    params={
        "lease_seconds": Param(LEASE_SECONDS, type="number", minimum=1, description="How long each task delivers."),
        "until_idle": Param(False, type="boolean", description="End a task early once its lane is empty."),
    },
    default_args={"pool": POOL, "retries": 1, "retry_delay": timedelta(seconds=10)},
):
    common = {"lease_seconds": "{{ params.lease_seconds }}", "until_idle": "{{ params.until_idle }}"}
    for level, delay in enumerate(LEVELS, start=1):
        DeliverLevelOperator(
            task_id=f"deliver_level_{level}", task_display_name=f"level {level} ({_label(delay)})", level=level,
            **common,
        )
    AdvanceWheelOperator(task_id="advance_wheel", task_display_name="timing wheel", **common)
