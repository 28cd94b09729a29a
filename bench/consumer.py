"""What the library consumer (`Store.consume`) adds to delivery, against baselines of the same run; the producer,
one `delaywheel deliver` process (every lane) and the consumer each a process of its own.

consumer_lateness: a steady 1,000 messages/s, each due in 1-10 s (the timing wheel); the consumer records when its
handler got each message (`time.time()`, the database's clock on this machine) minus its due time: p50 / p99 / max
beside the delivery-only lateness (delivered_at - deliver_at) of the same messages, and exactly once (no message
early, twice or missing). Targets: 25 / 100 / 500 ms. `--freeze`: the consumer's start-up heap frozen, as the CLI's.
consumer_drain: (a) 1M due messages (~90-byte bodies, due by the injected send clock) delivered only: messages /
(last delivered_at - the deliverer's ready line); (b) 1M more end to end, the consumer (batches of `--max-messages`,
a handler that looks at each message) waiting before the deliverer starts: messages / (last ack - ready); (c) (a)'s
rows in a plain table keyed by delivery order, drained by RAW_DRAIN (the queue-table idiom of PGMQ and its kind),
each batch fetched, with `enable_seqscan = off`: the plan a queue table is meant to have (left to itself the
planner scans the whole table every batch); (d) one consumer reading (a)'s delivered rows, nothing delivering.
Targets: (b) >= 0.8 x (a), >= 1.0 x (c); (d) >= 0.7 x (c).

    python -m bench consumer_lateness [--minutes 10 | --scale S: minutes = 10 x S] [--freeze] [--note TEXT]
    python -m bench consumer_drain [--scale 0.1] [--max-messages 1000] [--note TEXT]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import resource
import time
from datetime import timedelta
from typing import Any

import numpy as np
import psycopg

from delaywheel import Message, Store
from delaywheel.heap import freeze_after_startup

from .common import Check, Deliverer, at_least, body, chunks, database, load_note, log, options, report, scaled

GROUP = "bench"
RATE, TICK_S = 1000, 0.01  # lateness: messages a second, sent every TICK_S
TOPIC = "bench.consume"
TOPIC_DELIVERY, TOPIC_E2E = "bench.drain.delivery", "bench.drain.e2e"
RAW_DRAIN = (
    "DELETE FROM raw_drain WHERE id IN (SELECT id FROM raw_drain ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)"
    " RETURNING *"
)
NOTE = "a note for the results (e.g. the background load)"


def main(argv: list[str], name: str) -> list[Check]:
    return {"consumer_lateness": lateness, "consumer_drain": drain}[name](argv, name)


# --- consumer_lateness ----------------------------------------------------------------------------------------------


def produce(url: str, seconds: float, out: Any) -> None:
    """RATE messages/s for `seconds`, a batch every TICK_S on a fixed schedule; sends the ids to `out`."""
    rng = random.Random(19)
    ids: list[int] = []
    with Store(url) as store:
        started = time.monotonic()
        while (now := time.monotonic()) < started + seconds:
            ticks = int((now - started) / TICK_S) + 1  # catch up after a slow send
            if (n := int(ticks * TICK_S * RATE) - len(ids)) > 0:
                delays = [timedelta(seconds=rng.uniform(1.0, 10.0)) for _ in range(n)]
                ids += store.send_many([Message(TOPIC, {"i": len(ids) + k}, delay=d) for k, d in enumerate(delays)])
            time.sleep(max(0.0, started + ticks * TICK_S - time.monotonic()))
    out.send(ids)


def consume(url: str, stop: Any, count: Any, out: Any, freeze: bool) -> None:
    """The library consumer; per message (message_id, received, due, delivered) as epoch seconds. `freeze`: its
    start-up heap frozen first, as the CLI's `consume` does (heap.py)."""
    seen: list[tuple[int, float, float, float]] = []
    if freeze:
        freeze_after_startup()

    def handler(messages: list) -> None:
        now = time.time()
        seen.extend((m.message_id, now, m.deliver_at.timestamp(), m.delivered_at.timestamp()) for m in messages)
        count.value = len(seen)

    with Store(url) as store:
        totals = store.consume(TOPIC, GROUP, handler, max_messages=500, stop=stop)
    out.send((seen, vars(totals)))


def percentiles(values: np.ndarray) -> tuple[float, float, float]:
    if not len(values):
        return (float("nan"),) * 3
    return float(np.percentile(values, 50)), float(np.percentile(values, 99)), float(values.max())


