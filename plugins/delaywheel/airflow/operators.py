"""Operators: deliver a level, advance the wheel, or serve every lane for a lease; consume; enqueue, cancel; seek.

`DeliverLevelOperator` / `AdvanceWheelOperator` / `DeliverAllLanesOperator` stay alive for `lease_seconds` and run
`delaywheel.deliver.runner.run` on their lanes: deliver what is due, sleep exactly until the next due time
(waking on a producer's NOTIFY), repeat. A task start costs Airflow about a second, so one task per
due time could never give sub-second lateness; a lease amortises that start over many deliveries.
Each pass is one transaction that moves the messages and the checkpoint together, and the runner stops
only between passes, so the lease end, SIGTERM (`on_kill`) or a crash neither loses nor duplicates a
delivery. A lost connection (a PostgreSQL restart) does not end the task: the runner reconnects and goes on. Two tasks on the same lane (the next run taking over, another worker, another scheduler)
take the lane's advisory lock one pass at a time: each pass is delivered by exactly one of them.

Each topic delivered into gets an Asset event (`delaywheel://topics/<topic>`, through the
`delaywheel_topics` alias because topics are only known at run time), its extra saying how many
messages and which (xid, queue_offset) positions the batch spans: one per task when a lease operator
runs alone, one per run from `PublishTopicEventsOperator` in the deliver DAG. Airflow records outlet
events when a task ends, so consumers scheduled on the Asset start after the lease, not per message.

Nothing here touches the database, Spark or GX before `execute`, and nothing here imports them, psycopg, the store or
the postgres provider before `execute` either: `execute` imports what it runs. A DAG file that imports these classes
is parsed every 30 s by Airflow's DAG processor; in a process that had not loaded them already, those imports would
be most of a parse, many times what the DAG file itself costs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import Asset, AssetAlias, AssetAny, AssetWatcher, BaseOperator, Context
from airflow.sdk.module_loading import import_string

from delaywheel.config import Settings, load_settings
from delaywheel.lanes import EVERY_LANE, Lane, all_lanes, lane_name
from delaywheel.produce.validation import RETRY_PREFIX
from delaywheel.types import TopicSpan, add_spans, event_extra

from .connections import DEFAULT_CONN_ID, store_conn_id, topic_conn_ids, topic_stores
from .forms import form_moment

if TYPE_CHECKING:
    from delaywheel import Delivered, Message, Store

TOPICS_ALIAS = AssetAlias("delaywheel_topics")
ASSET_PREFIX = "delaywheel://topics/"


def topic_asset(topic: str) -> Asset:
    """The Asset a topic's deliveries update; schedule a consumer DAG on it. Characters outside
    A-Z a-z 0-9 . _ - (e.g. `%` and `|` of retry topics) are percent-encoded; name == uri, so
    `Asset(uri)` written by hand in a DAG names the same asset. Its watcher (`TopicMessagesTrigger`, in the
    triggerer) announces new messages within about a second; every DAG gets the same watcher for a topic.

    With several stores (docs/stores.md) the watcher is on the topic's store (its connection, `delaywheel_<store>`),
    named `delaywheel_topic_<topic>_<store>`; a moving topic gets one watcher per store that holds it, all on the
    same Asset: consumers do not care which store delivered."""
    from .triggers import TopicMessagesTrigger  # psycopg and the store's code: only when an Asset is made

    quoted = quote(topic, safe="")
    uri = ASSET_PREFIX + quoted
    watchers = [
        AssetWatcher(
            name=f"delaywheel_topic_{quoted}" if store is None else f"delaywheel_topic_{quoted}_{store}",
            trigger=TopicMessagesTrigger(topic, store_conn_id(store)),
        )
        for store in topic_stores(topic)
    ]
    return Asset(name=uri, uri=uri, group="delaywheel", watchers=watchers)


def consumer_schedule(topic: str, group: str) -> AssetAny:
    """What a consumer DAG of `group` on `topic` is scheduled on: the topic's Asset or the group's retry topic's
    (`%RETRY%<group>`), each with its watcher. A failed message comes back through the retry topic only; a DAG
    scheduled on `topic_asset(topic)` alone would wait for the next ordinary message to read it (for ever on a quiet
    topic). Pass it as the schedule itself (`schedule=consumer_schedule(...)`): a list of Assets means all of them."""
    return AssetAny(topic_asset(topic), topic_asset(RETRY_PREFIX + group))


def merge_extras(extras: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per topic, one extra spanning every lane's batch (`event_extra`s in, `lanes` instead of `lane` out)."""
    spans: dict[str, TopicSpan] = {}
    lanes: dict[str, set[str]] = {}
    for extra in extras:
        topic = extra["topic"]
        span = TopicSpan(
            extra["count"], (extra["first_xid"], extra["first_offset"]), (extra["last_xid"], extra["last_offset"])
        )
        add_spans(spans, {topic: span})
        lanes.setdefault(topic, set()).add(extra["lane"])
    return {topic: {"topic": topic, "lanes": sorted(lanes[topic]), **span.fields()} for topic, span in spans.items()}


