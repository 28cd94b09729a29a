"""Consumer-observed lateness through the library consumer (issue 19, first benchmark).

Three processes on one store: a producer sending a steady `--rate` (1,000) messages/s, each with a random delay of
1-10 s (`send_many` every 10 ms: timing-wheel timers); one `delaywheel deliver` process; one consumer
(`Store.consume` in a process of its own) recording, per message, when its handler got it (`time.time()`, the same
clock as the database's on this machine) minus its due time. Reported: the consumer's p50 / p99 / max, early (must
be 0), duplicates and missing, against the issue's targets, beside the delivery-only lateness (delivered_at -
deliver_at) of the same messages as the baseline: the ratio is what the consumer adds.

    python -m bench consumer_lateness [--minutes 10] [--freeze] [--scale S: minutes = 10 x S]

`--freeze` freezes the consumer's start-up heap first, as the CLI's `consume` does.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from delaywheel import Message, Store
from delaywheel.dev.local_airflow import as_url
from delaywheel.heap import freeze_after_startup

from .common import Check, drop_database, fresh_database, load_options, log, report

DB = "delaywheel_bench_consumer"
TOPIC = "bench.consume"
GROUP = "bench"
TICK_S = 0.01


def produce(url: str, rate: int, seconds: float, seed: int, out: Any) -> None:
    """`rate` messages/s for `seconds`, a batch every TICK_S on a fixed schedule; sends the ids to `out`."""
    rng = random.Random(seed)
    ids: list[int] = []
    with Store(url) as store:
        started = time.monotonic()
        tick = 0
        while (now := time.monotonic()) < started + seconds:
            due_ticks = int((now - started) / TICK_S) + 1  # catch up after a slow send
            n = int(due_ticks * TICK_S * rate) - len(ids)
            if n > 0:
                ids += store.send_many(
                    [
                        Message(TOPIC, {"i": len(ids) + k}, delay=timedelta(seconds=rng.uniform(1.0, 10.0)))
                        for k in range(n)
                    ]
                )
            tick = due_ticks
            time.sleep(max(0.0, started + tick * TICK_S - time.monotonic()))
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


def run(args: argparse.Namespace) -> tuple[list[Check], list[str]]:
    url = fresh_database(DB)
    seconds = args.minutes * 60
    ctx = mp.get_context("spawn")
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": as_url(url)}
    deliverer = subprocess.Popen(
        [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", f"{seconds + 120:.0f}s"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stop, count = ctx.Event(), ctx.Value("q", 0)
    consumed_rx, consumed_tx = ctx.Pipe(duplex=False)
    produced_rx, produced_tx = ctx.Pipe(duplex=False)
    consumer = ctx.Process(target=consume, args=(url, stop, count, consumed_tx, args.freeze))
    producer = ctx.Process(target=produce, args=(url, args.rate, seconds, args.seed, produced_tx))
    load_before = os.getloadavg()
    try:
        consumer.start()
        time.sleep(3.0)  # the consumer and the deliverer are up and waiting
        log(f"producing {args.rate}/s for {seconds:.0f} s")
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
        deliverer.terminate()
        deliverer.wait(timeout=30)
        for proc in (producer, consumer):
            if proc.is_alive():
                proc.kill()
    load_after = os.getloadavg()
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
        f"{len(ids):,} sent at {args.rate}/s over {args.minutes:g} min, delays uniform 1-10 s (timing wheel);"
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
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (2 cores shared)"
        + (f"; {args.note}" if args.note else ""),
    ]
    drop_database(DB)
    return checks, notes


def main(argv: list[str] | None = None, name: str = "consumer_lateness") -> list[Check]:
    parser = load_options(argparse.ArgumentParser(description=__doc__), minutes=10.0, seed=19)
    parser.add_argument("--freeze", action="store_true", help="freeze the consumer's start-up heap, as the CLI does")
    parser.add_argument("--scale", type=float, help="minutes = 10 x scale (`python -m bench contract --scale S`)")
    args = parser.parse_args(argv)
    if args.scale is not None:
        args.minutes = 10 * args.scale
    started = datetime.now(UTC)
    checks, notes = run(args)
    report(name, "Consumer-observed lateness, library consumer", checks, notes, started, argv)
    return checks
