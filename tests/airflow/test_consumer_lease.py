"""The lease consumer (`ConsumeOperator`, `dags/delaywheel_consumer_lease_template.py`) against the real store:
the template DAG under `dag.test()` handles and acks what was delivered, with one member or mapped over two; two
tasks overlapping on one group hand it over with every message handled exactly once, none early, and a short gap;
tasks in two member slots consume side by side, each handing over to its own slot's successor; on_kill (Airflow's
SIGTERM handler) ends a lease with what was handled acked; a per-message function given by dotted path sends failures
to the retry ladder; a slot out of range fails the task before it takes anything."""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from delaywheel import Message, Store
from tests.helpers import Handled, check_slots_handed_over, deliveries, delivering, mapped_results

pytestmark = pytest.mark.airflow


def _left(store: Store, topic: str, group: str) -> int:
    """Messages the group has not acked (a pull, given back unacked)."""
    batch = store.pull(topic, group, 1000)
    store.release(batch)
    return len(batch)


def test_template_dag_consumes_delivered_messages_and_acks(
    store_connection: str, db_url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELAYWHEEL_LEVELS", "1s 5s")
    from airflow.dag_processing.dagbag import DagBag

    from tests.helpers import run_dag

    bag = DagBag(dag_folder=DagBag().dag_folder)
    assert bag.import_errors == {}
    dag = bag.dags["delaywheel_consumer_lease_template"]
    topic, group = "orders", "orders-lease-template"
    now = store.clock()
    ids = [store.send(topic, {"n": n}, delay_level=1, now=now - timedelta(seconds=5)) for n in range(25)]
    stop = threading.Event()
    deliverer = delivering(db_url, stop)
    try:
        deadline = time.monotonic() + 30
        while len(deliveries(store, topic)) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(deliveries(store, topic)) == len(ids)
        run_id, states, values = run_dag(dag, lease_seconds=3, handover_grace_seconds=0, max_messages=10)
        assert states == {"members": "success", "consume": "success"}
        assert values["members"] == [0]  # one member by default: slot 0, the (group, topic) locks
        ((state, result),) = mapped_results(dag.dag_id, run_id, "consume").values()
        assert state == "success" and result["slot"] == 0
        assert result["handled"] == result["acked"] == len(ids), result
        assert result["retried"] == 0 and result["reconnects"] == 0 and result["stopped_by"] == "lease"
        assert _left(store, topic, group) == 0  # the group's offset is past every message

        more = [store.send(topic, {"n": n}, key=f"k{n % 4}") for n in range(30)]  # no delay: in the topic at once
        run_id, states, values = run_dag(dag, lease_seconds=3, handover_grace_seconds=0, max_messages=10, members=2)
    finally:
        stop.set()
        deliverer.join(30)
    assert states == {"members": "success", "consume": "success"} and values["members"] == [0, 1]
    mapped = mapped_results(dag.dag_id, run_id, "consume")
    assert sorted(mapped) == [0, 1] and all(state == "success" for state, _ in mapped.values()), mapped
    assert [result["slot"] for _, (_, result) in sorted(mapped.items())] == [0, 1]
    assert sum(result["handled"] for _, result in mapped.values()) == len(more)  # dag.test runs them one by one
    assert sum(result["acked"] for _, result in mapped.values()) == len(more)
    assert _left(store, topic, group) == 0


def test_template_dag_refuses_a_member_count_out_of_range(store_connection: str) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import ParamValidationError

    dag = DagBag(dag_folder=DagBag().dag_folder).dags["delaywheel_consumer_lease_template"]
    for members in (0, 17, 1.5, "2; DROP TABLE x"):
        params = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError, match="members"):
            params["members"] = members
    params = copy.deepcopy(dag.params)
    params["members"] = 16
    assert params.validate()["members"] == 16