class PublishTopicEventsOperator(BaseOperator):
    """Records one Asset event per topic for everything a DAG run's deliver tasks wrote (read from their
    return values), instead of one per task. Only this task touches the topic Assets: when many deliver
    tasks end at the same moment (a lease hand-over) and each records an event for a topic Airflow has not seen
    before, the API server creates the same AssetModel concurrently and fails the losers (a unique violation),
    although their deliveries committed.

    :param lane_task_ids: the task ids of the run's deliver tasks whose return values (``{"topics": {...}}``) are
        merged (not templated).

    By default its ``outlets`` are the ``delaywheel_topics`` alias and its ``trigger_rule`` is ``all_done``: a lane
    that failed after committing deliveries still has them announced. Returns the merged extra per topic.
    """

    ui_color = "#e8f4fb"

    def __init__(self, *, lane_task_ids: list[str], **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [TOPICS_ALIAS])
        kwargs.setdefault("trigger_rule", "all_done")  # a failed lane's committed deliveries still count
        super().__init__(**kwargs)
        self.lane_task_ids = lane_task_ids

    def execute(self, context: Context) -> dict[str, Any]:
        values = context["ti"].xcom_pull(task_ids=self.lane_task_ids, key="return_value") or []
        extras = [extra for value in values if isinstance(value, dict) for extra in value.get("topics", {}).values()]
        merged = merge_extras(extras)
        for topic, extra in sorted(merged.items()):
            context["outlet_events"][TOPICS_ALIAS].add(topic_asset(topic), extra=extra)
        self.log.info("recorded Asset events for %d topics from %d lanes", len(merged), len(values))
        return merged


def _run_again(log: Any, done: str) -> None:
    """End a try stopped by a signal as `up_for_reschedule`, due at once, not `success`. Airflow's task runner calls
    `on_kill` on SIGTERM and lets `execute` return: a lane or consumer task stopped with its scheduler (Airflow
    stopping or restarting) would succeed, and its lane or group would stay without a deliverer or consumer until the
    next scheduled run. Rescheduled, the next scheduler to run starts it again for what is left of its lease (or, its
    lease over, to hand over), and a reschedule uses up none of the task's retries. A try whose state Airflow already
    set (marked success or failed by hand, a timed-out run) stays as Airflow set it."""
    from airflow.sdk.exceptions import AirflowRescheduleException

    log.warning("stopped by a signal after %s: asking Airflow to run this task again (up_for_reschedule)", done)
    raise AirflowRescheduleException(datetime.now(UTC))