def lateness_run(url: str, seconds: float, freeze: bool) -> tuple[list[int], list[tuple], dict[str, Any], float]:
    """The three processes for `seconds`: the ids sent, what the consumer saw and its totals, the load before."""
    ctx = mp.get_context("spawn")
    stop, count = ctx.Event(), ctx.Value("q", 0)
    consumed_rx, consumed_tx = ctx.Pipe(duplex=False)
    produced_rx, produced_tx = ctx.Pipe(duplex=False)
    consumer = ctx.Process(target=consume, args=(url, stop, count, consumed_tx, freeze))
    producer = ctx.Process(target=produce, args=(url, seconds, produced_tx))
    load_before = os.getloadavg()[0]
    deliverer = Deliverer(url, seconds + 120)
    try:
        consumer.start()
        time.sleep(3.0)  # the consumer is up and waiting
        log(f"producing {RATE}/s for {seconds:.0f} s")
        producer.start()
        ids: list[int] = produced_rx.recv()
        producer.join()
        log(f"sent {len(ids):,}; waiting for the last to fall due and be consumed")
        deadline = time.monotonic() + 60
        while count.value < len(ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # anything extra (a duplicate) would show up now
        stop.set()
        seen, totals = consumed_rx.recv()
        consumer.join(30)
    finally:
        stop.set()
        deliverer.stop()
        for proc in (producer, consumer):
            if proc.is_alive():
                proc.kill()
    return ids, seen, totals, load_before


def lateness(argv: list[str], name: str) -> list[Check]:
    parser = options(__doc__, "minutes = 10 x scale, unless --minutes says", batch=False)
    parser.add_argument("--minutes", type=float, help="producing time (default 10)")
    parser.add_argument("--freeze", action="store_true", help="freeze the consumer's start-up heap, as the CLI does")
    parser.add_argument("--note", default="", help=NOTE)
    args = parser.parse_args(argv)
    args.minutes = args.minutes or 10 * args.scale
    with database("delaywheel_bench_consumer") as url:
        ids, seen, totals, load_before = lateness_run(url, args.minutes * 60, args.freeze)
    got = np.array([s[0] for s in seen], dtype=np.int64)
    received, due, delivered = (np.array([s[i] for s in seen]) for i in (1, 2, 3))
    unique, first = np.unique(got, return_index=True)
    lateness_ms = (received[first] - due[first]) * 1000
    delivery_ms = (delivered[first] - due[first]) * 1000
    early = int((lateness_ms < 0).sum())
    duplicates = len(got) - len(unique)
    missing = len(set(ids) - set(unique.tolist()))
    p50, p99, worst = percentiles(lateness_ms)
    d50, d99, dworst = percentiles(delivery_ms)
    ok_counts = early == 0 and duplicates == 0 and missing == 0
    checks = [
        Check("consumer lateness p50 (ms) vs delivery-only p50", p50, d50, "<= 25 ms", p50 <= 25),
        Check("consumer lateness p99 (ms) vs delivery-only p99", p99, d99, "<= 100 ms", p99 <= 100),
        Check("consumer lateness max (ms) vs delivery-only max", worst, dworst, "<= 500 ms", worst <= 500),
        Check("early + duplicates + missing (messages)", early + duplicates + missing, len(ids), "0", ok_counts),
    ]
    handoff = lateness_ms - delivery_ms
    notes = [
        f"{len(ids):,} sent at {RATE}/s over {args.minutes:g} min, delays uniform 1-10 s (timing wheel);"
        f" one `delaywheel deliver` process, one `Store.consume` process (batches of up to 500)",
        f"consumer lateness (received - due): p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms;"
        f" early {early}, duplicates {duplicates}, missing {missing}",
        f"delivery-only lateness (delivered_at - due), same messages: p50 {d50:.1f} ms, p99 {d99:.1f} ms,"
        f" max {dworst:.1f} ms",
        f"what the consumer adds (received - delivered_at): p50 {np.percentile(handoff, 50):.1f} ms,"
        f" p99 {np.percentile(handoff, 99):.1f} ms"
        if len(handoff)
        else "nothing received",
        f"consumer: {totals['batches']:,} batches, {totals['notified_wakes']:,} woken by NOTIFY,"
        f" {totals['safety_wakes']} safety wakes, {totals.get('held_acks', 0):,} acks held in vain,"
        f" {totals['empty_pulls']:,} empty pulls"
        f" ({totals['repulls']:,} looks again after a notified pull found nothing readable), {totals['busy']} busy,"
        f" {totals['reconnects']} reconnects; start-up heap "
        + ("frozen (gc.freeze, as the CLI's consume does)" if args.freeze else "not frozen"),
        load_note(load_before, args.note),
    ]
    return report(name, "Consumer-observed lateness, library consumer", checks, notes, argv)


# --- consumer_drain -------------------------------------------------------------------------------------------------


def load(store: Store, topic: str, count: int, batch: int) -> None:
    """`count` level-1 messages sent a minute ago by the injected clock, so all are due; then settled."""
    at, started = store.clock() - timedelta(minutes=1), time.perf_counter()
    for start, size in chunks(count, batch):
        store.send_many([Message(topic, body(i), 1, key=f"drain-{i}") for i in range(start, start + size)], now=at)
    log(f"{topic}: {count:,} due messages loaded in {time.perf_counter() - started:.1f} s")
    settle(store.conn)


def settle(conn: psycopg.Connection) -> None:
    """Between phases: dead rows vacuumed and dirty pages written, so no phase pays for the one before."""
    conn.execute("VACUUM (ANALYZE)")
    conn.execute("CHECKPOINT")


def consumer(url: str, count: int, max_messages: int, ready: Any, out: Any, topic: str = TOPIC_E2E) -> None:
    """The consumer process: `count` messages of `topic` through `Store.consume`, then (time of the last ack, its
    totals, its CPU seconds)."""
    seen = 0

    def handler(messages: list) -> None:
        nonlocal seen
        for m in messages:  # look at each message, as a real handler would
            seen += len(m.body)

    with Store(url) as store:
        store.conn  # noqa: B018  (connected before the clock starts)
        ready.set()
        totals = store.consume(topic, GROUP, handler, max_messages=max_messages, limit=count)
        finished = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.send((finished, vars(totals), usage.ru_utime + usage.ru_stime))


def last_delivery(conn: psycopg.Connection, topic: str) -> tuple[float, float, int]:
    """(first, last delivered_at as epoch seconds, rows) of a topic."""
    first, last, rows = conn.execute(  # type: ignore[misc]
        "SELECT extract(epoch FROM min(delivered_at)), extract(epoch FROM max(delivered_at)), count(*)"
        " FROM delaywheel.topic_messages WHERE topic = %s",
        (topic,),
    ).fetchone()
    return float(first), float(last), int(rows)


def delivery_only(url: str, store: Store, count: int, batch: int) -> tuple[float, float]:
    """(a): returns (rate, seconds from ready to the first delivery)."""
    load(store, TOPIC_DELIVERY, count, batch)
    deliverer = Deliverer(url, progress=True)
    try:
        deliverer.wait_for(count, 600)
    finally:
        deliverer.stop()
    first, last, rows = last_delivery(store.conn, TOPIC_DELIVERY)
    if rows != count:
        raise RuntimeError(f"(a) the topic holds {rows:,} rows, expected {count:,}")
    seconds = last - deliverer.ready_at
    log(f"(a) delivery only: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    return count / seconds, first - deliverer.ready_at


def end_to_end(url: str, store: Store, count: int, batch: int, max_messages: int) -> tuple:
    """(b): the consumer waits on the topic; the deliverer starts once everything is loaded. Returns the rate, the
    seconds from ready to the last ack and to the last delivery, the consumer's totals and CPU seconds."""
    load(store, TOPIC_E2E, count, batch)
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    proc = ctx.Process(target=consumer, args=(url, count, max_messages, ready, tx))
    proc.start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError("(b) the consumer did not start within 120 s")
    time.sleep(1.0)  # listening, and its first pull found nothing: it waits
    deliverer = Deliverer(url, progress=True)
    try:
        if not rx.poll(900):
            raise RuntimeError("(b) the consumer did not finish within 900 s")
        finished, totals, cpu_s = rx.recv()
        proc.join(30)
    finally:
        deliverer.stop()
        if proc.is_alive():
            proc.kill()
    _, delivered_last, _ = last_delivery(store.conn, TOPIC_E2E)
    row = store.conn.execute(
        "SELECT sum(acked)::bigint FROM delaywheel.consumer_offsets WHERE grp = %s AND topic = %s", (GROUP, TOPIC_E2E)
    ).fetchone()
    acked = int(row[0]) if row and row[0] is not None else 0
    if totals["messages"] != count or acked != count:
        raise RuntimeError(f"(b) handled {totals['messages']:,}, acked {acked:,}, expected {count:,}")
    seconds = finished - deliverer.ready_at
    log(f"(b) end to end: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    return count / seconds, seconds, delivered_last - deliverer.ready_at, totals, cpu_s


def consumer_only(url: str, count: int, max_messages: int) -> float:
    """(d): one consumer reading (a)'s delivered rows, nothing delivering meanwhile: the consumer's own drain rate."""
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    proc = ctx.Process(target=consumer, args=(url, count, max_messages, ready, tx, TOPIC_DELIVERY))
    proc.start()
    ready.wait(120)
    started = time.time()
    if not rx.poll(900):
        proc.kill()
        raise RuntimeError("(d) the consumer did not finish within 900 s")
    finished, totals, _ = rx.recv()
    proc.join(30)
    if totals["messages"] != count:
        raise RuntimeError(f"(d) handled {totals['messages']:,}, expected {count:,}")
    log(f"(d) consumer only: {count:,} in {finished - started:.2f} s = {count / (finished - started):,.0f} msg/s")
    return count / (finished - started)


def raw_drain(conn: psycopg.Connection, count: int, n: int) -> tuple[float, str]:
    """(c): (a)'s rows in a plain table, drained n at a time by DELETE ... RETURNING, read by the client. Returns
    the rate and, if the planner left to itself would have read the whole table for every batch, a note saying so."""
    conn.execute(
        """CREATE TABLE raw_drain AS
        SELECT row_number() OVER (ORDER BY xid, queue_offset) AS id, topic, queue_offset, message_id, key, tags,
               properties, body, is_json, reconsume_times, deliver_at, delivered_at
        FROM delaywheel.topic_messages WHERE topic = %s""",
        (TOPIC_DELIVERY,),
    )
    conn.execute("ALTER TABLE raw_drain ADD PRIMARY KEY (id)")
    settle(conn)
    planned = conn.execute(f"EXPLAIN {RAW_DRAIN}", (n,)).fetchall()  # type: ignore[arg-type]
    conn.execute("SET enable_seqscan = off")  # the index plan (see the module docstring)
    drained, started = 0, time.perf_counter()
    while rows := conn.execute(RAW_DRAIN, (n,)).fetchall():  # type: ignore[arg-type]
        drained += len(rows)
    seconds = time.perf_counter() - started
    conn.execute("RESET enable_seqscan")
    if drained != count:
        raise RuntimeError(f"(c) drained {drained:,}, expected {count:,}")
    log(f"(c) raw drain: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    seq_scan = "Seq Scan" in "".join(r[0] for r in planned)
    return count / seconds, "; left to itself the planner chose a sequential scan, every batch" if seq_scan else ""


def drain(argv: list[str], name: str) -> list[Check]:
    parser = options(__doc__, "multiply the message count (1.0 = 1,000,000)")
    parser.add_argument("--max-messages", type=int, default=1000, help="the consumer's batch and the raw drain's LIMIT")
    parser.add_argument("--note", default="", help=NOTE)
    args = parser.parse_args(argv)
    count, load_before = scaled(1_000_000, args.scale), os.getloadavg()[0]
    with database("delaywheel_bench_drain") as url, Store(url) as store:
        store.prepare()
        delivery, first_s = delivery_only(url, store, count, args.batch)
        raw, plan = raw_drain(store.conn, count, args.max_messages)
        settle(store.conn)
        alone = consumer_only(url, count, args.max_messages)
        rate, acked_s, delivered_s, totals, cpu_s = end_to_end(url, store, count, args.batch, args.max_messages)
    checks = [
        at_least("end-to-end drain vs delivery only (msg/s)", rate, delivery, 0.8),
        at_least("end-to-end drain vs raw DELETE ... RETURNING drain (msg/s)", rate, raw, 1.0),
        at_least("one consumer's drain of delivered rows vs the raw drain (msg/s)", alone, raw, 0.7),
    ]
    notes = [
        f"{count:,} due level-1 messages per phase (~90-byte bytes bodies, a key each), sent by `send_many` with the"
        f" clock injected a minute back; one `delaywheel deliver` process (every lane) from its ready line",
        f"(a) delivery only {delivery:,.0f} msg/s (first delivery {first_s:.2f} s after ready)",
        f"(b) end to end {rate:,.0f} msg/s: last ack {acked_s:.2f} s after ready, last delivery"
        f" {delivered_s:.2f} s after ready (delivery beside the consumer:"
        f" {count / delivered_s:,.0f} msg/s); one `Store.consume` process, max_messages"
        f" {args.max_messages}: {totals['batches']:,} batches, {totals['empty_pulls']:,} empty pulls,"
        f" {totals['notified_wakes']:,} notified wakes, {totals['safety_wakes']} safety wakes;"
        f" consumer CPU {cpu_s:.1f} s ({cpu_s / count * 1e6:.1f} µs a message)",
        f"(d) one consumer alone on (a)'s delivered rows {alone:,.0f} msg/s",
        f"(c) raw drain {raw:,.0f} msg/s: `{RAW_DRAIN % args.max_messages}`, autocommit, fetchall, the same rows;"
        " planned with enable_seqscan off (a nested loop over the primary key)" + plan,
        load_note(load_before, args.note),
    ]
    return report(name, "End-to-end drain by one consumer", checks, notes, argv)
