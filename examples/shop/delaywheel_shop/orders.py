"""The order-timeout story: an order not paid within its timeout is cancelled and its stock released.

Everything here is set-based (one transaction per chunk or batch, no per-row round trips) and is the
single implementation used by the demo, the Spark order generator, the sweep DAG and the tests.
Stock is conserved: initial = on_hand + reserved + sold (placing reserves, paying sells, cancelling releases).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.abc import Params

from delaywheel.consume.topics import Delivered
from delaywheel.produce.validation import Message
from delaywheel.store import Store

if TYPE_CHECKING:  # imported where it runs (run_sweep), like consume itself
    from delaywheel.consume.consumer import ConsumeTotals

TOPIC = "shop.order-timeout"
GROUP = "shop-sweeper"
SKUS = 50


def timer_key(order_id: int) -> str:
    return f"order-{order_id}"


def order_of(key: str | None) -> int | None:
    """The order a timer is for (its key), or None for a message that is not an order timer."""
    if key and key.startswith("order-") and key[6:].isdigit():
        return int(key[6:])
    return None


def _execute(conn: psycopg.Connection, query: str, params: Params | None = None) -> psycopg.Cursor[Any]:
    """Run one of the shop's statements unprepared, so that PostgreSQL plans it for the rows its tables hold now.

    psycopg prepares a statement after its fifth run, and PostgreSQL then settles on a generic plan if it costs no
    more than the custom ones. The demo's tables start empty (reset): the customers' tick runs every 0.1 s from the
    start, so its generic plan was made for empty tables, and when autovacuum had recorded them as empty (0 pages,
    0 rows, as after a restart) that plan rescans the locking subquery once per row, quadratic in the rows. With
    30,000 due plans it took 86 s instead of 0.1 s, and in the demo it held the customers' transaction open for two
    minutes, and with it the commit horizon that the deliverer and the sweep wait behind. Planning these statements
    each time costs a fraction of a millisecond. The shop's functions (migrations/002) plan theirs the same way.
    """
    return conn.execute(query, params, prepare=False)


@dataclass(frozen=True)
class Mix:
    """How simulated customers behave (fractions of orders)."""

    pay_on_time: float = 0.75
    pay_late: float = 0.08
    customer_cancel: float = 0.05
    # the rest abandon their cart and never pay


@dataclass(frozen=True)
class OrderPlan:
    order_id: int
    customer: str
    lines: list[tuple[str, int]]
    action: str  # pay | cancel | abandon
    act_after: timedelta | None  # after placing; a late payment comes after the deadline


def plan_orders(first_id: int, count: int, timeout: timedelta, mix: Mix = Mix(), seed: int = 7) -> list[OrderPlan]:
    """Deterministic plans: the same ids and seed always give the same orders and behaviour."""
    plans = []
    for order_id in range(first_id, first_id + count):
        rng = random.Random(seed * 1_000_003 + order_id)
        lines = {f"sku-{rng.randrange(SKUS):03d}": rng.randint(1, 3) for _ in range(rng.randint(1, 3))}
        draw = rng.random()
        if draw < mix.pay_on_time:
            action, after = "pay", timeout * rng.uniform(0.05, 0.9)
        elif draw < mix.pay_on_time + mix.pay_late:
            action, after = "pay", timeout * rng.uniform(1.3, 1.8)
        elif draw < mix.pay_on_time + mix.pay_late + mix.customer_cancel:
            action, after = "cancel", timeout * rng.uniform(0.05, 0.8)
        else:
            action, after = "abandon", None
        plans.append(OrderPlan(order_id, f"customer-{rng.randrange(10_000)}", sorted(lines.items()), action, after))
    return plans


def reset(store: Store, stock_per_sku: int) -> None:
    """Empty the demo's business tables, cancel timers left by an earlier run, restock every product."""
    conn = store.conn
    with conn.transaction():
        store.cancel_matching(where=f"p.topic = '{TOPIC}'", reason="demo reset")
        _execute(
            conn,
            "TRUNCATE shop.processed_messages, shop.customer_plan, shop.payments, shop.order_lines, shop.orders, shop.products",
        )
        _execute(
            conn,
            "INSERT INTO shop.products (sku, initial_stock, on_hand)"
            " SELECT format('sku-%%s', lpad(n::text, 3, '0')), %(s)s, %(s)s FROM generate_series(0, %(k)s - 1) n",
            {"s": stock_per_sku, "k": SKUS},
        )