def test_lease_handover_handles_every_message_once_none_early_with_a_short_gap(
    store_connection: str, db_url: str, store: Store
) -> None:
    from delaywheel.airflow.operators import ConsumeOperator

    topic, group = "jobs", "workers"
    seen: list[tuple[int, str, float, float]] = []  # (message_id, task, handled at, due at)
    lock = threading.Lock()

    def handler_for(name: str) -> Any:
        def handle(messages: list[Any]) -> None:
            now = time.time()
            with lock:
                seen.extend((m.message_id, name, now, m.deliver_at.timestamp()) for m in messages)

        return handle

    # the old task: lease 4 s, then keeps the group until a successor is present (grace 10 s);
    # the new one starts 2 s in, as a standby, and leases 9 s
    old = ConsumeOperator(
        task_id="old",
        topic=topic,
        group=group,
        apply_function_batch=handler_for("old"),
        lease_seconds=4,
        handover_grace_seconds=10,
        max_messages=20,
    )
    new = ConsumeOperator(
        task_id="new",
        topic=topic,
        group=group,
        apply_function_batch=handler_for("new"),
        lease_seconds=9,
        handover_grace_seconds=0,
        max_messages=20,
    )
    results: dict[str, dict[str, Any]] = {}
    sent: list[int] = []
    stop = threading.Event()
    deliverer = delivering(db_url, stop)

    def produce() -> None:
        with Store(db_url) as own:
            end = time.monotonic() + 7
            n = 0
            while time.monotonic() < end:  # throughout the hand-over: a level, the wheel and no delay at all
                kind = n % 3
                sent.append(
                    own.send(
                        topic,
                        {"n": n},
                        delay_level=1 if kind == 0 else None,
                        delay=timedelta(milliseconds=400) if kind == 1 else None,
                    )
                )
                n += 1
                time.sleep(0.02)

    def work(op: ConsumeOperator) -> None:
        results[op.task_id] = op.execute({})

    try:
        producer = threading.Thread(target=produce)
        threads = [threading.Thread(target=work, args=(old,)), threading.Thread(target=work, args=(new,))]
        producer.start()
        threads[0].start()
        time.sleep(2)
        threads[1].start()
        for t in (producer, *threads):
            t.join(60)
    finally:
        stop.set()
        deliverer.join(30)
    ids = [s[0] for s in seen]
    assert sorted(ids) == sorted(sent), "every message handled, none twice"
    assert all(handled >= due for _, _, handled, due in seen), "a message was handled before it was due"
    assert results["old"]["handed_over"] and results["old"]["stopped_by"] == "lease"
    old_times = [s[2] for s in seen if s[1] == "old"]
    new_times = [s[2] for s in seen if s[1] == "new"]
    assert old_times and new_times
    assert max(old_times) <= min(new_times), "the standby handled nothing while the old task held the group"
    gap = min(new_times) - max(old_times)
    assert gap < 2.0, f"hand-over gap {gap:.2f}s"
    for name in ("old", "new"):
        r = results[name]
        assert r["handled"] == r["acked"] == len([s for s in seen if s[1] == name]) and r["retried"] == 0
    assert _left(store, topic, group) == 0


def test_two_slots_consume_side_by_side_each_handing_over_to_its_own_successor(
    store_connection: str, db_url: str, store: Store
) -> None:
    """members=2: a task per slot, each overlapped by its successor (slot 0 hands over at 4 s, slot 1 at 5 s): the
    two consume the group's messages side by side, every message once and each key's in order, none early, and each
    slot's successor takes over with a short gap, as a single consumer's does."""
    from delaywheel.airflow.operators import ConsumeOperator

    topic, group = "jobs", "workers"
    seen: list[Handled] = []
    early: list[int] = []
    lock = threading.Lock()

    def handler_for(name: str) -> Any:
        def handle(messages: list[Any]) -> None:
            now, wall = time.monotonic(), time.time()
            with lock:
                seen.extend(Handled(m.message_id, m.key, name, now) for m in messages)
                early.extend(m.message_id for m in messages if wall < m.deliver_at.timestamp())

        return handle

    def operator(name: str, slot: int, lease: float, grace: float) -> ConsumeOperator:
        return ConsumeOperator(
            task_id=name,
            topic=topic,
            group=group,
            apply_function_batch=handler_for(name),
            lease_seconds=lease,
            handover_grace_seconds=grace,
            max_messages=10,
            slot=str(slot),  # as a template renders it
        )

    olds = [operator(f"old{k}", k, 4 + k, 10) for k in (0, 1)]
    news = [operator(f"new{k}", k, 9, 0) for k in (0, 1)]
    results: dict[str, dict[str, Any]] = {}
    stop = threading.Event()
    deliverer = delivering(db_url, stop)

    def produce() -> None:
        with Store(db_url) as own:
            end = time.monotonic() + 7
            n = 0
            while time.monotonic() < end:  # a level, the wheel and no delay; half keyed, half spread by id
                kind = n % 3
                own.send(
                    topic,
                    {"n": n},
                    key=f"k{n % 8}" if n % 2 else None,
                    delay_level=1 if kind == 0 else None,
                    delay=timedelta(milliseconds=400) if kind == 1 else None,
                )
                n += 1
                time.sleep(0.02)

    def work(op: ConsumeOperator) -> None:
        results[op.task_id] = op.execute({})

    try:
        producer = threading.Thread(target=produce)
        threads = [threading.Thread(target=work, args=(op,)) for op in (*olds, *news)]
        producer.start()
        for thread in threads[:2]:
            thread.start()
        time.sleep(2)
        for thread in threads[2:]:
            thread.start()
        for thread in (producer, *threads):
            thread.join(60)
    finally:
        stop.set()
        deliverer.join(30)
    check_slots_handed_over(seen, store, topic, slots=2, max_gap=2.0)
    assert early == [], "a message was handled before it was due"
    for k in (0, 1):
        assert results[f"old{k}"]["handed_over"] and results[f"old{k}"]["stopped_by"] == "lease"
        assert results[f"old{k}"]["slot"] == results[f"new{k}"]["slot"] == k
    for name, r in results.items():
        assert r["handled"] == r["acked"] == len([h for h in seen if h.name == name]) and r["retried"] == 0
    assert _left(store, topic, group) == 0


