"""Consumer-observed lateness through the library consumer (issue 19, first benchmark).

Three processes on one store: a producer sending a steady `--rate` (1,000) messages/s, each with a random delay of
1-10 s (`send_many` every 10 ms: timing-wheel timers); one `delaywheel deliver` process; one consumer
(`Store.consume` in a process of its own) recording, per message, when its handler got it (`time.time()`, the same
clock as the database's on this machine) minus its due time. Reported: the consumer's p50 / p99 / max, early (must
be 0), duplicates and missing, against the issue's targets, beside the delivery-only lateness (delivered_at -
deliver_at) of the same messages as the baseline: the ratio is what the consumer adds. To tell where a slow message's
time went, the consumer's process also records its timeline (`Timeline`: each pull with the CPU time and run-queue
wait of the consumer and of its server process, each wait, each long garbage collection), and the three slowest
messages are shown against it.

Run: `python -m bench.consumer_lateness --minutes 3` (the issue's figure is for 10 minutes); `--freeze` freezes the
consumer's start-up heap first, as the CLI's `consume` does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from delaywheel import Message, Store
from delaywheel.consume import consumer as consumer_module
from delaywheel.consume import topics
from delaywheel.dev.local_airflow import as_url
from delaywheel.heap import freeze_after_startup

from .common import Check, drop_database, fresh_database, load_options, log, print_section

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
    """The library consumer; per message (message_id, received, due, delivered) as epoch seconds, and the consumer's
    timeline (`Timeline`) to explain its slowest messages. `freeze`: its start-up heap frozen first, as the CLI's
    `consume` does (heap.py)."""
    seen: list[tuple[int, float, float, float]] = []
    timeline = Timeline()
    if freeze:
        freeze_after_startup()

    def handler(messages: list) -> None:
        now = time.time()
        seen.extend((m.message_id, now, m.deliver_at.timestamp(), m.delivered_at.timestamp()) for m in messages)
        count.value = len(seen)

    before = schedstat("self")
    with Store(url) as store, timeline.recording():
        totals = store.consume(TOPIC, GROUP, handler, max_messages=500, stop=stop)
    out.send((seen, vars(totals), delta(before, schedstat("self")), timeline))


@dataclass
class Timeline:
    """What the consumer did, as (start, end, detail) in epoch seconds: its pulls (`topics.ack_and_pull`, detail the
    rows pulled, negative when it found rows past the offset it could not read yet; then the ms the consumer and its
    server process each spent on a CPU and runnable waiting for one during the pull, from /proc's schedstat), its
    waits (`Consumer._wait`, detail 1 when a notification ended the wait) and the interpreter's garbage collections
    of 2 ms or more (detail the generation). Recorded by wrapping the two functions and through `gc.callbacks`, in
    the consumer's process only; the library itself keeps no such log."""

    pulls: list[tuple[float, float, int, float, float, float, float]] = field(default_factory=list)
    waits: list[tuple[float, float, int]] = field(default_factory=list)
    collections: list[tuple[float, float, int]] = field(default_factory=list)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        real_pull, real_wait = topics.ack_and_pull, consumer_module.Consumer._wait
        depth = [0]  # ack_and_pull calls itself on a fallback: record the outer call

        def pull(conn: Any, *args: Any, **kwargs: Any) -> Any:
            backend = str(conn.info.backend_pid)
            start, mine, theirs = time.time(), schedstat("thread-self"), schedstat(backend)
            depth[0] += 1
            try:
                result = real_pull(conn, *args, **kwargs)
            finally:
                depth[0] -= 1
            if not depth[0]:
                batch = result[1]
                (my_run, my_wait, _), (their_run, their_wait, _) = (
                    delta(mine, schedstat("thread-self")),
                    delta(theirs, schedstat(backend)),
                )
                rows = len(batch.messages) or (-1 if batch.behind else 0)
                self.pulls.append(
                    (start, time.time(), rows, my_run / 1e6, my_wait / 1e6, their_run / 1e6, their_wait / 1e6)
                )
            return result

        collecting = [0.0]

        def collected(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                collecting[0] = time.time()
            elif (end := time.time()) - collecting[0] >= 0.002:
                self.collections.append((collecting[0], end, info["generation"]))

        def wait(consumer: Any, seconds: float) -> bool:
            start = time.time()
            woke = real_wait(consumer, seconds)
            self.waits.append((start, time.time(), int(woke)))
            return woke

        topics.ack_and_pull, consumer_module.Consumer._wait = pull, wait  # type: ignore[method-assign, assignment]
        gc.callbacks.append(collected)
        try:
            yield
        finally:
            gc.callbacks.remove(collected)
            topics.ack_and_pull, consumer_module.Consumer._wait = real_pull, real_wait  # type: ignore[method-assign]

    def explain(self, received: float, delivered: float, due: float) -> str:
        """Where one message's time between its delivery and its handler went: the pulls, waits and collections in
        between."""
        steps: list[tuple[Any, ...]] = [("pull", *p) for p in self.pulls] + [("wait", *w) for w in self.waits]
        steps += [("gc", *c) for c in self.collections]
        between = sorted((s for s in steps if s[2] > delivered - 0.05 and s[1] < received), key=lambda s: s[1])
        shown = ", ".join(
            f"{step[0]} {(step[1] - due) * 1000:+.0f}..{(step[2] - due) * 1000:+.0f}{_detail(step)}"
            for step in between[-8:]
        )
        return (
            f"due {datetime.fromtimestamp(due, UTC):%H:%M:%S.%f}"[:-3] + f" UTC, delivered"
            f" {(delivered - due) * 1000:+.0f}, received {(received - due) * 1000:+.0f} ms;"
            f" {len(between)} steps in between{', the last: ' + shown if shown else ''}"
        )

    def slow_pulls(self, over_s: float) -> str:
        """The pulls' durations, and where the time of those over `over_s` went (the slow ones' total, of it the
        server process runnable but waiting for a CPU, and the consumer the same), and the longest collections."""
        if not self.pulls:
            return "no pulls"
        pulls = np.array(self.pulls)  # the columns of `pulls`' tuples
        durations = (pulls[:, 1] - pulls[:, 0]) * 1000
        slow = durations > over_s * 1000
        return (
            f"pulls: {len(durations):,}, duration p50 {np.percentile(durations, 50):.1f} ms, p99"
            f" {np.percentile(durations, 99):.1f} ms, max {durations.max():.1f} ms; {int(slow.sum())} over"
            f" {over_s * 1000:.0f} ms, {durations[slow].sum():.0f} ms in all, of which its server"
            f" process waited for a CPU {pulls[slow, 6].sum():.0f} ms and the consumer {pulls[slow, 4].sum():.0f} ms;"
            f" garbage collections of 2 ms or more: {len(self.collections)}, longest"
            f" {max((c[1] - c[0] for c in self.collections), default=0) * 1000:.1f} ms"
        )


def _detail(step: tuple[Any, ...]) -> str:
    kind, detail = step[0], step[3]
    if kind == "pull":
        return (
            f" ({detail} rows; consumer on a CPU {step[4]:.0f} ms, runnable {step[5]:.0f} ms;"
            f" its server process {step[6]:.0f} / {step[7]:.0f} ms)"
        )
    if kind == "gc":
        return f" (generation {detail})"
    return " (notified)" if detail else ""


def schedstat(pid: str) -> tuple[int, int, int]:
    """A process's (ns on a CPU, ns waiting for one while runnable, timeslices) so far (/proc/PID/schedstat)."""
    with open(f"/proc/{pid}/schedstat") as f:
        run_ns, wait_ns, slices = (int(v) for v in f.read().split())
    return run_ns, wait_ns, slices


def delta(before: tuple[int, int, int], after: tuple[int, int, int]) -> tuple[int, int, int]:
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def cpu_note(name: str, stat: tuple[int, int, int]) -> str:
    run_ns, wait_ns, slices = stat
    return (
        f"{name}: {run_ns / 1e9:.1f} s on a CPU, {wait_ns / 1e9:.1f} s runnable but waiting for one,"
        f" {slices:,} timeslices (mean wait {wait_ns / max(slices, 1) / 1e6:.2f} ms)"
    )


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
    deliverer_before = schedstat(str(deliverer.pid))
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
        seen, totals, consumer_cpu, timeline = consumed_rx.recv()
        deliverer_cpu = delta(deliverer_before, schedstat(str(deliverer.pid)))
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
        cpu_note("consumer process", consumer_cpu) + "; " + cpu_note("deliverer process", deliverer_cpu),
        "consumer " + timeline.slow_pulls(0.1),
        *(
            f"slowest message {rank + 1}: " + timeline.explain(received[first][i], delivered[first][i], due[first][i])
            for rank, i in enumerate(np.argsort(lateness_ms)[::-1][:3])
        ),
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (2 cores shared)"
        + (f"; {args.note}" if args.note else ""),
    ]
    drop_database(DB)
    return checks, notes


def main(argv: list[str] | None = None) -> list[Check]:
    parser = load_options(argparse.ArgumentParser(description=__doc__), minutes=3.0, seed=19)
    parser.add_argument("--freeze", action="store_true", help="freeze the consumer's start-up heap, as the CLI does")
    args, _ = parser.parse_known_args(argv)  # run_all passes its own arguments (--scale) to every module
    started = datetime.now(UTC)
    checks, notes = run(args)
    print_section(
        "Consumer-observed lateness, library consumer (issue 19)",
        checks,
        notes,
        started,
        "python -m bench.consumer_lateness " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    return checks


if __name__ == "__main__":
    sys.exit(0 if all(c.passed for c in main()) else 1)
