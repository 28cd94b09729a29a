"""The operators' execute() against the real store: two deliverers on one level never duplicate,
on_kill (what Airflow's SIGTERM handler calls) ends a lease cleanly and asks Airflow to run the task again, enqueue and
cancel work."""

from __future__ import annotations

import inspect
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from delaywheel import Store
from tests.helpers import deliveries

pytestmark = pytest.mark.airflow


def context() -> dict[str, Any]:
    """What execute() reads from Airflow's context: the outlet events accessor (Airflow's own class)."""
    from airflow.sdk.execution_time.context import OutletEventAccessors

    return {"outlet_events": OutletEventAccessors()}


def alias_events(ctx: dict[str, Any]) -> list[Any]:
    from delaywheel.airflow.operators import TOPICS_ALIAS

    return ctx["outlet_events"][TOPICS_ALIAS].asset_alias_events


def test_two_deliverers_of_one_level_started_together_never_duplicate(store_connection: str, store: Store) -> None:
    from delaywheel.airflow.operators import DeliverLevelOperator

    now = store.clock()
    ids = [store.send("orders", {"n": n}, delay_level=1, now=now - timedelta(seconds=5)) for n in range(150)]
    operators = [DeliverLevelOperator(task_id=f"deliver_{i}", level=1, lease_seconds=4) for i in range(2)]
    contexts = [context(), context()]
    results: dict[int, dict[str, Any]] = {}
    start = threading.Barrier(3)

    def work(i: int) -> None:
        start.wait()
        results[i] = operators[i].execute(contexts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    start.wait()
    ids += [store.send("orders", {"n": n}, delay_level=1) for n in range(150, 160)]  # due during the leases
    for t in threads:
        t.join(60)
    delivered = [d[0] for d in deliveries(store, "orders")]
    assert sorted(delivered) == sorted(ids)  # every message once: none lost, none twice
    assert all(d[2] >= d[1] for d in deliveries(store))  # never early
    assert results[0]["delivered"] + results[1]["delivered"] == len(ids)
    counts = [e.extra["count"] for ctx in contexts for e in alias_events(ctx)]
    assert sum(counts) == len(ids)  # the Asset events account for each delivery once
    assert {e.dest_asset_key.uri for ctx in contexts for e in alias_events(ctx)} == {"delaywheel://topics/orders"}


def test_on_kill_ends_the_lease_after_the_current_pass_and_asks_airflow_to_run_the_task_again(
    store_connection: str, store: Store
) -> None:
    """SIGTERM (Airflow stopping) ends the try after its current pass as up_for_reschedule, due at once: a try that
    returned would end `success` and leave its lane without a deliverer until the next scheduled run."""
    from airflow.sdk.exceptions import AirflowRescheduleException

    from delaywheel.airflow.operators import DeliverLevelOperator

    now = store.clock()
    ids = [store.send("a|b%c", n, delay_level=2, now=now - timedelta(seconds=6)) for n in range(20)]
    operator = DeliverLevelOperator(task_id="deliver_2", level=2, lease_seconds=600)
    ctx = context()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            operator.execute(ctx)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while len(deliveries(store)) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    operator.on_kill()
    thread.join(30)
    assert not thread.is_alive()
    (exc,) = raised
    assert isinstance(exc, AirflowRescheduleException) and exc.reschedule_date <= store.clock()
    assert sorted(d[0] for d in deliveries(store)) == sorted(ids)  # each once, the last pass committed
    assert alias_events(ctx) == []  # a try Airflow runs again records no event (the topic's watcher announces)

    # killed while starting (before execute made its stop event): it delivers nothing and asks again at once
    early = DeliverLevelOperator(task_id="deliver_2", level=2, lease_seconds=600)
    early.on_kill()
    started = time.monotonic()
    with pytest.raises(AirflowRescheduleException):
        early.execute(context())
    assert time.monotonic() - started < 15


def test_a_lease_that_ends_records_one_asset_event_per_topic_spanning_its_deliveries(
    store_connection: str, store: Store
) -> None:
    from delaywheel.airflow.operators import DeliverLevelOperator

    now = store.clock()
    ids = [store.send("a|b%c", n, delay_level=2, now=now - timedelta(seconds=6)) for n in range(20)]
    ctx = context()
    result = DeliverLevelOperator(task_id="deliver_2", level=2, lease_seconds=3).execute(ctx)
    assert not result["stopped_early"] and result["delivered"] == len(ids)
    assert sorted(d[0] for d in deliveries(store)) == sorted(ids)
    (event,) = alias_events(ctx)
    assert event.dest_asset_key.uri == "delaywheel://topics/a%7Cb%25c"
    assert event.extra["topic"] == "a|b%c" and event.extra["count"] == len(ids) and event.extra["lane"] == "level 2"
    offsets = store.conn.execute(
        "SELECT min(queue_offset), max(queue_offset) FROM delaywheel.topic_messages"
    ).fetchone()
    assert (event.extra["first_offset"], event.extra["last_offset"]) == tuple(offsets)


def test_enqueue_and_cancel_operators(store_connection: str, store: Store) -> None:
    from delaywheel.airflow.operators import CancelOperator, EnqueueOperator

    (one,) = EnqueueOperator(task_id="one", topic="orders", body={"order": 1}, delay_level="3", key="o-1").execute({})
    many = EnqueueOperator(
        task_id="many",
        messages=[
            {"topic": "orders", "body": "a", "delay_seconds": "3600", "key": "o-2"},
            {"topic": "orders", "body": "b", "delay_seconds": 3600, "key": "o-3"},
        ],
    ).execute({})
    assert len(many) == 2
    with pytest.raises(Exception, match="topic"):
        EnqueueOperator(task_id="bad", topic="", body="x").execute({})
    # a delay given but blank (a field left empty) is refused, never "no delay": for a timeout, "cancel now"
    for blank in ({"delay_level": ""}, {"delay_seconds": " "}, {"deliver_at": ""}):
        with pytest.raises(ValueError, match="given but blank"):
            EnqueueOperator(task_id="blank", messages=[{"topic": "orders", "body": "c", **blank}]).execute({})
    with pytest.raises(ValueError, match="delay_level given but blank"):
        EnqueueOperator(task_id="blank", topic="orders", body="c", delay_level="").execute({})
    assert not deliveries(store, "orders")
    assert CancelOperator(task_id="c1", message_id=str(one)).execute({})["results"] == [
        {"message_id": one, "outcome": "cancelled"}
    ]
    with pytest.raises(ValueError, match="max_matches"):
        CancelOperator(task_id="c2", keys=["o-2", "o-3"], max_matches=1).execute({})
    assert CancelOperator(task_id="c3", where="key = 'o-2'").execute({})["cancelled"] == 1
    assert CancelOperator(task_id="c4", key="o-3").execute({})["cancelled"] == 1
    assert store.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone()[0] == 3


def test_merged_topic_events_span_every_lane_in_read_order() -> None:
    from delaywheel.airflow.operators import merge_extras

    def extra(lane: str, count: int, first: tuple[str, int], last: tuple[str, int]) -> dict[str, Any]:
        return {
            "topic": "orders",
            "lane": lane,
            "count": count,
            "first_xid": first[0],
            "first_offset": first[1],
            "last_xid": last[0],
            "last_offset": last[1],
        }

    # xids compare as numbers: "10" comes after "9"
    merged = merge_extras([extra("level 2", 3, ("10", 7), ("10", 9)), extra("wheel", 2, ("9", 8), ("11", 1))])
    assert merged == {
        "orders": {
            "topic": "orders",
            "lanes": ["level 2", "wheel"],
            "count": 5,
            "first_xid": "9",
            "first_offset": 8,
            "last_xid": "11",
            "last_offset": 1,
        }
    }


def documented(cls: type) -> dict[str, str]:
    """`:param name: text` of `cls` and of its delaywheel bases (the lease operators document their shared
    arguments once, on `_LeaseOperator`)."""
    params: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("delaywheel.") and klass.__doc__:
            doc = inspect.cleandoc(klass.__doc__)
            for name, text in re.findall(r"^:param (\w+):(.*?)(?=^:param |^$|\Z)", doc, re.M | re.S):
                params.setdefault(name, " ".join(text.split()))
    return params


def arguments(cls: type) -> set[str]:
    """The named constructor arguments of `cls` and of its delaywheel bases (not Airflow's `**kwargs`)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("delaywheel.") and "__init__" in vars(klass):
            names |= {
                p.name
                for p in inspect.signature(vars(klass)["__init__"]).parameters.values()
                if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            }
    return names


def test_every_argument_is_documented_and_templated_as_documented() -> None:
    """Each operator, sensor, trigger and hook argument has its `:param:`, and no `:param:` names a gone argument;
    an operator argument is in `template_fields` exactly when its doc says "templated", and rendering really
    replaces each of those fields (a name in `template_fields` that is not an attribute would fail here)."""
    from delaywheel.airflow import hooks, operators, sensors, triggers

    classes = [
        operators.PublishTopicEventsOperator,
        operators.DeliverLevelOperator,
        operators.AdvanceWheelOperator,
        operators.DeliverAllLanesOperator,
        operators.ConsumeOperator,
        operators.EnqueueOperator,
        operators.CancelOperator,
        operators.SeekOperator,
        sensors.DueMessagesSensor,
        triggers.DueMessagesTrigger,
        triggers.TopicMessagesTrigger,
        hooks.DelayWheelHook,
    ]
    for cls in classes:
        assert set(documented(cls)) == arguments(cls), cls.__name__
    instances = [
        operators.PublishTopicEventsOperator(task_id="publish", lane_task_ids=["a"]),
        operators.DeliverLevelOperator(task_id="level", level=1),
        operators.AdvanceWheelOperator(task_id="wheel"),
        operators.DeliverAllLanesOperator(task_id="every"),
        operators.ConsumeOperator(task_id="consume", topic="t", group="g", apply_function=print),
        operators.EnqueueOperator(task_id="enqueue", topic="t"),
        operators.CancelOperator(task_id="cancel", key="k"),
        operators.SeekOperator(task_id="seek", topic="t", group="g"),
        sensors.DueMessagesSensor(task_id="sensor", level=1),
    ]
    for op in instances:
        docs = documented(type(op))
        templated = {name for name, text in docs.items() if "templated" in text and "not templated" not in text.lower()}
        assert templated == set(op.template_fields), type(op).__name__
        for field in op.template_fields:
            setattr(op, field, "{{ params.value }}-" + field)
        op.render_template_fields({"params": {"value": "rendered"}})  # type: ignore[arg-type]
        assert {f: getattr(op, f) for f in op.template_fields} == {f: f"rendered-{f}" for f in op.template_fields}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"to": "earliest"}, {"to": "earliest"}),
        ({"to": " latest ", "to_time": "", "to_offset": ""}, {"to": "latest"}),
        ({"to": "offset", "to_offset": "42"}, {"to_offset": 42}),
        ({"to_offset": 7}, {"to_offset": 7}),
        ({"to": "time", "to_time": "2030-01-01T00:00:00"}, {"to_time": datetime(2030, 1, 1, tzinfo=UTC)}),
        ({"to_time": "2030-01-01T02:00:00+02:00"}, {"to_time": datetime(2030, 1, 1, tzinfo=UTC)}),
        ({}, "exactly one of"),
        ({"to_time": "2030-01-01", "to_offset": 3}, "exactly one of"),
        ({"to": "oldest"}, "to must be"),
        ({"to": "time"}, "needs to_time"),
        ({"to": "offset", "to_offset": "  "}, "needs to_offset"),
        ({"to": "offset", "to_offset": "-3"}, "whole number"),
        ({"to": "offset", "to_offset": True}, "whole number"),
        ({"to": "earliest", "to_time": "2030-01-01"}, "takes no to_time"),
        ({"to": "time", "to_time": "2030-01-01", "to_offset": 1}, "takes no to_offset"),
        ({"to": "time", "to_time": "next tuesday"}, "ISO 8601"),
    ],
)
def test_the_seek_operator_reads_its_fields_or_says_what_is_wrong(fields: dict[str, Any], expected: Any) -> None:
    from delaywheel.airflow.operators import SeekOperator

    operator = SeekOperator(task_id="seek", topic="t", group="g", **fields)
    if isinstance(expected, dict):
        assert operator.target() == expected
    else:
        with pytest.raises(ValueError, match=expected):
            operator.target()