def place_orders(store: Store, plans: list[OrderPlan], timeout: timedelta, *, now: datetime | None = None) -> int:
    """Place orders and enqueue each one's timeout message in the same transaction.

    The transaction holds back the store's commit horizon from its first write to its commit (a delivered timeout
    becomes readable to the sweep only once every older writing transaction has ended), so it is kept to its
    statements: the timers go first, so that send_many's Python work (checking them, building their Arrow columns)
    runs before this transaction has written anything, and the order rows follow in one pipelined round trip.
    On a busy machine each round trip waits for this process to be scheduled again, while the horizon waits too.
    """
    if not plans:
        return 0
    conn = store.conn
    placed = now or store.clock()
    deadline = placed + timeout
    timers = [Message(TOPIC, {"order_id": p.order_id}, deliver_at=deadline, key=timer_key(p.order_id)) for p in plans]
    ids = [p.order_id for p in plans]
    lines = [(p.order_id, sku, qty) for p in plans for sku, qty in p.lines]
    with conn.transaction():
        message_ids = store.send_many(timers, now=placed)
        with conn.pipeline():
            _execute(
                conn,
                "INSERT INTO shop.orders (order_id, customer, placed_at, deadline, timeout_message_id)"
                " SELECT unnest(%s::bigint[]), unnest(%s::text[]), %s, %s, unnest(%s::bigint[])",
                (ids, [p.customer for p in plans], placed, deadline, message_ids),
            )
            _execute(
                conn,
                "INSERT INTO shop.order_lines (order_id, sku, qty)"
                " SELECT unnest(%s::bigint[]), unnest(%s::text[]), unnest(%s::int[])",
                ([o for o, _, _ in lines], [s for _, s, _ in lines], [q for _, _, q in lines]),
            )
            _execute(conn, "SELECT shop.lock_stock(%s::bigint[])", (ids,))
            _execute(
                conn,
                """UPDATE shop.products p SET on_hand = p.on_hand - l.qty, reserved = p.reserved + l.qty
               FROM (SELECT sku, sum(qty) AS qty FROM shop.order_lines WHERE order_id = ANY(%s::bigint[]) GROUP BY sku) l
               WHERE p.sku = l.sku""",
                (ids,),
            )
            _execute(
                conn,
                "INSERT INTO shop.customer_plan (order_id, action, act_at)"
                " SELECT unnest(%s::bigint[]), unnest(%s::text[]), %s::timestamptz + unnest(%s::interval[])",
                (ids, [p.action for p in plans], placed, [p.act_after for p in plans]),
            )
    return len(plans)


def pay(store: Store, payments: list[tuple[int, datetime]], *, cancel_timers: bool = True) -> list[int]:
    """Payments (order id, time paid) arrive: accepted for orders still pending whose deadline had not
    passed when the customer paid (their timers are cancelled); refused otherwise (a refund), so the
    outcome never depends on how late the sweep runs. Returns the ids accepted. One statement
    (`shop.pay`, migrations/002)."""
    (accepted,) = _call(store.conn, "SELECT shop.pay(%s::bigint[], %s::timestamptz[])", _columns(payments))
    if cancel_timers:
        _cancel_timers(store, accepted, "order paid")
    return accepted


def _columns(requests: list[tuple[int, datetime]]) -> tuple[list[int], list[datetime]]:
    return [o for o, _ in requests], [t for _, t in requests]


def _call(conn: psycopg.Connection, query: str, params: Params) -> tuple[Any, ...]:
    """The one row a shop function returns."""
    row = _execute(conn, query, params).fetchone()
    assert row is not None
    return tuple(row)


def _cancel_timers(store: Store, order_ids: list[int], reason: str) -> None:
    """Cancel the orders' timers after their transaction committed: cancelling holds the wheel's lock,
    which must not wait on business transactions. Not atomic with the payment, and need not be: a
    timer that still fires finds the order settled and changes nothing."""
    if order_ids:
        store.cancel_matching(keys=[timer_key(o) for o in order_ids], reason=reason)


def customer_cancel(store: Store, cancels: list[tuple[int, datetime]], *, cancel_timers: bool = True) -> list[int]:
    """Cancellations (order id, time asked) arrive: honoured for orders still pending whose deadline had
    not passed when the customer asked, like payments, so a slow front end never turns a timeout into a
    customer cancellation. Returns the ids cancelled. One statement (`shop.customer_cancel`)."""
    (cancelled,) = _call(store.conn, "SELECT shop.customer_cancel(%s::bigint[], %s::timestamptz[])", _columns(cancels))
    if cancel_timers:
        _cancel_timers(store, cancelled, "cancelled by customer")
    return cancelled


def act_customers(store: Store, *, now: datetime | None = None) -> dict[str, int]:
    """Carry out every planned customer action that has fallen due (the simulation's clock tick), then cancel the
    timers of the orders it settled."""
    payments, paid, cancelled = _settle_due(store, now)
    _cancel_timers(store, paid, "order paid")
    _cancel_timers(store, cancelled, "cancelled by customer")
    return {"payments": payments, "accepted": len(paid), "customer_cancels": len(cancelled)}


def _settle_due(store: Store, now: datetime | None) -> tuple[int, list[int], list[int]]:
    """One statement (`shop.act_customers`), so the tick's transaction never waits on this process between its
    steps. Returns how many payments were made, and the orders paid and cancelled."""
    payments, paid, cancelled = _call(
        store.conn,
        "SELECT payments, paid, cancelled FROM shop.act_customers(coalesce(%s::timestamptz, clock_timestamp()))",
        (now,),
    )
    return payments, paid, cancelled


