"""A consumer group's members sharing its load (competing consumers), against the group's single consumer measured in
the same run; each consumer a process of its own (`Store.consume`).

(a) scaling: `--count` due messages over 2,000 keys, already in the topic, handled by 1, 2, 4 and 8 consumers whose
handler takes 5 ms a message: throughput (messages / (last handled - start)); per-key order violations and lost
messages counted. Targets: 4 consumers >= 3.5 x one, 8 >= 6 x one; 0 violations, 0 lost.
(b) lateness at a steady 1,000 messages/s (delays 1-10 s, the timing wheel) with 1, then 4 consumers in one group:
received - due, p99. Target: 4 consumers' p99 <= 1.2 x one's.
(c) a kill: 4 consumers at 1,000 messages/s; one is SIGKILLed mid-run: every message handled, duplicates only from
the killed consumer's batch, and how late the messages of its keys due after the kill came.

    python -m bench group [--count 4000] [--seconds 60] [--note TEXT]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from datetime import timedelta
from typing import Any

import numpy as np

from delaywheel import Message, Store

from .common import Check, Deliverer, at_least, database, load_note, log, options, report

GROUP, TOPIC = "bench", "bench.group"
KEYS = 2000  # (a): two or more messages a key at the default count
HANDLER_S = 0.005  # (a): each message's handling
RATE, TICK_S = 1000, 0.01


def main(argv: list[str], name: str) -> list[Check]:
    parser = options(__doc__, "multiply --count and --seconds", batch=False)
    parser.add_argument("--count", type=int, default=4000, help="(a) messages per run")
    parser.add_argument("--seconds", type=float, default=60.0, help="(b), (c): producing time per run")
    parser.add_argument("--note", default="", help="a note for the results (e.g. the background load)")
    args = parser.parse_args(argv)
    count, seconds, load_before = int(args.count * args.scale), args.seconds * args.scale, os.getloadavg()[0]
    with database("delaywheel_bench_group") as url:
        rates = {n: scaling_run(url, f"{TOPIC}.scale{n}", count, n) for n in (1, 2, 4, 8)}
        deliverer = Deliverer(url, 3 * seconds + 300)
        try:
            late = {n: steady_run(url, f"{TOPIC}.late{n}", seconds, n, kill=False) for n in (1, 4)}
            killed = steady_run(url, f"{TOPIC}.kill", seconds, 4, kill=True)
        finally:
            deliverer.stop()
    one = rates[1]["rate"]
    bad = sum(r["violations"] + r["lost"] for r in rates.values())
    bad_late = sum(r["early"] + r["lost"] + r["dup"] for r in late.values()) + killed["lost"] + killed["early"]
    checks = [
        at_least("2 consumers' throughput vs 1 (msg/s)", rates[2]["rate"], one, 1.8),
        at_least("4 consumers' throughput vs 1 (msg/s)", rates[4]["rate"], one, 3.5),
        at_least("8 consumers' throughput vs 1 (msg/s)", rates[8]["rate"], one, 6.0),
        Check("per-key order violations + lost, (a)", bad, count, "0", bad == 0),
        Check(
            "4 consumers' lateness p99 vs 1's (ms)",
            late[4]["p99"],
            late[1]["p99"],
            "ratio <= 1.20",
            late[4]["p99"] <= 1.2 * late[1]["p99"],
        ),
        Check(
            "early + lost + duplicates, (b) and (c) (messages)",
            bad_late,
            late[1]["sent"],
            "0 (c: dup from its batch)",
            bad_late == 0 and killed["dup"] <= killed["killed_batch"],
        ),
    ]
    notes = [
        f"(a) {count:,} messages over {KEYS} keys in the topic, handler {HANDLER_S * 1000:g} ms a message, batches of"
        " up to 20: " + "; ".join(f"{n}: {r['rate']:,.0f} msg/s ({r['spread']})" for n, r in rates.items()),
        f"(b) {RATE}/s for {seconds:g} s, delays 1-10 s: "
        + "; ".join(
            f"{n} consumer(s): p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms"
            for n, r in late.items()
        ),
        f"(c) 4 consumers, one SIGKILLed {killed['killed_at']:.0f} s in: {killed['dup']} duplicates (its batch in hand"
        f" {killed['killed_batch']}), lost {killed['lost']}; the keys of its last batch: their messages due after the kill"
        f" came at most {killed['wait_ms']:.0f} ms late; p99 {killed['p99']:.1f} ms",
        load_note(load_before, args.note),
    ]
    return report(name, "Competing consumers in one group", checks, notes, argv)


def member(url: str, topic: str, go: Any, stop: Any, out: Any, work_s: float, idle_s: float | None) -> None:
    """One consumer of the group: reports each batch as it is handled, (id, key, received, due) per message."""

    def handler(messages: list) -> None:
        now = time.time()
        if work_s:
            time.sleep(work_s * len(messages))
        out.send(("batch", os.getpid(), [(m.message_id, m.key, now, m.deliver_at.timestamp()) for m in messages]))

    with Store(url) as store:
        store.conn  # noqa: B018
        go.wait()
        store.consume(topic, GROUP, handler, max_messages=20 if work_s else 500, stop=stop, idle_s=idle_s)
    out.send(("done", os.getpid(), []))


def _members(url: str, topic: str, n: int, work_s: float, idle_s: float | None) -> tuple[list, Any, Any, Any]:
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    rx, tx = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=member, args=(url, topic, go, stop, tx, work_s, idle_s)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # connected
    return procs, go, stop, rx


class Collector:
    """Reads what the members report as it comes (a pipe left unread would block their handlers): every batch
    handled, (id, key, received, due) per message, and each member's last batch."""

    def __init__(self, rx: Any, procs: list) -> None:
        self.rx, self.procs = rx, procs
        self.seen: list[tuple] = []
        self.last: dict[int, list[int]] = {}
        self.done: set[int] = set()

    def read(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.rx.poll(min(left, 0.2)):
                self._one()

    def finish(self, stop: Any | None = None) -> None:
        """Until every member finished (or died); with `stop`, set it first."""
        if stop is not None:
            stop.set()
        deadline = time.monotonic() + 300
        while any(p.pid not in self.done and p.exitcode is None for p in self.procs) or self.rx.poll(0):
            if time.monotonic() > deadline:
                raise RuntimeError("a consumer did not finish")
            if self.rx.poll(0.2):
                self._one()
        for p in self.procs:
            p.join(10)

    def _one(self) -> None:
        kind, pid, data = self.rx.recv()
        if kind == "batch":
            self.seen += data
            self.last[pid] = [d[0] for d in data]
        else:
            self.done.add(pid)


def scaling_run(url: str, topic: str, count: int, n: int) -> dict[str, Any]:
    with Store(url) as store:
        ids = store.send_many([Message(topic, {"i": i}, key=f"k{i % KEYS}") for i in range(count)])
    procs, go, _, rx = _members(url, topic, n, HANDLER_S, idle_s=2.0)
    started = time.time()
    go.set()
    collector = Collector(rx, procs)
    collector.finish()
    seen = collector.seen
    got = {s[0] for s in seen}
    last = max(s[2] for s in seen)
    violations, newest = 0, {}
    for mid, key, _, _ in sorted(seen, key=lambda s: s[2]):  # a key's messages in id order (ids grow with the send)
        violations += mid < newest.get(key, 0)
        newest[key] = max(mid, newest.get(key, 0))
    rate = count / (last - started)
    lost = len(set(ids) - got)
    log(f"(a) {n} consumer(s): {rate:,.0f} msg/s, {violations} order violations, {lost} lost")
    return {"rate": rate, "violations": violations, "lost": lost, "spread": f"{len(seen) - count} handled twice"}


def produce(url: str, topic: str, seconds: float, out: Any) -> None:
    rng = random.Random(23)
    ids: list[int] = []
    with Store(url) as store:
        started = time.monotonic()
        while (now := time.monotonic()) < started + seconds:
            ticks = int((now - started) / TICK_S) + 1
            if (k := int(ticks * TICK_S * RATE) - len(ids)) > 0:
                batch = [
                    Message(
                        topic,
                        {"i": len(ids) + j},
                        key=f"k{rng.randrange(KEYS)}",
                        delay=timedelta(seconds=rng.uniform(1.0, 10.0)),
                    )
                    for j in range(k)
                ]
                ids += store.send_many(batch)
            time.sleep(max(0.0, started + ticks * TICK_S - time.monotonic()))
    out.send(ids)


def steady_run(url: str, topic: str, seconds: float, n: int, kill: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    prx, ptx = ctx.Pipe(duplex=False)
    procs, go, stop, rx = _members(url, topic, n, 0.0, idle_s=None)
    collector = Collector(rx, procs)
    go.set()
    producer = ctx.Process(target=produce, args=(url, topic, seconds, ptx))
    started = time.monotonic()
    producer.start()
    killed_pid, killed_at, killed_batch = 0, 0.0, 0
    if kill:
        collector.read(seconds / 2)
        killed_pid, killed_at = procs[0].pid or 0, time.monotonic() - started
        os.kill(killed_pid, signal.SIGKILL)
        log(f"(c) killed consumer {killed_pid} {killed_at:.0f} s in")
    while not prx.poll(0):
        collector.read(0.5)
    ids: list[int] = prx.recv()
    producer.join()
    collector.read(14.0)  # the last due (10 s) and handled
    collector.finish(stop)
    seen, last = collector.seen, collector.last
    if kill:
        killed_batch = len(last.get(killed_pid, []))
    got = np.array([s[0] for s in seen], dtype=np.int64)
    unique, first = np.unique(got, return_index=True)
    late_ms = np.array([(seen[i][2] - seen[i][3]) * 1000 for i in first])
    wait_ms = 0.0
    if kill and killed_pid:  # the killed member's keys: the latest any of their messages due after the kill came
        killed_keys = {s[1] for s in seen if s[0] in set(last.get(killed_pid, []))}
        kill_epoch = time.time() - (time.monotonic() - started - killed_at)
        after = [(s[2] - s[3]) * 1000 for s in seen if s[1] in killed_keys and s[3] >= kill_epoch]
        wait_ms = max(after, default=0.0)
    result = {
        "sent": len(ids),
        "p50": float(np.percentile(late_ms, 50)) if len(late_ms) else float("nan"),
        "p99": float(np.percentile(late_ms, 99)) if len(late_ms) else float("nan"),
        "max": float(late_ms.max()) if len(late_ms) else float("nan"),
        "early": int((late_ms < 0).sum()),
        "lost": len(set(ids) - set(unique.tolist())),
        "dup": len(got) - len(unique),
        "killed_at": killed_at,
        "killed_batch": killed_batch,
        "wait_ms": wait_ms,
    }
    log(f"{'(c)' if kill else '(b)'} {n} consumer(s): {result}")
    return result
