"""Cancels by key: their latency against a durable INSERT, and what cancels racing deliveries cost the deliveries.

1. Latency: `10M x scale` timers pending, due 1 min - 30 days ahead (near ones in the wheel, the rest in far
   segments), or with `--near-only` all in the near wheel (order timeouts); the store at rest (VACUUM, CHECKPOINT).
   `cancel(key=…)` of 200 random pending timers, near and far, each followed by a durable single-row INSERT, the
   baseline (a cancel must commit its cancellation durably too). Target: p50 <= 2 ms.
2. The race, on the real clock, for `60 x scale` seconds (at least 10): 1,000 msg/s due in 1-10 s, delivered by the
   library's loop in a process of its own; without cancels, then with 700 cancels/s from 4 processes, by key, of
   timers due within the next second or just due; with `--floor`, an arm whose processes make a durable single-row
   INSERT in place of each cancel (the least any cancel writes). Each run on a fresh database after a CHECKPOINT;
   `--repeat N` runs every arm N times (ABBA), lateness pooled. Target: delivery p99 with cancels <= 1.2 x without.
   Every run checks exactly once: no message delivered twice, none both delivered and answered cancelled, none lost.

    python -m bench cancel [--scale 1.0] [--near-only] [--skip-race]
    python -m bench cancel --skip-latency [--scale 1.0] [--floor] [--repeat 3]
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import multiprocessing
import queue
import random
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg

from delaywheel import Message, Store
from delaywheel.deliver import runner

from .common import Check, body, chunks, database, log, options, pct, report

DB = "delaywheel_bench_cancel"
TOPIC = "bench.cancel"
RATE, CANCELS, WORKERS, PER_LANE = 1000, 700, 4, 200  # the race's messages and cancels a second, its processes
_UNCANCELLED = (
    " AND {0} NOT IN (SELECT key FROM delaywheel.cancellations WHERE key IS NOT NULL) ORDER BY random() LIMIT %s"
)
SAMPLES = {  # random keys of pending timers not cancelled yet, by where they are
    "near": "SELECT key FROM delaywheel.wheel WHERE key LIKE 'backdrop-%%'" + _UNCANCELLED.format("key"),
    "far": "SELECT k FROM delaywheel.wheel_far_segments, unnest(keys) u(k) WHERE k LIKE 'backdrop-%%'"
    + _UNCANCELLED.format("k"),
}
INSERT_TABLE = "CREATE TABLE IF NOT EXISTS bench_insert (id bigserial PRIMARY KEY, key text NOT NULL)"
INSERT = "INSERT INTO bench_insert (key) VALUES (%s)"


def fill(store: Store, other: psycopg.Connection, count: int, batch: int, near_only: bool) -> None:
    """`count` timers due from a minute to 30 days ahead, or (`near_only`) up to `near_until` (the near wheel, which
    a first wheel pass sets 3-4 days ahead); then the store at rest, as autovacuum leaves it."""
    rng = random.Random(7)
    first, span = store.clock() + timedelta(minutes=1), timedelta(days=30)
    if near_only:
        store.advance_wheel()
        (near_until,) = store.conn.execute("SELECT near_until FROM delaywheel.wheel_state").fetchone()  # type: ignore[misc]
        span = near_until - first - timedelta(minutes=1)
    for start, size in chunks(count, batch):
        store.send_many(
            [
                Message("bench.backdrop", body(0), deliver_at=first + rng.random() * span, key=f"backdrop-{start + j}")
                for j in range(size)
            ]
        )
    other.execute("VACUUM (ANALYZE)")
    other.execute("CHECKPOINT")


def latency(store: Store, other: psycopg.Connection) -> dict[str, tuple[list[float], list[float]]]:
    """ms per cancel(key=…) and per the durable INSERT after it, by lane (none far in the near-only profile)."""
    other.execute(INSERT_TABLE)
    times = {}
    for lane, sample in SAMPLES.items():
        cancels, inserts = [], []
        for (key,) in other.execute(sample, (PER_LANE,)).fetchall():
            started = time.perf_counter()
            outcome = [r.outcome for r in store.cancel(key=key)]
            cancels.append(1000 * (time.perf_counter() - started))
            if outcome != ["cancelled"]:
                raise RuntimeError(f"cancel {key}: {outcome}")
            started = time.perf_counter()
            other.execute(INSERT, (key,))
            inserts.append(1000 * (time.perf_counter() - started))
        if cancels:
            times[lane] = (cancels, inserts)
    return times


def die_with_parent() -> None:
    """End this spawned process when the bench does (prctl PR_SET_PDEATHSIG, Linux): a deliverer left behind would
    reconnect and deliver in the next run's database, which has the same name."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def cancel_worker(url: str, seconds: float, per_s: float, seed: int, inbox: Any, outbox: Any, floor: bool) -> None:
    """Cancels by key, `per_s` a second, of timers due within (-0.3 s, 1 s) of now, from the keys the producer hands
    over; with `floor`, one durable single-row INSERT in place of each. Reports (answers, latencies in ms)."""
    die_with_parent()
    rng = random.Random(seed)
    coming: list[tuple[float, str]] = []  # by due time
    near: list[tuple[str, float]] = []
    answers: list[tuple[int | None, str]] = []
    cancel_ms: list[float] = []
    try:
        with Store(url) as own:
            own.conn.execute(INSERT_TABLE)
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                with contextlib.suppress(queue.Empty):
                    while True:
                        for key, due in inbox.get_nowait():
                            heapq.heappush(coming, (due, key))
                now = time.time()
                while coming and coming[0][0] - now < 1.0:
                    due, key = heapq.heappop(coming)
                    near.append((key, due))
                near = [(k, due) for k, due in near if due - now > -0.3]
                for _ in range(min(len(near), 20)):
                    i = rng.randrange(len(near))
                    near[i], near[-1] = near[-1], near[i]  # a random pick, taken out in constant time
                    key, _due = near.pop()
                    t = time.perf_counter()
                    if floor:
                        own.conn.execute(INSERT, (key,), prepare=True)
                    else:
                        answers.extend((r.message_id, r.outcome) for r in own.cancel(key=key, reason="bench"))
                    cancel_ms.append(1000 * (time.perf_counter() - t))
                    time.sleep(max(0.0, started + len(cancel_ms) / per_s - time.monotonic()))
                if not near:
                    time.sleep(0.01)
        outbox.put((answers, cancel_ms))
    except BaseException as exc:
        outbox.put(repr(exc))  # the run ends with the reason instead of waiting for a report
        raise


