"""DueMessagesTrigger and DueMessagesSensor against the real store: due exactly when due, never before.

The clock is injected with `now_offset_s` (added to the database clock); the one real wait is the
NOTIFY wake-up, which has to beat a long poll interval to pass.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from delaywheel import Store
from delaywheel.dev.local_airflow import as_url
from tests.helpers import trigger_events

pytestmark = pytest.mark.airflow


def first_event(trigger, within_s: float):
    """The trigger's first event, or None if it yields nothing within `within_s` seconds."""

    async def go():
        gen = trigger.run()
        try:
            return await asyncio.wait_for(gen.__anext__(), within_s)
        except TimeoutError:
            return None
        finally:
            await gen.aclose()

    return asyncio.run(go())


def test_serialize_round_trip(airflow_db: dict[str, str]) -> None:
    from airflow.sdk.module_loading import import_string

    from delaywheel.airflow.triggers import DueMessagesTrigger

    trigger = DueMessagesTrigger(level=3, delaywheel_conn_id="other", poll_interval=2.5, now_offset_s=7.0)
    path, kwargs = trigger.serialize()
    again = import_string(path)(**kwargs)
    assert type(again) is DueMessagesTrigger
    assert again.serialize() == (path, kwargs)
    assert kwargs == {"level": 3, "delaywheel_conn_id": "other", "poll_interval": 2.5, "now_offset_s": 7.0}


def test_level_trigger_fires_when_the_head_is_due_not_before(store_connection: str, store: Store) -> None:
    from delaywheel.airflow.triggers import DueMessagesTrigger

    assert first_event(DueMessagesTrigger(level=18, poll_interval=0.2), 1.0) is None  # empty level: nothing due
    message = store.send("orders", {"n": 1}, delay_level=18)  # due in 2 h
    due_at = store.conn.execute("SELECT deliver_at FROM delaywheel.level_queue WHERE id = %s", (message,)).fetchone()[0]
    early = (due_at - store.clock()).total_seconds() - 60  # a clock a minute short of the due time
    assert first_event(DueMessagesTrigger(level=18, poll_interval=0.2, now_offset_s=early), 1.0) is None
    event = first_event(DueMessagesTrigger(level=18, poll_interval=0.2, now_offset_s=early + 61), 5.0)
    assert event is not None
    assert event.payload["lane"] == "level 18"
    assert event.payload["due_at"] == due_at.isoformat()
    assert event.payload["checked_at"] >= event.payload["due_at"]
    assert first_event(DueMessagesTrigger(level=17, poll_interval=0.2, now_offset_s=early + 61), 1.0) is None


def test_wheel_trigger_wakes_on_a_sooner_message(store_connection: str, store: Store) -> None:
    """Waiting for a message an hour out, with a 10-minute poll: a NOTIFY for a message due in 2 s must wake it."""
    from delaywheel.airflow.triggers import DueMessagesTrigger

    store.send("orders", "later", delay=timedelta(hours=1))

    async def go():
        gen = DueMessagesTrigger(poll_interval=600).run()
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(1.0)  # the trigger is asleep on LISTEN by now
        assert not waiting.done()
        soon = await asyncio.to_thread(store.send, "orders", "soon", delay=timedelta(seconds=2))
        event = await asyncio.wait_for(waiting, 60)
        await gen.aclose()
        return soon, event

    soon, event = asyncio.run(go())
    due_at = store.conn.execute(
        "SELECT deliver_at FROM delaywheel.wheel WHERE id = %(id)s UNION ALL SELECT deliver_at FROM delaywheel.wheel_far"
        " WHERE id = %(id)s",
        {"id": soon},
    ).fetchone()[0]
    assert event.payload == {
        "status": "success",
        "lane": "wheel",
        "due_at": due_at.isoformat(),
        "checked_at": event.payload["checked_at"],
    }
    assert event.payload["checked_at"] >= event.payload["due_at"]


def test_a_triggers_looks_are_planned_once_on_its_connection(store_connection: str, store: Store) -> None:
    """A trigger keeps its connection through its wait and looks at the head at every wake: the read is prepared on
    that connection once per lane, not planned again at each look over every near-wheel partition."""
    from delaywheel.airflow.hooks import DelayWheelHook, next_due_async

    wheel = store.clock() + timedelta(hours=1)
    store.send("orders", "later", deliver_at=wheel)
    level = store.conn.execute(
        "SELECT deliver_at FROM delaywheel.level_queue WHERE id = %s", (store.send("orders", "l", delay_level=18),)
    ).fetchone()[0]

    async def looks() -> tuple[list[datetime | None], int]:
        async with await DelayWheelHook().aconnect() as conn:
            heads = [(await next_due_async(conn, lane, 0.0))[0] for lane in (None, 18, None, 18)]
            (prepared,) = await (await conn.execute("SELECT count(*) FROM pg_prepared_statements")).fetchone()
        return heads, prepared

    heads, prepared = asyncio.run(looks())
    assert heads == [wheel, level] * 2
    assert prepared == 2  # the wheel's head and the level's (psycopg would prepare them itself only at a sixth run)