class _LeaseOperator(BaseOperator):
    """Runs the delivery loop on its lanes for a lease; subclasses say which lanes.

    With `align_lease_to_run` (the default) the lease ends `lease_seconds` after the DAG run's scheduled
    time (`run_after`), not after this task's start: every lane of a run hands over at the same moment,
    and a task that starts late (slow worker, retry) does not stretch the run. A task starting after that
    moment still gets `min_lease_seconds`. Without a DAG run (direct calls), the lease starts now.
    With `handover_grace_seconds`, a task whose lease ended keeps its lane (up to that much longer) until
    another deliverer of the lane is running: a successor killed at start-up leaves no gap while it retries.

    The lease arguments of `DeliverLevelOperator`, `AdvanceWheelOperator` and `DeliverAllLanesOperator`:

    :param lease_seconds: how long the task delivers, in seconds (templated; default 300).
    :param until_idle: stop, before the lease end, once nothing is pending on its lanes (templated; rendered text
        "true"/"1"/"yes"/"on" is true; default False): a drain-and-stop run.
    :param handover_grace_seconds: past its lease, keep the lane up to this much longer until another deliverer
        of it is running (templated; default 0.0: stop at the lease end whatever happens).
    :param align_lease_to_run: count the lease from the DAG run's scheduled time rather than the task's start
        (not templated; default True).
    :param min_lease_seconds: the least a task starting after its run's lease end still delivers for, in seconds
        (not templated; default 10.0; at most `lease_seconds`).
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default ``delaywheel_default``).
    :param emit_asset_events: record one Asset event per topic delivered into, through the ``delaywheel_topics``
        alias, when the task ends (not templated; default True). The deliver DAG turns it off and records them
        once per run in `PublishTopicEventsOperator`.

    Returns the lanes' totals (``delivered``, ``passes``, ``reconnects``..., ``per_lane``) and per topic the span
    delivered. A try stopped by SIGTERM (`on_kill`: Airflow stopping) ends after its current pass as
    ``up_for_reschedule``, due at once, so that the next scheduler runs it again; it returns nothing, and its
    deliveries are announced by the topics' watchers only.
    """

    template_fields: tuple[str, ...] = ("lease_seconds", "until_idle", "handover_grace_seconds", "delaywheel_conn_id")
    ui_color = "#d9f0e3"

    def __init__(
        self,
        *,
        lease_seconds: float | str = 300,
        until_idle: bool | str = False,
        handover_grace_seconds: float | str = 0.0,
        align_lease_to_run: bool = True,
        min_lease_seconds: float = 10.0,
        delaywheel_conn_id: str = DEFAULT_CONN_ID,
        emit_asset_events: bool = True,
        **kwargs: Any,
    ) -> None:
        if emit_asset_events:
            kwargs.setdefault("outlets", [TOPICS_ALIAS])
        super().__init__(**kwargs)
        self.lease_seconds = lease_seconds
        self.until_idle = until_idle
        self.handover_grace_seconds = handover_grace_seconds
        self.align_lease_to_run = align_lease_to_run
        self.min_lease_seconds = min_lease_seconds
        self.delaywheel_conn_id = delaywheel_conn_id
        self.emit_asset_events = emit_asset_events
        self._stop: threading.Event | None = None
        self._killed = False

    def lanes(self, settings: Settings) -> list[Lane]:
        """The lanes this task serves, checked against the store's level table."""
        raise NotImplementedError

    def lease_left(self, context: Context) -> float:
        """Seconds this task should deliver for (see the class docstring)."""
        return _lease_left(context, float(self.lease_seconds), self.align_lease_to_run, self.min_lease_seconds)

    def execute(self, context: Context) -> dict[str, Any]:
        from delaywheel.deliver import runner

        from .hooks import DelayWheelHook

        lease = self.lease_left(context)
        self._stop = threading.Event()
        if self._killed:  # SIGTERM came while the task was starting
            self._stop.set()
        with DelayWheelHook(self.delaywheel_conn_id).get_store() as store:
            lanes = self.lanes(store.settings)
            name = lane_name(lanes[0]) if len(lanes) == 1 else EVERY_LANE
            self.log.info("delivering on %s for a lease of %.1fs", ", ".join(map(lane_name, lanes)), lease)
            totals = runner.run(
                store,
                lanes,
                lease,
                stop=self._stop,
                until_idle=_truthy(self.until_idle),
                handover_grace_s=float(self.handover_grace_seconds),
                progress=lambda t: self.log.info(
                    "delivered %d in %d passes (%d busy, %d waited for the lane)",
                    t.delivered,
                    t.passes,
                    t.busy_passes,
                    t.waited_passes,
                ),
            )
        if self._killed:
            _run_again(self.log, f"delivering {totals.delivered}")
        if self.emit_asset_events:
            for topic, span in sorted(totals.per_topic.items()):
                context["outlet_events"][TOPICS_ALIAS].add(topic_asset(topic), extra=event_extra(topic, name, span))
        return {
            "lane": name,
            "lease_seconds": lease,
            "stopped_early": self._stop.is_set(),
            "delivered": totals.delivered,
            "skipped_cancelled": totals.skipped_cancelled,
            "passes": totals.passes,
            "busy_passes": totals.busy_passes,
            "waited_passes": totals.waited_passes,  # found its lane or both turns held (cancels' waits) and waited
            "reconnects": totals.reconnects,  # connections lost (a PostgreSQL restart) and made again
            "per_lane": totals.per_lane,  # delivered per lane name
            "topics": {t: event_extra(t, name, s) for t, s in sorted(totals.per_topic.items())},
        }

    def on_kill(self) -> None:
        """SIGTERM: stop after the current pass (it commits or rolls back as a whole); `execute` then asks Airflow
        to run the task again."""
        self._killed = True
        if self._stop is not None:
            self._stop.set()