def deliver_worker(url: str, seconds: float, ready: Any, stop: Any, outbox: Any) -> None:
    """The deliverer in a process of its own, as `delaywheel deliver` runs: reports its busy passes."""
    die_with_parent()
    with Store(url) as own:
        totals = runner.run(own, [None], seconds + 20, stop=stop, ready=ready.set)
    outbox.put(totals.busy_passes)


def race(url: str, seconds: float, cancels: int, floor: bool) -> dict[str, Any]:
    """One run on the real clock (`cancels` 0: the baseline); the producer a thread of this process."""
    spawn = multiprocessing.get_context("spawn")
    ready, stop, outbox, delivering = spawn.Event(), spawn.Event(), spawn.Queue(), spawn.Queue()
    inboxes = [spawn.Queue() for _ in range(WORKERS if cancels else 0)]
    procs = [
        spawn.Process(target=cancel_worker, args=(url, seconds, cancels / WORKERS, 10 + w, inbox, outbox, floor))
        for w, inbox in enumerate(inboxes)
    ]
    deliverer = spawn.Process(target=deliver_worker, args=(url, seconds, ready, stop, delivering))
    for p in [*procs, deliverer]:
        p.start()
    ready.wait(60)
    sent: dict[str, int] = {}

    def produce() -> None:
        rng = random.Random(1)
        with Store(url) as own:
            n, started = 0, time.monotonic()
            while time.monotonic() - started < seconds:
                size, clock = int(RATE * 0.02), time.time()
                timers = [(f"{TOPIC}-{n + j}", rng.uniform(1, 10)) for j in range(size)]
                messages = [
                    Message(TOPIC, body(n + j), key=k, delay=timedelta(seconds=d)) for j, (k, d) in enumerate(timers)
                ]
                sent.update(zip([k for k, _ in timers], own.send_many(messages), strict=True))
                for w, inbox in enumerate(inboxes):
                    inbox.put([(k, clock + d) for k, d in timers[w::WORKERS]])
                n += size
                time.sleep(max(0.0, started + n / RATE - time.monotonic()))

    producer = threading.Thread(target=produce)
    producer.start()
    reports = []
    for _ in procs:
        got = outbox.get(timeout=seconds + 120)
        if isinstance(got, str):
            stop.set()
            raise RuntimeError(f"a cancel process failed: {got}")
        reports.append(got)
    producer.join()
    time.sleep(11)  # the last timers fall due
    stop.set()
    busy = delivering.get(timeout=60)
    for p in [*procs, deliverer]:
        p.join()
    answers = [a for r in reports for a in r[0]]
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT message_id, extract(epoch FROM delivered_at - deliver_at) * 1000"
            " FROM delaywheel.topic_messages WHERE topic = %s",
            (TOPIC,),
        ).fetchall()
    delivered, late = {m for m, _ in rows}, [float(ms) for _, ms in rows]
    said_cancelled = {m for m, o in answers if o in ("cancelled", "already_cancelled")}
    exactly_once = {
        "duplicates": len(rows) - len(delivered),
        "missing": len(set(sent.values()) - delivered - said_cancelled),
        "early": sum(1 for x in late if x < 0),
        "delivered and answered cancelled": len(said_cancelled & delivered),
        "answered already_delivered, not delivered": len(
            {m for m, o in answers if o == "already_delivered"} - delivered
        ),
    }
    if any(exactly_once.values()):
        raise RuntimeError(f"not exactly once: {exactly_once}")
    cancel_ms = [ms for r in reports for ms in r[1]]
    return {"late": late, "p99": pct(late, 0.99), "busy": busy, "cancel_ms": cancel_ms}


