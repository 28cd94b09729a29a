"""Template long-running consumer: `members` tasks (one by default) hold the consumer group for a lease and
handle each message as soon as it is delivered (waiting on the topic's notifications), then hand the group to the
next run.

Copy this file, set TOPIC and GROUP, and replace `handle()` with your processing (or pass
`apply_function_batch="my_pkg.handlers.handle"`, a dotted import path; `apply_function=` takes one message at
a time; or subclass `ConsumeOperator` and override `handle(messages, context)`).

When to use it rather than `delaywheel_consumer_template` (scheduled on the topic's Asset): this one is for
latency. A message is handled within tens of milliseconds of its delivery, where an Asset-scheduled run starts
a second or more after the watcher's event (a run and a task start each time). The Asset-scheduled consumer is
for batch work: it takes no worker slot while the topic is quiet.

How the lease hands over (as the deliver lanes do, `delaywheel_deliver`):
- A run starts every INTERVAL_S and two may be active (`max_active_runs=2`). Each task consumes until
  `lease_seconds` after its run's scheduled time (INTERVAL_S + OVERLAP_S by default), so the next run's task is
  already running, as a standby, when the old one lets go.
- A batch is handled under its queues' leases (the group's members share the topic's queues): during the
  overlap nothing is handled twice. The standby waits for its turn (an advisory lock the consuming task holds);
  at its lease end the old task finishes the batch in hand, acks it, gives its queues back and lets the turn go,
  and the standby pulls within milliseconds.
- Past its lease, a task keeps the group (up to `handover_grace_seconds`) until the next run's task is
  running, so a successor that failed at start-up leaves no gap while Airflow retries it.
- SIGTERM (marking the task failed, a scheduler stopping it) ends the task the same way: batch acked, queues
  given back. A crash acks nothing: the batch is handled again by the next holder (at least once; deduplicate
  on `message.idempotency_id`).
- Returned (XCom): handled, acked, retried, skipped (by the `tags` filter), reconnects, the slot, and how the task
  stopped.
- The `tags` param filters by tag (`TAG1 || TAG2`; `*`: all); `start` says where a new group begins (`earliest`,
  `latest` or a time). To move an existing group, trigger `delaywheel_group_seek`.

Several members (the `members` param, 1..16): the `members` task lists the slots 0..N-1 and `consume` is mapped over
them, one task per slot. The N tasks consume the group side by side, sharing its 16 queues (one key is one queue, so
each key's messages are still handled one at a time, in order), and each hands over to the next run's task of its own
slot as above. A run triggered with fewer members than the last leaves the extra slots' queues to the others once
their tasks' leases end.

Paused at creation: it is a template, and a running copy takes `members` worker slots (twice that during the
overlap).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from airflow.sdk import DAG, Param, get_current_context, task

from delaywheel.airflow.forms import subscription_params
from delaywheel.airflow.operators import ConsumeOperator

if TYPE_CHECKING:  # for the annotation only: Airflow parses this file every 30 s, and the store's code is not light
    from delaywheel import Delivered

TOPIC = "orders"  # the topic to consume
GROUP = "orders-lease-template"  # this consumer's group: each group gets every message; give each consumer its own
INTERVAL_S = 300  # a run (a lease) starts this often
OVERLAP_S = 60  # ... and lasts this much longer, so that the next run's task is running when it lets go
MAX_MEMBERS = 16  # consumers of the group side by side at most: its queues (`delaywheel.consume.lease.MAX_MEMBERS`)

log = logging.getLogger(__name__)  # task logs show it


def handle(messages: list[Delivered]) -> set[int]:
    """Process one batch; return the message_ids that failed (they are retried later). Replace this."""
    for message in messages:
        log.info(
            "message %s (key %s, due %s): %r", message.idempotency_id, message.key, message.deliver_at, message.body
        )
    return set()


@task(task_id="members")
def member_slots() -> list[int]:
    """The slots of this run's consumer tasks, 0..members - 1 (the param, checked again here)."""
    from delaywheel.consume.lease import member_slots as slots  # the store's code: when the task runs, not at parse

    return slots(get_current_context()["params"]["members"])


with DAG(
    dag_id="delaywheel_consumer_lease_template",
    schedule=timedelta(seconds=INTERVAL_S),
    max_active_runs=2,  # the running lease and the one taking over
    max_active_tasks=2 * MAX_MEMBERS + 1,  # every member of both runs (and a `members` task) at once
    dagrun_timeout=timedelta(seconds=INTERVAL_S + 2 * OVERLAP_S + 300),  # a stuck run is failed, its task stopped
    is_paused_upon_creation=True,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    doc_md=__doc__,
    tags=["delaywheel", "consumer"],
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
            description="Past its lease, keep the group up to this long until the next run's consumer is running.",
        ),
        "max_messages": Param(100, type="integer", minimum=1, description="Messages per batch (the prefetch bound)."),
        **subscription_params(),
        "members": Param(
            1,
            type="integer",
            minimum=1,
            maximum=MAX_MEMBERS,
            description="Consumer tasks sharing the group side by side, each handing over to its own successor.",
        ),
    },
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5)},
):
    ConsumeOperator.partial(
        task_id="consume",
        topic=TOPIC,
        group=GROUP,
        apply_function_batch=handle,
        lease_seconds="{{ params.lease_seconds }}",
        handover_grace_seconds="{{ params.handover_grace_seconds }}",
        max_messages="{{ params.max_messages }}",
        tags="{{ params.tags }}",
        start="{{ params.start }}",
        map_index_template="slot {{ task.slot }}",
    ).expand(slot=member_slots())