class DeliverLevelOperator(_LeaseOperator):
    """Deliver one delay level (RocketMQ's per-level DeliverDelayedMessageTimerTask) for a lease.

    :param level: the delay level, 1..N of the store's settings (templated; rendered text is read as an integer;
        a level outside 1..N fails the task before it delivers anything).

    The other arguments are the lease's, documented on `_LeaseOperator`.
    """

    template_fields = (*_LeaseOperator.template_fields, "level")

    def __init__(self, *, level: int | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.level = level

    def lanes(self, settings: Settings) -> list[Lane]:
        level = int(self.level)
        if not 1 <= level <= settings.max_level:
            raise ValueError(f"level {level} is not configured (1..{settings.max_level})")
        return [level]


class AdvanceWheelOperator(_LeaseOperator):
    """Advance the timing wheel (deliver every due slot, roll far blocks in) for a lease.

    Its arguments are the lease's, documented on `_LeaseOperator`.
    """

    def lanes(self, settings: Settings) -> list[Lane]:
        return [None]


class DeliverAllLanesOperator(_LeaseOperator):
    """Deliver every configured level and advance the wheel for a lease, in one task: one delivery loop, as
    `delaywheel deliver` runs it, that passes whichever lane falls due next.

    The deliver DAG uses it with `[delaywheel] deliver_tasks = one`: a run then starts one task, not one per lane.
    On a small machine that start is what a lease hand-over costs everyone else (dags/delaywheel_deliver.py).
    Its Asset event extras name the lane ``every lane``; ``per_lane`` in its result counts each lane's deliveries.

    Its arguments are the lease's, documented on `_LeaseOperator`.
    """

    def lanes(self, settings: Settings) -> list[Lane]:
        return all_lanes(settings)


class ConsumeOperator(BaseOperator):
    """A long-running consumer: holds `group` on `topic` for a lease, waiting on the topic's notifications
    (`Store.consume`), and hands the group over to the next run's task at the lease end. Tasks in different member
    slots (`slot`) consume the group side by side, each handing over to the next run's task of its slot.

    The handler, as the Kafka provider's ``ConsumeFromTopicOperator`` takes it: exactly one of

    :param apply_function_batch: a callable, or its dotted import path (``"my_pkg.handlers.handle"``), called as
        ``fn(messages, **apply_function_kwargs)`` with each batch (a list of ``delaywheel.Delivered``); it
        returns None (all handled) or the ``message_id``s that failed, which go to the retry ladder. An exception
        retries the whole batch; ``delaywheel.consume.consumer.Abandon`` stops without acking it. Not templated; a
        path is imported when the task starts, so a wrong one fails the task before it takes the group.
    :param apply_function: the same, called once per message as ``fn(message, **apply_function_kwargs)``; a message
        whose call raises goes to the retry ladder, the others are acked (not templated).

    or a subclass overriding ``handle(messages, context)`` (same contract as ``apply_function_batch``).

    :param topic: the topic to consume (templated).
    :param group: the consumer group (templated): its offset is the group's, whichever task or run acks it.
    :param apply_function_kwargs: keyword arguments for the function (templated, each value rendered; default none).
    :param lease_seconds: how long this task consumes, in seconds (templated; default 300). Counted from the DAG
        run's scheduled time (`run_after`) with `align_lease_to_run`, as the deliver lanes do, so a run scheduled every
        N seconds with a lease of N + overlap has its successor running before it lets go.
    :param handover_grace_seconds: past its lease, keep the group up to this much longer until another lease
        consumer of (group, topic) is running (templated; default 0.0): a successor that failed at start-up leaves no
        gap while Airflow retries it. 0: stop at the lease end whatever happens.
    :param align_lease_to_run: count the lease from the DAG run's scheduled time rather than the task's start (not
        templated; default True).
    :param min_lease_seconds: the least a task starting after its run's lease end still consumes for, in seconds
        (not templated; default 10.0; at most `lease_seconds`).
    :param max_messages: the batch size and prefetch bound (templated; default 100).
    :param tags: the group's tag filter, RocketMQ's ``TAG1 || TAG2`` (templated; default None or blank: ``*``, every
        message): the topic's messages with another tag are not handed over, and the group's offset passes them.
        Checked when the task starts, before it takes the group.
    :param start: where the group starts if it has no offset on the topic yet (templated): ``earliest`` (the default,
        every message kept), ``latest`` (messages delivered from the first pull on) or an ISO 8601 time (UTC if it
        names no zone; the first message delivered at or after it).
    :param slot: this task's member slot, 0..15 (templated; rendered text is read as an integer; default 0): N tasks
        of a group in slots 0..N-1 consume side by side, sharing its queues; a task hands over to its slot's next
        task only. Map it (``ConsumeOperator.partial(...).expand(slot=[0, 1])``, as the lease template does). A slot
        outside 0..15 fails the task before it takes anything.
    :param until_idle: stop once a safety wake (`consume.SAFETY_WAKE_S`, 1 s) passes with nothing delivered
        (templated; as the deliver lanes' `until_idle`; default False): a drain-and-stop run handles what is
        delivered now and ends, without waiting for its turn behind a lease consumer.
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default None: the topic's store's,
        ``delaywheel_<store>`` with several stores configured (docs/stores.md), else ``delaywheel_default``; chosen
        when the task starts, from the rendered topic). A moving topic is read from its current store; its old
        store's messages need a second task with that store's connection given here (`hooks.topic_conn_ids` lists
        them).

    Hand-over (`consume.lease.LeasedConsumer`, which `execute` runs): a batch is handled under its queues' leases
    (`consume.topics`: members of a group share its queues, one key per queue), so during the overlap of two runs
    nothing is handled twice, and when the old task stops (its batch in hand acked, its queues given back) the new
    one takes them. A lease consumer waits for its turn before it consumes at all (an exclusive advisory lock on
    (group, topic, slot), `CONSUMER_TURN_LOCK`, held while it consumes): the server grants it the moment the old
    task of its slot lets go, so the new one pulls within milliseconds. Every lease consumer also holds a shared
    "presence" advisory lock on (group, topic, slot) for its lifetime, which the grace above looks for. SIGTERM
    (`on_kill`) stops the same way: the handler finishes its batch, the batch is acked, the task returns.

    During `execute`, `self.store` is the consumer's `Store`: a ``handle`` override may run its own transaction on
    ``self.store.conn`` (the consumer's session, idle between the pull and the ack), so that a business
    write costs no second connection.

    Returns ``{"handled", "acked", "retried", "reconnects", "slot", ...}``: messages handed to the handler, messages
    covered by committed acks, sent to the retry ladder, lost connections made again, the task's slot.
    """

    template_fields: tuple[str, ...] = (
        "topic",
        "group",
        "apply_function_kwargs",
        "lease_seconds",
        "handover_grace_seconds",
        "max_messages",
        "tags",
        "start",
        "slot",
        "until_idle",
        "delaywheel_conn_id",
    )
    template_fields_renderers = {"apply_function_kwargs": "py"}
    ui_color = "#fdf1dc"

    def __init__(
        self,
        *,
        topic: str,
        group: str,
        apply_function: Callable[..., Any] | str | None = None,
        apply_function_batch: Callable[..., Any] | str | None = None,
        apply_function_kwargs: dict[str, Any] | None = None,
        lease_seconds: float | str = 300,
        handover_grace_seconds: float | str = 0.0,
        align_lease_to_run: bool = True,
        min_lease_seconds: float = 10.0,
        max_messages: int | str = 100,
        tags: str | None = None,
        start: datetime | str = "earliest",
        slot: int | str = 0,
        until_idle: bool | str = False,
        delaywheel_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        overridden = type(self).handle is not ConsumeOperator.handle
        if sum((apply_function is not None, apply_function_batch is not None, overridden)) != 1:
            raise ValueError(
                "ConsumeOperator needs exactly one handler: apply_function, apply_function_batch, "
                "or a subclass overriding handle()"
            )
        self.topic, self.group = topic, group
        self.apply_function, self.apply_function_batch = apply_function, apply_function_batch
        self.apply_function_kwargs = apply_function_kwargs
        self.lease_seconds = lease_seconds
        self.handover_grace_seconds = handover_grace_seconds
        self.align_lease_to_run = align_lease_to_run
        self.min_lease_seconds = min_lease_seconds
        self.max_messages = max_messages
        self.tags, self.start = tags, start
        self.slot = slot
        self.until_idle = until_idle
        self.delaywheel_conn_id = delaywheel_conn_id
        self.store: Store | None = None
        self._stop: threading.Event | None = None
        self._killed = False
        self._fn: Callable[..., Any] | None = None

    def handle(self, messages: list[Delivered], context: Context) -> Collection[int] | None:
        """Handle one batch; return None or the ids that failed. Override this, or pass a function."""
        from delaywheel.consume.consumer import Abandon  # loaded by `execute` already: a dictionary lookup

        kwargs = dict(self.apply_function_kwargs or {})
        assert self._fn is not None
        if self.apply_function_batch is not None:
            return self._fn(messages, **kwargs)
        failed = []
        for message in messages:
            try:
                self._fn(message, **kwargs)
            except Abandon:
                raise
            except Exception:
                self.log.exception(
                    "apply_function failed on message %s; it goes to the retry ladder", message.message_id
                )
                failed.append(message.message_id)
        return failed

    def execute(self, context: Context) -> dict[str, Any]:
        from delaywheel.consume.consumer import SAFETY_WAKE_S
        from delaywheel.consume.lease import LeasedConsumer, checked_slot
        from delaywheel.consume.position import start_target
        from delaywheel.consume.tags import parse

        from .hooks import DelayWheelHook

        slot = checked_slot(self.slot)
        fn = self.apply_function_batch if self.apply_function_batch is not None else self.apply_function
        self._fn = import_string(fn) if isinstance(fn, str) else fn  # a wrong path fails before taking the group
        tags = None if self.tags is None or _blank(self.tags) else self.tags
        parse(tags)  # a bad filter or start fails the task before it takes the group
        start = form_moment(self.start, ("earliest", "latest"), "start")
        start_target(start)
        lease = _lease_left(context, float(self.lease_seconds), self.align_lease_to_run, self.min_lease_seconds)
        grace = float(self.handover_grace_seconds)
        self._stop = stop = threading.Event()
        if self._killed:  # SIGTERM came while the task was starting
            stop.set()
        handled = 0

        def handler(messages: list[Delivered]) -> Collection[int] | None:
            nonlocal handled
            handled += len(messages)
            return self.handle(messages, context)

        idle_s = SAFETY_WAKE_S if _truthy(self.until_idle) else None
        conn_id = self.delaywheel_conn_id or topic_conn_ids(self.topic)[0]
        with DelayWheelHook(conn_id).get_store() as store:
            self.store = store
            leased = LeasedConsumer(
                store, self.topic, self.group, lease_s=lease, grace_s=grace, slot=slot, stop=stop, log=self.log
            )
            self.log.info(
                "consuming %s as group %s, slot %d, for a lease of %.1fs (grace %.1fs%s)",
                self.topic,
                self.group,
                slot,
                lease,
                grace,
                ", until idle" if idle_s else "",
            )
            try:
                totals = leased.run(handler, max_messages=int(self.max_messages), idle_s=idle_s, tags=tags, start=start)
            finally:
                self.store = None
        result = {
            "topic": self.topic,
            "group": self.group,
            "slot": slot,
            "lease_seconds": lease,
            "stopped_early": self._killed,
            "stopped_by": "kill" if self._killed else "lease" if leased.lease_ended else totals.stopped_by,
            "handed_over": leased.handed_over,  # a successor was seen running at the lease end
            "handled": handled,
            "acked": totals.messages,
            "retried": totals.retried,
            "reconnects": totals.reconnects,
            "batches": totals.batches,
            "handler_errors": totals.handler_errors,
            "already_acked": totals.already_acked,
            "skipped": totals.skipped,  # read and passed: their tag is not the group's
            "sought": totals.sought,  # in batches read before a seek of the topic: not acked (the seek's position stands)
            "busy_pulls": totals.busy,
            "repulls": totals.repulls,  # pulls that found rows past the offset not yet readable (commit horizon)
        }
        self.log.info("consumed: %s", result)
        if self._killed:
            _run_again(self.log, f"handling {handled}")
        return result

    def on_kill(self) -> None:
        """SIGTERM: the handler finishes its batch, the batch is acked, its queues given back; `execute` then asks
        Airflow to run the task again."""
        self._killed = True
        if self._stop is not None:
            self._stop.set()


class EnqueueOperator(BaseOperator):
    """Send messages: one (`topic`, `body`, ...) or many (`messages`, dicts with the same keys).

    Every argument is templated: rendered text is read as the type named (``"3"`` as a level, ``"3600"`` as
    seconds, ISO 8601 text as a time); an empty rendering of a delay argument means "not given".

    :param topic: the topic of the one message (templated). Exactly one of `topic` and `messages`.
    :param body: its body, JSON-serialisable or bytes (templated; default None).
    :param messages: many messages (templated): a list of dicts with the keys ``topic``, ``body``, ``delay_level``,
        ``delay_seconds``, ``deliver_at``, ``key``, ``tags``, ``properties``; any other key fails the task. A Jinja
        string renders to text, so a list built in a template needs the DAG's ``render_template_as_native_obj``.
    :param delay_level: the delay level, 1..N (templated; default None).
    :param delay_seconds: a delay in seconds, on the timing wheel (templated; default None).
    :param deliver_at: a due time, a datetime or ISO 8601 text (templated; default None). At most one of
        `delay_level`, `delay_seconds` and `deliver_at`; none: delivered at once.
    :param key: the business key, which cancels by key find (templated; default None).
    :param tags: a tag string carried with the message (templated; default None).
    :param properties: string properties carried with the message (templated, each value rendered; default none).
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default None: with several stores
        configured (docs/stores.md), each message goes to its topic's store, on that store's connection
        ``delaywheel_<store>``, as `routing.Stores.send_many` sends; else ``delaywheel_default``).

    All or nothing in each store: one invalid message fails the task and nothing is written; a batch spanning
    stores that fails in one store after another committed raises `routing.SendManyError`, saying which went in.
    Returns the message ids (with several stores, each its store's: docs/stores.md, "Ids are per store").
    """

    template_fields = (
        "topic",
        "body",
        "messages",
        "delay_level",
        "delay_seconds",
        "deliver_at",
        "key",
        "tags",
        "properties",
        "delaywheel_conn_id",
    )

    def __init__(
        self,
        *,
        topic: str | None = None,
        body: Any = None,
        messages: list[dict[str, Any]] | str | None = None,
        delay_level: int | str | None = None,
        delay_seconds: float | str | None = None,
        deliver_at: datetime | str | None = None,
        key: str | None = None,
        tags: str | None = None,
        properties: dict[str, str] | None = None,
        delaywheel_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (topic is None) == (messages is None):
            raise ValueError("EnqueueOperator needs exactly one of topic=... (one message) or messages=[...]")
        self.topic, self.body, self.messages = topic, body, messages
        self.delay_level, self.delay_seconds, self.deliver_at = delay_level, delay_seconds, deliver_at
        self.key, self.tags, self.properties = key, tags, properties
        self.delaywheel_conn_id = delaywheel_conn_id

    def _items(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            if not isinstance(self.messages, list):
                raise TypeError(f"messages must render to a list of dicts, got {type(self.messages).__name__}")
            return self.messages
        return [
            {
                "topic": self.topic,
                "body": self.body,
                "delay_level": self.delay_level,
                "delay_seconds": self.delay_seconds,
                "deliver_at": self.deliver_at,
                "key": self.key,
                "tags": self.tags,
                "properties": self.properties,
            }
        ]

    def execute(self, context: Context) -> list[int]:
        from delaywheel.routing import Stores

        from .hooks import DelayWheelHook

        batch = [_message(item) for item in self._items()]
        settings = load_settings()
        if self.delaywheel_conn_id is None and settings.stores:  # routed by topic, on each store's connection
            urls = [(name, DelayWheelHook(store_conn_id(name)).url) for name, _ in settings.stores]
            with Stores(urls, settings) as stores:
                ids = stores.send_many(batch)
        else:
            with DelayWheelHook(self.delaywheel_conn_id or DEFAULT_CONN_ID).get_store() as store:
                ids = store.send_many(batch)
        self.log.info("enqueued %d message(s), ids %s..%s", len(ids), ids[0] if ids else "-", ids[-1] if ids else "-")
        return ids


def _blank(value: object) -> bool:
    return isinstance(value, str) and not value.strip()


def _message(item: dict[str, Any]) -> Message:
    from delaywheel import Message

    unknown = set(item) - {"topic", "body", "delay_level", "delay_seconds", "deliver_at", "key", "tags", "properties"}
    if unknown:
        raise ValueError(f"unknown message field(s) {sorted(unknown)}")
    level, seconds, at = item.get("delay_level"), item.get("delay_seconds"), item.get("deliver_at")
    # A delay field given but blank (a form field or template left empty) is refused, never read as "no delay": for
    # an order's timeout that would mean "cancel now". Level 0 is no delay only when written as 0.
    blank = [name for name, v in (("delay_level", level), ("delay_seconds", seconds), ("deliver_at", at)) if _blank(v)]
    if blank:
        raise ValueError(f"{', '.join(blank)} given but blank: leave the field out, or write 0 for no delay")
    return Message(
        topic=item.get("topic"),  # type: ignore[arg-type]  # validated by the store, with a clear error
        body=item.get("body"),
        delay_level=None if level is None else int(level),
        delay=None if seconds is None else timedelta(seconds=float(seconds)),
        deliver_at=datetime.fromisoformat(at) if isinstance(at, str) else at,
        key=item.get("key") or None,
        tags=item.get("tags") or None,
        properties=dict(item.get("properties") or {}),
    )


class CancelOperator(BaseOperator):
    """Cancel pending messages by `message_id`, `key`, `keys` (list) or `where`: exactly one of the four.

    :param message_id: one message's id (templated; rendered text is read as an integer).
    :param key: every pending message with this business key (templated).
    :param keys: every pending message with one of these keys (templated; a list, or one key as a string).
    :param where: one boolean expression over id, deliver_at, key, topic, tags, properties, lane, level, checked by
        PostgreSQL's own parser against a whitelist and rendered from its parse tree (`delaywheel.ops.predicate`): no
        subquery, no function outside the whitelist, never more than that expression; matching reads READ ONLY.
        Text that is not such an expression fails the task with `UnsafeSQL` and cancels nothing (templated).
    :param reason: recorded with each cancellation (templated; default "cancelled from Airflow").
    :param max_matches: guards bulk cancels by `keys` or `where`: if more pending messages match, the task fails
        and cancels nothing (templated; rendered text is read as an integer; default None: no limit).
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default ``delaywheel_default``).

    Returns `{"cancelled": n, "results": [...]}` (results per message for id/key).
    """

    template_fields = ("message_id", "key", "keys", "where", "reason", "max_matches", "delaywheel_conn_id")

    def __init__(
        self,
        *,
        message_id: int | str | None = None,
        key: str | None = None,
        keys: list[str] | str | None = None,
        where: str | None = None,
        reason: str = "cancelled from Airflow",
        max_matches: int | str | None = None,
        delaywheel_conn_id: str = DEFAULT_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sum(x is not None for x in (message_id, key, keys, where)) != 1:
            raise ValueError("CancelOperator needs exactly one of message_id, key, keys, where")
        self.message_id, self.key, self.keys, self.where = message_id, key, keys, where
        self.reason, self.max_matches = reason, max_matches
        self.delaywheel_conn_id = delaywheel_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        from .hooks import DelayWheelHook

        with DelayWheelHook(self.delaywheel_conn_id).get_store() as store:
            if self.message_id is not None or self.key is not None:
                results = store.cancel(
                    message_id=None if self.message_id is None else int(self.message_id),
                    key=self.key,
                    reason=self.reason,
                )
                summary = {
                    "cancelled": sum(r.outcome == "cancelled" for r in results),
                    "results": [{"message_id": r.message_id, "outcome": r.outcome} for r in results],
                }
            else:
                keys = [self.keys] if isinstance(self.keys, str) else self.keys
                if self.max_matches not in (None, ""):
                    matching = store.count_matching(keys=keys, where=self.where)
                    if matching > int(self.max_matches):
                        raise ValueError(
                            f"{matching} pending messages match, more than max_matches={self.max_matches};"
                            " nothing cancelled"
                        )
                summary = {
                    "cancelled": store.cancel_matching(keys=keys, where=self.where, reason=self.reason),
                    "results": [],
                }
        self.log.info("cancelled %d message(s)", summary["cancelled"])
        return summary


class SeekOperator(BaseOperator):
    """Move a consumer group's offset on a topic (`Store.seek`), recorded in ``delaywheel.group_seeks``: backwards,
    the group is handed its messages again (after a bug); forwards, it skips them. The form of the
    ``delaywheel_group_seek`` DAG drives it.

    :param topic: the topic (templated); the group's retry topic is not moved unless named here (``%RETRY%<group>``).
    :param group: the consumer group (templated); it must have an offset on the topic (a new group starts where its
        consumer's ``start`` says).
    :param to: what to seek to (templated): ``time`` (`to_time`), ``offset`` (`to_offset`), ``earliest`` (the earliest
        message kept) or ``latest`` (past every message delivered); None: whichever of `to_time` and `to_offset` is
        given.
    :param to_time: with ``time``: the first message delivered at or after this ISO 8601 time (UTC if it names no
        zone) or datetime (templated; default None).
    :param to_offset: with ``offset``: the first message at or past this queue_offset (templated; default None).
    :param by: who or why, recorded with the seek (templated; default None or blank: the run's triggering user, DAG
        and run).
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default None: with several stores
        configured, each store that holds the topic, on its connection ``delaywheel_<store>``; else
        ``delaywheel_default``).

    A blank field counts as not given. Bad or contradictory fields, an unknown group or topic fail the task with the
    reason and move nothing. Returns what moved: ``{"topic", "group", "target", "by", "at", "moves": [{"from",
    "to"}]}``, with ``store`` added per store when several are configured (then a list).
    """

    template_fields = ("topic", "group", "to", "to_time", "to_offset", "by", "delaywheel_conn_id")
    ui_color = "#f3e5f5"

    def __init__(
        self,
        *,
        topic: str,
        group: str,
        to: str | None = None,
        to_time: datetime | str | None = None,
        to_offset: int | str | None = None,
        by: str | None = None,
        delaywheel_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.topic, self.group = topic, group
        self.to, self.to_time, self.to_offset = to, to_time, to_offset
        self.by = by
        self.delaywheel_conn_id = delaywheel_conn_id

    def target(self) -> dict[str, Any]:
        """`Store.seek`'s target arguments from the fields, checked: ValueError with the reason."""
        to = None if self.to is None or _blank(self.to) else str(self.to).strip()
        at = None if self.to_time is None or _blank(self.to_time) else self.to_time
        offset = None if self.to_offset is None or _blank(self.to_offset) else self.to_offset
        if to is None:
            to = "time" if at is not None and offset is None else "offset" if offset is not None and at is None else ""
            if not to:
                raise ValueError("seek: give exactly one of to_time and to_offset, or to = earliest or latest")
        if to not in ("time", "offset", "earliest", "latest"):
            raise ValueError(f"seek: to must be time, offset, earliest or latest, not {to!r}")
        extra = [
            name for name, value in (("to_time", at), ("to_offset", offset)) if value is not None and name != f"to_{to}"
        ]
        if extra:
            raise ValueError(f"seek: to = {to} takes no {' or '.join(extra)}; leave it empty")
        if to == "time":
            if at is None:
                raise ValueError("seek: to = time needs to_time, an ISO 8601 time")
            return {"to_time": form_moment(at, (), "to_time")}
        if to == "offset":
            if offset is None:
                raise ValueError("seek: to = offset needs to_offset, a queue_offset")
            if isinstance(offset, bool) or not (isinstance(offset, int) or str(offset).strip().isdigit()):
                raise ValueError(f"seek: to_offset must be a whole number (a queue_offset), not {offset!r}")
            return {"to_offset": int(offset)}
        return {"to": to}

    def execute(self, context: Context) -> dict[str, Any] | list[dict[str, Any]]:
        from delaywheel.routing import Stores

        from .hooks import DelayWheelHook

        target = self.target()
        by = self.by if self.by is not None and not _blank(self.by) else _triggered_by(context)
        settings = load_settings()
        if self.delaywheel_conn_id is None and settings.stores:
            urls = [(name, DelayWheelHook(store_conn_id(name)).url) for name, _ in settings.stores]
            with Stores(urls, settings) as stores:
                done = stores.seek(self.topic, self.group, by=by, **target)
            result: dict[str, Any] | list[dict[str, Any]] = [
                {"store": name, **seeked.as_dict()} for name, seeked in done.items()
            ]
        else:
            with DelayWheelHook(self.delaywheel_conn_id or DEFAULT_CONN_ID).get_store() as store:
                result = store.seek(self.topic, self.group, by=by, **target).as_dict()
        self.log.info("seek of group %s on %s: %s", self.group, self.topic, result)
        return result


def _triggered_by(context: Context) -> str:
    """Who a seek from Airflow is recorded as, when the form names no one: the run's triggering user, DAG and run."""
    run = context.get("dag_run")
    user = getattr(run, "triggering_user_name", None) or "unknown user"
    return f"{user} (Airflow {getattr(run, 'dag_id', '?')}, {getattr(run, 'run_id', '?')})"[:200]


def _lease_left(context: Context, lease: float, align: bool, min_lease: float) -> float:
    """Seconds left of a lease of `lease` seconds counted from the DAG run's scheduled time (`run_after`) when
    `align`, else from now; a task starting after that moment still gets `min_lease` (at most `lease`)."""
    run_after = getattr(context.get("dag_run"), "run_after", None) if align else None
    if run_after is None:
        return lease
    left = (run_after + timedelta(seconds=lease) - datetime.now(UTC)).total_seconds()
    return max(left, min(min_lease, lease))


def _truthy(value: bool | str) -> bool:
    """A templated flag: Jinja renders `{{ params.x }}` to 'True'/'False' strings."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")