def main(argv: list[str], name: str) -> list[Check]:
    parser = options(__doc__, "pending timers = 10M x scale; race seconds = 60 x scale (at least 10)")
    parser.add_argument("--near-only", action="store_true", help="every pending timer in the near wheel")
    parser.add_argument("--floor", action="store_true", help="race: an arm of durable INSERTs in place of cancels")
    parser.add_argument("--repeat", type=int, default=1, help="race: rounds of every arm (ABBA), lateness pooled")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-race", action="store_true")
    args = parser.parse_args(argv)
    seconds = max(10.0, 60 * args.scale)
    checks, notes, figures = list[Check](), list[str](), dict[str, Any]()
    if not args.skip_latency:
        n = int(10_000_000 * args.scale)
        where = "all in the near wheel" if args.near_only else "due 1 min - 30 days ahead"
        notes.append(f"pending: {n:,} timers, {where}")
        with database(DB) as url, Store(url) as store, psycopg.connect(url, autocommit=True) as other:
            store.prepare()
            log(f"latency: filling {n:,} pending")
            fill(store, other, n, args.batch, args.near_only)
            for lane, (cancels, inserts) in latency(store, other).items():
                (p50, p99), (i50, i99) = [pct(cancels, q) for q in (0.5, 0.99)], [pct(inserts, q) for q in (0.5, 0.99)]
                checks.append(Check(f"cancel(key=…) p50, {lane} timer (ms)", p50, i50, "p50 <= 2 ms", p50 <= 2))
                figures[f"{lane} timer"] = {"cancel p50 / p99 ms": [p50, p99], "INSERT p50 / p99 ms": [i50, i99]}
                notes.append(
                    f"{lane} timer, {len(cancels)} calls: cancel p50 / p99 {p50:.2f} / {p99:.2f} ms; "
                    f"the durable INSERT after each {i50:.2f} / {i99:.2f} ms"
                )
    arms = [("without cancels", 0), ("cancels", CANCELS)] + ([("floor", CANCELS)] if args.floor else [])
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm, _ in arms}
    for n_round in [] if args.skip_race else range(args.repeat):
        for arm, cancels in arms if n_round % 2 == 0 else arms[::-1]:
            log(f"race, round {n_round + 1}: {arm}, {RATE} msg/s, {cancels} cancels/s, {seconds:.0f} s")
            with database(DB) as url:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("CHECKPOINT")
                runs[arm].append(race(url, seconds, cancels, arm == "floor"))
    if runs["without cancels"]:
        pooled = {arm: [x for r in arm_runs for x in r["late"]] for arm, arm_runs in runs.items()}
        for arm, arm_runs in runs.items():
            late, cancel_ms = pooled[arm], [x for r in arm_runs for x in r["cancel_ms"]]
            figures[f"race, {arm}"] = {"pooled p99 ms": pct(late, 0.99), "runs' p99 ms": [r["p99"] for r in arm_runs]}
            done = f"; {len(cancel_ms) / seconds / len(arm_runs):.0f}/s done, p50 {pct(cancel_ms, 0.5):.2f} ms"
            notes.append(
                f"race, {arm}: {len(arm_runs)} runs, {len(late):,} delivered, lateness p50 {pct(late, 0.5):.1f} ms, "
                f"p99 {pct(late, 0.99):.1f} ms (runs: {', '.join(format(r['p99'], '.1f') for r in arm_runs)}); "
                f"busy passes {sum(r['busy'] for r in arm_runs)}" + (done if cancel_ms else "")
            )
        ours, base = pct(pooled["cancels"], 0.99), pct(pooled["without cancels"], 0.99)
        checks.append(
            Check("delivery p99 with cancels / without (ms)", ours, base, "ratio <= 1.20", ours <= 1.2 * base)
        )
        notes.append(
            "every race run exactly once: no duplicate, none missing or early, none delivered yet answered cancelled"
        )
    return report(name, "Cancel by key: latency and the race with deliveries", checks, notes, argv, figures)