@dataclass
class SweepTotals:
    batches: int = 0
    messages: int = 0
    cancelled: int = 0
    duplicates: int = 0
    per_batch: list[int] = field(default_factory=list)


def apply_timeouts(
    conn: psycopg.Connection, messages: Sequence[Delivered], *, now: datetime | None = None
) -> tuple[int, int]:
    """One statement for a delivered batch's messages (`shop.apply_timeouts`, migrations/002): cancel the orders
    still unpaid and release their stock; paid or already cancelled orders stay as they are; a message seen before
    changes nothing. Returns (orders cancelled, messages already processed)."""
    timers = [(m.idempotency_id, order_of(m.key)) for m in messages if order_of(m.key) is not None]
    cancelled, duplicates = _call(
        conn,
        "SELECT orders_cancelled, duplicates FROM shop.apply_timeouts(%s::bigint[], %s::bigint[], %s::timestamptz)",
        ([m for m, _ in timers], [o for _, o in timers], now),
    )
    return cancelled, duplicates


def sweep(store: Store, *, max_messages: int = 5000, group: str = GROUP, now: datetime | None = None) -> SweepTotals:
    """Pull and apply every delivered timeout batch; each group offset advances only after its
    batch's transaction committed (a crash in between redelivers the batch, harmlessly)."""
    totals = SweepTotals()
    while True:
        batch = store.pull(TOPIC, group, max_messages)
        if not batch.messages:
            return totals
        cancelled, duplicates = apply_timeouts(store.conn, batch.messages, now=now)
        store.ack(batch)
        totals.batches += 1
        totals.messages += len(batch)
        totals.cancelled += cancelled
        totals.duplicates += duplicates
        totals.per_batch.append(len(batch))


def run_sweep(
    store: Store, *, stop: threading.Event, max_messages: int = 1000, ready: Callable[[], None] | None = None
) -> tuple[SweepTotals, ConsumeTotals]:
    """The continuous sweep (`python -m delaywheel_shop sweep`): the waiting consumer of the order timeouts, asleep until
    the topic's delivery notification (consume.py), one `apply_timeouts` transaction per batch, acked after it
    commits. Runs until `stop`; the batch in hand is applied and acked first. `ready` is called once connected:
    a timer delivered before the consumer LISTENs is found by its first pull. Returns the totals, and the
    consumer's (how it waited, what stopped it)."""
    from delaywheel.consume.consumer import consume

    totals = SweepTotals()

    def handler(messages: list[Delivered]) -> None:
        cancelled, duplicates = apply_timeouts(store.conn, messages)
        totals.batches += 1
        totals.messages += len(messages)
        totals.cancelled += cancelled
        totals.duplicates += duplicates
        totals.per_batch.append(len(messages))

    store.conn  # noqa: B018  # connect (and fail on a wrong URL) before saying ready
    if ready is not None:
        ready()
    return totals, consume(store, TOPIC, GROUP, handler, max_messages=max_messages, stop=stop)


def run_customers(
    store: Store,
    *,
    stop: threading.Event,
    every_s: float = 0.1,
    duration_s: float | None = None,
    ready: Callable[[], None] | None = None,
) -> dict[str, int]:
    """The simulated customers (`python -m delaywheel_shop customers`, the `shop_customers` DAG): every `every_s`, carry out
    the planned actions that have fallen due, until `stop` (or `duration_s`). A tick in progress finishes first.
    Plans are timed from each order's placement (place_orders), so a slow tick delays a payment's processing,
    never the time the customer paid (`shop.settle_in_time`); but a payment processed after the sweep applied its
    order's timeout is refused. So the settled orders' timers are cancelled by a second connection, in a thread,
    and a slow cancel never holds back the next tick; the last cancels finish before this returns."""
    totals: Counter[str] = Counter(payments=0, accepted=0, customer_cancels=0)
    until = None if duration_s is None else time.monotonic() + duration_s
    settled: queue.Queue[tuple[list[int], list[int]] | None] = queue.Queue()
    failed: list[BaseException] = []

    def cancel_timers() -> None:
        try:
            with Store(store.url, store.settings) as canceller:
                while (done := settled.get()) is not None:
                    _cancel_timers(canceller, done[0], "order paid")
                    _cancel_timers(canceller, done[1], "cancelled by customer")
        except BaseException as exc:  # handed to the ticking thread, which raises it
            failed.append(exc)

    store.conn  # noqa: B018
    canceller = threading.Thread(target=cancel_timers, name="shop-customers-timer-cancels", daemon=True)
    canceller.start()
    if ready is not None:
        ready()
    try:
        while not stop.is_set() and (until is None or time.monotonic() < until) and not failed:
            payments, paid, cancelled = _settle_due(store, None)
            totals.update(payments=payments, accepted=len(paid), customer_cancels=len(cancelled))
            settled.put((paid, cancelled))
            stop.wait(every_s)
    finally:
        settled.put(None)
        canceller.join()
    if failed:
        raise failed[0]
    return dict(totals)
