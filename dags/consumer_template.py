"""Template consumer: a DAG that runs whenever delaywheel delivers into a topic, and consumes it.

Copy this file, set TOPIC and GROUP, and replace `handle()` with your processing.

How it works:
- This DAG is scheduled on the topic's Asset, `delaywheel://topics/<topic>`, or its group's retry topic's
  (`consumer_schedule(TOPIC, GROUP)`: an event on either starts a run), so Airflow starts a run after new
  deliveries and when a failed message's retry falls due, on a quiet topic too. Two things record events for
  each: its watcher (`TopicMessagesTrigger`, an `AssetWatcher` running in the triggerer) within about a second
  of messages becoming readable, and the deliver DAG's final task (`publish_topic_events`), once per deliver
  run, as a backstop. The deliver tasks themselves emit none (Airflow would record them only when their lease
  of minutes ends). A watcher's event extra arrives wrapped by Airflow, `{"from_trigger": true, "payload":
  {topic, lane, count, first/last (xid, queue_offset)}}`; `publish_topic_events` gives those fields unwrapped,
  with `lanes`. `consume` only logs them.
- The run does not trust the events for *what* to read: it pulls from the topic by consumer group
  (the group's committed offset), handles the batch, acks it, and repeats until the topic is drained.
  Events that arrive while a run is active, or while the DAG is paused, are therefore never a gap:
  the next run starts from the group's offset, wherever the events say.
- Delivery to consumers is at least once (a run that fails before `ack` is re-read by the next one):
  make `handle()` idempotent on `message.idempotency_id`, the same across redeliveries and retries.
- Messages whose id `handle()` returns are handed to RocketMQ's retry ladder (redelivered later into
  `%RETRY%<group>`, which `pull` reads too) and after `max_reconsume_times` go to `%DLQ%<group>`; a retry policy
  of the group's own (`delaywheel group retry-policy GROUP`) sets the retries and their delays instead.
- The `tags` param filters by tag (`TAG1 || TAG2`; `*`: all): other messages are skipped and the group's offset
  passes them with the ack. `start` says where a new group begins: `earliest`, `latest` or a time.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk import DAG, Param, task

from delaywheel.airflow.forms import form_moment, subscription_params
from delaywheel.airflow.operators import consumer_schedule

if TYPE_CHECKING:  # for the annotation only: Airflow parses this file every 30 s, and the store's code is not light
    from delaywheel import Delivered

TOPIC = "orders"  # the topic to consume
GROUP = "orders-template"  # this consumer's group: each group gets every message; give each consumer its own

log = logging.getLogger(__name__)  # task logs show it


def handle(messages: list[Delivered]) -> set[int]:
    """Process one batch; return the message_ids that failed (they are retried later). Replace this."""
    for message in messages:
        log.info(
            "message %s (key %s, due %s): %r", message.idempotency_id, message.key, message.deliver_at, message.body
        )
    return set()


with DAG(
    dag_id="delaywheel_consumer_template",
    schedule=consumer_schedule(TOPIC, GROUP),  # the topic's Asset or its group's retries': not a list (that is AND)
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,  # one consumer of the group at a time keeps batches in order
    doc_md=__doc__,
    tags=["delaywheel", "consumer"],
    params={
        "batch_size": Param(500, type="integer", minimum=1, description="Messages per pull."),
        "max_batches": Param(100, type="integer", minimum=1, description="Stop after this many batches."),
        **subscription_params(),
    },
):

    @task
    def consume(params: dict[str, Any] | None = None, triggering_asset_events: Any = None) -> dict[str, Any]:
        assert params is not None  # Airflow passes the run's params (a context key named in the signature)
        from delaywheel.airflow.hooks import DelayWheelHook  # the postgres provider and psycopg: when the task runs

        for asset, events in (triggering_asset_events or {}).items():
            for event in events:
                log.info("triggered by %s: %s", getattr(asset, "uri", asset), event.extra)
        consumed = failed = batches = 0
        start = form_moment(params["start"], ("earliest", "latest"), "start")
        with DelayWheelHook().get_store() as store:
            while batches < int(params["max_batches"]):
                batch = store.pull(TOPIC, GROUP, int(params["batch_size"]), tags=params["tags"], start=start)
                if not batch:  # nothing read (a batch whose rows the tag filter all skipped still needs its ack)
                    break
                failures = handle(batch.messages)
                store.ack(batch, failures)  # commits the group's offset (and the retries) in one transaction
                consumed += len(batch)
                failed += len(failures)
                batches += 1
        return {"topic": TOPIC, "group": GROUP, "consumed": consumed, "failed": failed, "batches": batches}

    consume()