def test_on_kill_acks_what_was_handled_and_asks_airflow_to_run_the_task_again(
    store_connection: str, store: Store
) -> None:
    """SIGTERM (Airflow stopping): the batch in hand is acked, the group released, and the try ends as
    up_for_reschedule, due at once: one that returned would end `success` and leave its group without a consumer
    until the next scheduled run."""
    from airflow.sdk.exceptions import AirflowRescheduleException

    from delaywheel.airflow.operators import ConsumeOperator

    handled: list[int] = []
    operator = ConsumeOperator(
        task_id="c",
        topic="t",
        group="g",
        lease_seconds=600,
        apply_function_batch=lambda ms: handled.extend(m.message_id for m in ms),
    )
    raised: list[BaseException] = []

    def run() -> None:
        try:
            operator.execute({})
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    ids = store.send_many([Message("t", {"n": n}) for n in range(30)])  # no delay: straight into the topic
    deadline = time.monotonic() + 30
    while len(handled) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    operator.on_kill()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - started < 5
    (exc,) = raised
    assert isinstance(exc, AirflowRescheduleException) and exc.reschedule_date <= store.clock()
    assert sorted(handled) == sorted(ids)
    assert _left(store, "t", "g") == 0  # every message handled was acked

    # killed while starting: it takes nothing and asks again at once
    early = ConsumeOperator(task_id="c", topic="t", group="g", lease_seconds=600, apply_function_batch=lambda ms: None)
    early.on_kill()
    started = time.monotonic()
    with pytest.raises(AirflowRescheduleException):
        early.execute({})
    assert time.monotonic() - started < 15


def fail_even(message: Any, *, parity: int) -> None:
    """A per-message function for `apply_function` by dotted path: fails messages whose body n has this parity."""
    if message.body["n"] % 2 == parity:
        raise RuntimeError("failing on purpose")


def test_per_message_function_by_dotted_path_retries_only_its_failures(store_connection: str, store: Store) -> None:
    from delaywheel.airflow.operators import ConsumeOperator

    with pytest.raises(ValueError, match="exactly one handler"):
        ConsumeOperator(task_id="none", topic="t", group="g")
    store.send_many([Message("t", {"n": n}) for n in range(10)])
    operator = ConsumeOperator(
        task_id="c",
        topic="t",
        group="g",
        lease_seconds=3,
        apply_function="tests.airflow.test_consumer_lease.fail_even",
        apply_function_kwargs={"parity": 0},
    )
    result = operator.execute({})
    assert result["handled"] == result["acked"] == 10 and result["retried"] == 5, result


def test_the_operator_takes_a_tag_filter_and_a_start(store_connection: str, store: Store) -> None:
    """`tags` hands the handler only the group's tags and passes the rest; `start` places a new group; a bad filter
    or start fails the task before it takes the group (nothing written)."""
    from delaywheel.airflow.operators import ConsumeOperator

    store.send_many([Message("t", {"n": n}, tags="A") for n in range(3)])  # before the start: not read
    start = store.clock().isoformat()
    ids = store.send_many([Message("t", {"n": n}, tags="ABC"[n % 3]) for n in range(9)])
    handled: list[int] = []

    def operator(**options: Any) -> ConsumeOperator:
        return ConsumeOperator(
            task_id="c",
            topic="t",
            group="g",
            lease_seconds=3,
            apply_function_batch=lambda ms: handled.extend(m.message_id for m in ms),
            **options,
        )

    for bad in ({"tags": "A || *"}, {"start": "yesterday"}):
        with pytest.raises(ValueError):
            operator(**bad).execute({})
    assert store.conn.execute("SELECT count(*) FROM delaywheel.consumer_offsets").fetchone() == (0,)
    result = operator(tags="A||C", start=start).execute({})
    assert handled == [i for n, i in enumerate(ids) if n % 3 != 1]
    assert result["handled"] == result["acked"] == 6 and result["skipped"] == 3, result
    assert _left(store, "t", "g") == 0


def test_a_slot_out_of_range_fails_the_task_before_it_takes_anything(store_connection: str, store: Store) -> None:
    from delaywheel.airflow.operators import ConsumeOperator

    store.send_many([Message("t", {"n": n}) for n in range(3)])
    for slot in ("16", "-1", "one", "0; SELECT 1"):
        operator = ConsumeOperator(
            task_id="c", topic="t", group="g", lease_seconds=3, slot=slot, apply_function_batch=lambda ms: None
        )
        with pytest.raises(ValueError, match="slot must be a whole number from 0 to 15"):
            operator.execute({})
    assert _left(store, "t", "g") == 3  # nothing was consumed
