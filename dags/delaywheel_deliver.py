"""delaywheel_deliver: keeps every delay level and the timing wheel delivering, all the time.

One task per configured level (`[delaywheel] levels`, RocketMQ's `messageDelayLevel`; 18 by default)
plus one for the wheel, so each level has its own checkpoint and its own countdown as in RocketMQ, and
one slow level never delays another. Each task holds its lane for a lease, sleeping exactly until the
lane's next due time between passes and waking early on a producer's NOTIFY.

Why overlapping scheduled runs, not `@continuous`: Airflow needs seconds to start a task (here 5-60 s
for 19 tasks on 2 cores), so delivering from short runs would add that to every message's lateness,
and leases fix that, but with `@continuous` (which requires `max_active_runs=1`) the next run can only
start once the slowest task of the previous one has ended. Every lane then sits idle for the run
hand-over (task end -> scheduler -> 19 task starts), once per lease. Measured with `@continuous` on
this 2-core machine: tasks started 5-8 s after their run, and a task whose first try failed (API server
still starting) started 5 min late and held the next run back all that time.
Instead a run starts every `deliver_lease_seconds`, two runs may be active, and every task's lease
ends `deliver_overlap_seconds` after the next run is due (counted from the run's scheduled time, so all
lanes hand over together). The next run's tasks are already running when the previous ones stop;
during the overlap two tasks share each lane pass by pass, so the hand-over costs no lateness as long
as a task starts within the overlap. And a task hands its lane over only to a live successor: past
its lease it keeps delivering (up to another `deliver_overlap_seconds`) until the next run's task for
its lane is running, so a successor killed at start-up (measured: API timeouts while 19 tasks start at
once on 2 cores) leaves no idle lane while Airflow retries it.

A rolling hand-over: the `delaywheel_deliver` pool (created by scripts/airflow.sh) has a slot per lane plus
`[delaywheel] deliver_handover_slots` (3). So the next run starts 3 lane tasks beside the running run's 19, and
each of the others once an old task has handed its lane over (past its lease, to its successor) and freed a slot:
a few task starts at a time, not 19 at once, which took both CPUs of a 2-core machine for ~12 s at every lease and
made the slowest deliveries there (DESIGN.md, "A rolling hand-over"). The old tasks keep their lanes meanwhile
(`handover_grace_seconds`, the overlap, bounds how long), so no lane is left without a task.

One task for every lane (`[delaywheel] deliver_tasks = one`; default `per_lane`): each run then starts one task,
`deliver_all_lanes` (`DeliverAllLanesOperator`), that runs the one delivery loop `delaywheel deliver` runs over every
lane, passing whichever lane falls due next. Airflow starting 19 tasks at once costs a supervisor and a task process
each, 6-7 CPU-seconds within ~12 s on 2 cores, once per lease: every delivery and every consumer on the machine waits
for a CPU meanwhile, and a lease consumer's p99 was mostly those seconds (DESIGN.md, "What sets its p99 on two
cores"). One task starts in a fraction of that. What it gives up: a lane of its own per task in the grid, its own log
and its own retry, and passes of different lanes running at once on several cores (they take turns in one loop, as
in `delaywheel deliver`). Prefer it on a machine with few cores.

When every lane's task has ended, `publish_topic_events` records one Asset event per topic for the
whole run (see PublishTopicEventsOperator for why not one per task).

Safety does not depend on Airflow: two deliverers of a lane (the overlap, a manual run, a second
scheduler, a zombie worker) take the lane's advisory lock one pass at a time, and every pass moves
messages and checkpoint in one transaction, so nothing is delivered twice or lost.

Several stores (`stores` / DELAYWHEEL_STORES, docs/stores.md): each store has its own lanes, so the file makes one
DAG per store, `delaywheel_deliver_<name>`, on the store's connection `delaywheel_<name>` and with its own pool
`delaywheel_deliver_<name>` (levels + 1 + deliver_handover_slots slots each, created by scripts/airflow.sh). With no
stores configured it makes `delaywheel_deliver` on `delaywheel_default` and pool `delaywheel_deliver`, as always.

Parsing reads only the level table, the store names, two numbers and `deliver_tasks` (environment / airflow.cfg): no
database, no Spark.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param, TaskGroup, conf

from delaywheel import load_settings
from delaywheel.airflow.connections import store_conn_id, store_names
from delaywheel.airflow.operators import (
    AdvanceWheelOperator,
    DeliverAllLanesOperator,
    DeliverLevelOperator,
    PublishTopicEventsOperator,
)
from delaywheel.lanes import delay_label

POOL = "delaywheel_deliver"
SETTINGS = load_settings()
LEVELS = SETTINGS.levels
INTERVAL_S = conf.getfloat("delaywheel", "deliver_lease_seconds", fallback=300.0)
OVERLAP_S = conf.getfloat("delaywheel", "deliver_overlap_seconds", fallback=120.0)
TASKS = conf.get("delaywheel", "deliver_tasks", fallback="per_lane")
if TASKS not in ("per_lane", "one"):
    raise ValueError(f"[delaywheel] deliver_tasks must be 'per_lane' or 'one', not {TASKS!r}")


def deliver_dag(dag_id: str, conn_id: str, pool: str) -> None:
    """One store's deliver DAG: its lanes on connection `conn_id`, in pool `pool` (the DAG registers itself)."""
    with DAG(
        dag_id=dag_id,
        schedule=timedelta(seconds=INTERVAL_S),
        max_active_runs=2,  # the running one and the one taking over
        max_active_tasks=2 * (len(LEVELS) + 1),
        dagrun_timeout=timedelta(seconds=INTERVAL_S + OVERLAP_S + 300),  # a stuck run is failed, its tasks told to stop
        is_paused_upon_creation=False,  # delivery is the point of running Airflow here
        start_date=datetime(2025, 1, 1),
        catchup=False,
        doc_md=__doc__,
        tags=["delaywheel"],
        params={
            "lease_seconds": Param(
                INTERVAL_S + OVERLAP_S,
                type="number",
                minimum=1,
                description="Each task delivers until this long after the run's scheduled time.",
            ),
            "until_idle": Param(False, type="boolean", description="End a task early once its lane is empty."),
            "handover_grace_seconds": Param(
                OVERLAP_S,
                type="number",
                minimum=0,
                description="Past its lease, a task keeps its lane up to this long "
                "until the next run's task for that lane is running.",
            ),
        },
        default_args={"pool": pool, "retries": 2, "retry_delay": timedelta(seconds=5)},
    ):
        common: dict[str, Any] = {
            "lease_seconds": "{{ params.lease_seconds }}",
            "until_idle": "{{ params.until_idle }}",
            "handover_grace_seconds": "{{ params.handover_grace_seconds }}",
            "emit_asset_events": False,
            "delaywheel_conn_id": conn_id,
        }
        # The grid lists a DAG's top-level nodes by id, as text: deliver_level_10 would come before deliver_level_2.
        # Each lane is therefore a one-task group whose id sorts naturally (lane_01 … lane_18, lane_wheel), while the
        # task ids stay deliver_level_<n> and advance_wheel (prefix_group_id=False): the grid and graph show the lanes
        # in level order and nothing that names a task changes.
        width = len(str(len(LEVELS)))
        lanes: list[DeliverLevelOperator | AdvanceWheelOperator | DeliverAllLanesOperator] = []
        if TASKS == "one":
            lanes.append(DeliverAllLanesOperator(task_id="deliver_all_lanes", task_display_name="every lane", **common))
        else:
            for level, delay in enumerate(LEVELS, start=1):
                name = f"level {level} ({delay_label(delay)})"
                with TaskGroup(f"lane_{level:0{width}d}", group_display_name=name, prefix_group_id=False):
                    lanes.append(
                        DeliverLevelOperator(
                            task_id=f"deliver_level_{level}", task_display_name=name, level=level, **common
                        )
                    )
            with TaskGroup("lane_wheel", group_display_name="timing wheel", prefix_group_id=False):
                lanes.append(AdvanceWheelOperator(task_id="advance_wheel", task_display_name="timing wheel", **common))
        lanes >> PublishTopicEventsOperator(
            task_id="publish_topic_events",
            task_display_name="topic Asset events",
            lane_task_ids=[lane.task_id for lane in lanes],
        )


for store in store_names(SETTINGS):
    suffix = "" if store is None else f"_{store}"
    deliver_dag(f"delaywheel_deliver{suffix}", store_conn_id(store), POOL + suffix)