def test_a_bad_notify_payload_is_ignored_by_the_trigger(
    store_connection: str, store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """Anyone may NOTIFY the producers' channel: a payload that is not a due time neither fails the trigger nor
    wakes it, is logged once, and a real announcement after it still wakes the wait."""
    import psycopg

    from delaywheel.airflow.triggers import DueMessagesTrigger
    from delaywheel.channels import NOTIFY_CHANNEL

    async def go():
        gen = DueMessagesTrigger(poll_interval=600).run()
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(1.0)  # asleep on LISTEN by now
        async with await psycopg.AsyncConnection.connect(store.url, autocommit=True) as other:
            for payload in ("not-a-number", "nan", "", "not-a-number"):
                await other.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, payload))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # neither failed nor woke
        await asyncio.to_thread(store.send, "orders", "soon", delay=timedelta(seconds=1))
        event = await asyncio.wait_for(waiting, 60)
        await gen.aclose()
        return event

    event = asyncio.run(go())
    assert event.payload["lane"] == "wheel"
    logged = capsys.readouterr()
    assert (logged.out + logged.err).count("ignoring a NOTIFY") == 1  # the trigger's log (structlog): once


@pytest.fixture
def schemaless_connection(
    airflow_db: dict[str, str], server_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """An Airflow connection (`no_store`) to an empty database: reachable, but without the store's schema."""
    name = f"dwtest_empty_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    monkeypatch.setenv("AIRFLOW_CONN_NO_STORE", as_url(make_conninfo(server_url, dbname=name)))
    yield "no_store"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_failed_wait_is_an_error_event_that_fails_the_sensor(
    store_connection: str, store: Store, schemaless_connection: str
) -> None:
    """A wait that fails on anything but a lost connection ends the trigger with a "status": "error" event carrying
    the cause, and the deferred sensor, resumed with it, fails with that message; a "success" event resumes it with
    the same XCom value a poke gives (the status dropped)."""
    from airflow.sdk.exceptions import AirflowException

    from delaywheel.airflow.sensors import DueMessagesSensor
    from delaywheel.airflow.triggers import DueMessagesTrigger

    sensor = DueMessagesSensor(task_id="wait_level_1", level=1)
    for conn_id, cause in ((schemaless_connection, "UndefinedTable"), ("no_such_connection", "no_such_connection")):
        event = first_event(DueMessagesTrigger(level=1, delaywheel_conn_id=conn_id, poll_interval=0.2), 10.0)
        assert event is not None, conn_id  # ends at once: it does not wait out the poll, nor retry
        assert event.payload["status"] == "error" and event.payload["lane"] == "level 1"
        assert cause in event.payload["message"]
        with pytest.raises(
            AirflowException, match=f"wait_level_1: waiting for a due message failed: level 1: .*{cause}"
        ):
            sensor.execute_complete({}, event.payload)
    with pytest.raises(AirflowException, match="no event"):
        sensor.execute_complete({}, None)

    store.send("orders", "now", delay=timedelta(milliseconds=1))
    event = first_event(DueMessagesTrigger(poll_interval=0.2), 10.0)
    assert event is not None and event.payload["status"] == "success"
    assert sensor.execute_complete({}, event.payload) == {
        key: event.payload[key] for key in ("lane", "due_at", "checked_at")
    }


def test_a_poke_that_cannot_reach_the_database_is_not_yet(
    airflow_db: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from delaywheel.airflow.sensors import DueMessagesSensor

    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", "postgresql://postgres@127.0.0.1:1/delaywheel")
    assert not DueMessagesSensor(task_id="down", level=1, deferrable=False).poke({}).is_done


def test_sensor_pokes_and_defers(store_connection: str, store: Store) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from delaywheel.airflow.sensors import DueMessagesSensor
    from delaywheel.airflow.triggers import DueMessagesTrigger

    with pytest.raises(ValueError, match="exactly one"):
        DueMessagesSensor(task_id="both", level=1, wheel=True)
    sensor = DueMessagesSensor(task_id="wait_level_2", level=2, deferrable=False)
    assert not sensor.poke({}).is_done
    store.send("orders", "x", delay_level=2)  # due in 5 s
    assert not sensor.poke({}).is_done
    ahead = DueMessagesSensor(task_id="ahead", level=2, now_offset_s=6)
    poked = ahead.poke({})
    assert poked.is_done and poked.xcom_value["lane"] == "level 2"

    wheel = DueMessagesSensor(task_id="wait_wheel", wheel=True, trigger_poll_interval=1.5)
    with pytest.raises(TaskDeferred) as deferred:
        wheel.execute({})  # nothing on the wheel: hand the wait to the triggerer
    trigger = deferred.value.trigger
    assert isinstance(trigger, DueMessagesTrigger)
    assert (trigger.level, trigger.poll_interval) == (None, 1.5)
    assert deferred.value.method_name == "execute_complete"
    assert ahead.execute({})["lane"] == "level 2"  # already due: no deferral


def test_topic_watcher_announces_each_delivered_message_once(store_connection: str, store: Store) -> None:
    """The topic Asset's watcher: an event as soon as messages can be read, each message announced once,
    also across a restart (a new trigger) and between two watchers racing on the same topic."""
    from airflow.triggers.base import BaseEventTrigger

    from delaywheel.airflow.operators import topic_asset
    from delaywheel.airflow.triggers import TopicMessagesTrigger

    (watcher,) = topic_asset("orders").watchers
    assert isinstance(watcher.trigger, TopicMessagesTrigger) and isinstance(watcher.trigger, BaseEventTrigger)
    assert watcher.trigger.serialize()[1] == {
        "topic": "orders",
        "delaywheel_conn_id": "delaywheel_default",
        "poll_interval": 1.0,
    }
    assert trigger_events(TopicMessagesTrigger("orders", poll_interval=0.1), 1, 0.5) == []  # an empty topic: silent

    ids = [store.send("orders", {"n": n}) for n in range(5)]  # level 0: in the topic at once
    store.send("other", {"n": 0})
    (event,) = trigger_events(TopicMessagesTrigger("orders", poll_interval=0.1), 2, 5.0)
    assert event.payload["topic"] == "orders" and event.payload["count"] == 5
    offsets = [
        r[0]
        for r in store.conn.execute(
            "SELECT queue_offset FROM delaywheel.topic_messages WHERE message_id = ANY(%s) ORDER BY queue_offset",
            (ids,),
        )
    ]
    assert (event.payload["first_offset"], event.payload["last_offset"]) == (offsets[0], offsets[-1])
    assert trigger_events(TopicMessagesTrigger("orders", poll_interval=0.1), 1, 0.5) == []  # restarted: nothing new

    async def race():
        gens = [TopicMessagesTrigger("orders", poll_interval=0.05).run() for _ in range(2)]
        pending = [asyncio.ensure_future(g.__anext__()) for g in gens]
        for n in range(20):
            await asyncio.to_thread(store.send, "orders", {"late": n})
        announced = 0
        deadline = asyncio.get_running_loop().time() + 10
        while announced < 20 and asyncio.get_running_loop().time() < deadline:
            done, _ = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.index(future)
                announced += future.result().payload["count"]
                pending[i] = asyncio.ensure_future(gens[i].__anext__())
        await asyncio.sleep(0.5)  # a double announcement would show up now
        announced += sum(f.result().payload["count"] for f in pending if f.done())
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return announced

    assert asyncio.run(race()) == 20
    assert store.conn.execute("SELECT announced FROM delaywheel.topic_watch WHERE topic = 'orders'").fetchone() == (25,)


def test_topic_watcher_wakes_on_a_delivery_not_on_its_poll(store_connection: str, store: Store, t0) -> None:
    """With a poll a minute long, only the NOTIFY that a deliver pass (or a direct send) makes at commit can bring
    the watcher's event within seconds; an enqueue onto a level is not in the topic yet and must not wake it."""
    from delaywheel.airflow.triggers import TopicMessagesTrigger

    async def go():
        gen = TopicMessagesTrigger("orders", poll_interval=60).run()
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(1.0)  # looked, found nothing, asleep on LISTEN
        await asyncio.to_thread(store.send, "orders", b"timeout", delay_level=1, now=t0)
        await asyncio.sleep(1.0)
        assert not waiting.done()  # on its level: nothing readable yet
        await asyncio.to_thread(store.deliver_level, 1, now=t0 + timedelta(seconds=1))
        delivered = await asyncio.wait_for(waiting, 10)
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.5)
        await asyncio.to_thread(store.send, "orders", b"now")  # level 0: straight into the topic
        direct = await asyncio.wait_for(waiting, 10)
        await gen.aclose()
        return delivered, direct

    delivered, direct = asyncio.run(go())
    assert (delivered.payload["count"], direct.payload["count"]) == (1, 1)
    assert direct.payload["first_offset"] > delivered.payload["last_offset"]
