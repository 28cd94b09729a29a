"""How soon the Airflow trigger notices a due message (issue 4: "LISTEN/NOTIFY or a short poll, measured").

`DueMessagesTrigger` (LISTEN for producers' NOTIFYs, sleep exactly until the head is due, look again at
least every `poll_interval`) against a plain short poll with the same query (look, sleep `--poll` s, look).
Each sample starts the waiter on an empty wheel, then sends one message due 0.5-2 s later, so the trigger
has to be woken by the NOTIFY and then count down; the poll just keeps looking. Reported: how late each
noticed the message (the database clock at the look that found it due, minus its due time) and how many
queries each makes per idle minute.

Also: how soon a topic's Asset watcher (`TopicMessagesTrigger`: LISTEN for the topic's NOTIFY, a look at least
every second, behind a claimed mark) announces a message that reached the topic (sent at level 0, so it is in the topic at commit): the database
clock when the event is in hand, minus the message's `delivered_at`.

And what one look costs a trigger on a full near wheel (`--look-timers` timers across every near-wheel partition,
`--looks` looks): `next_due_async` on the trigger's long-lived connection, whose head read is prepared there once,
against the look as it was before 2026-11-28 (the same two queries, the head planned per call), interleaved look by
look on one connection each.

Run: `python -m bench.trigger_wake [--samples 20] [--poll 1.0] [--look-timers 200000] [--looks 2000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from delaywheel import Store
from delaywheel.dev.local_airflow import as_url

from .cancel_bench import fill
from .common import fresh_database, log, pct, wheel_partitions

ROOT = Path(__file__).resolve().parents[2]
DB = "delaywheel_bench_trigger"


def _airflow_env(url: str) -> None:
    """The trigger reads its connection like in the triggerer: `delaywheel_default` from the environment."""
    os.environ["AIRFLOW_CONN_DELAYWHEEL_DEFAULT"] = as_url(url)
    os.environ.setdefault("AIRFLOW_CONFIG", str(ROOT / "airflow.cfg"))
    os.environ.setdefault("AIRFLOW_HOME", str(ROOT / ".delaywheel" / "airflow-bench"))


async def _trigger(poll_s: float) -> datetime:
    from delaywheel.airflow.triggers import DueMessagesTrigger

    async for event in DueMessagesTrigger(poll_interval=600.0 if poll_s <= 0 else poll_s).run():
        return datetime.fromisoformat(event.payload["checked_at"])
    raise RuntimeError("trigger ended without an event")


async def _short_poll(poll_s: float) -> datetime:
    from delaywheel.airflow.hooks import DelayWheelHook, next_due_async

    async with await DelayWheelHook().aconnect() as conn:
        while True:
            head, clock = await next_due_async(conn, None, 0.0)
            if head is not None and head <= clock:
                return clock
            await asyncio.sleep(poll_s)


async def _sample(store: Store, waiter: Callable[[], Awaitable[datetime]], rng: random.Random) -> float:
    """Seconds between a message's due time and the waiter noticing it (the wheel is empty before)."""
    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0.3)  # the waiter is asleep by now
    due = await asyncio.to_thread(lambda: store.clock() + timedelta(seconds=rng.uniform(0.5, 2.0)))
    await asyncio.to_thread(store.send, "bench.trigger", {"due": due.isoformat()}, deliver_at=due)
    noticed = await asyncio.wait_for(task, 30)
    await asyncio.to_thread(store.deliver_due)  # empty again for the next sample
    return (noticed - due).total_seconds()


async def _announced(store: Store, rng: random.Random) -> float:
    """Seconds between a message landing in the topic and the topic watcher announcing it."""
    from delaywheel.airflow.triggers import TopicMessagesTrigger

    events = TopicMessagesTrigger("bench.watch").run()
    waiting = asyncio.ensure_future(events.__anext__())
    await asyncio.sleep(rng.uniform(0.1, 1.1))  # anywhere in the watcher's wait (its poll is 1 s)
    message = await asyncio.to_thread(store.send, "bench.watch", {"n": 1})
    event = await asyncio.wait_for(waiting, 30)
    noticed = await asyncio.to_thread(store.clock)
    await events.aclose()
    assert event.payload["count"] == 1
    row = await asyncio.to_thread(
        lambda: store.conn.execute(
            "SELECT delivered_at FROM delaywheel.topic_messages WHERE message_id = %s", (message,)
        ).fetchone()
    )
    return (noticed - row[0]).total_seconds()


async def _looks(count: int) -> dict[str, list[float]]:
    """Milliseconds per look at the wheel's head, the trigger's way and the way before, interleaved."""
    from delaywheel.airflow.hooks import CLOCK, DelayWheelHook, next_due_async
    from delaywheel.pending import WHEEL_HEAD

    hook = DelayWheelHook()
    times: dict[str, list[float]] = {"prepared": [], "planned per call": []}
    async with await hook.aconnect() as trigger, await hook.aconnect() as before:
        for _ in range(count):
            start = time.perf_counter()
            await next_due_async(trigger, None, 0.0)
            times["prepared"].append(1000 * (time.perf_counter() - start))
            start = time.perf_counter()
            await (await before.execute(WHEEL_HEAD, prepare=False)).fetchone()
            await (await before.execute(CLOCK, {"offset": 0.0})).fetchone()
            times["planned per call"].append(1000 * (time.perf_counter() - start))
    return times


def _summary(values: list[float]) -> str:
    ms = sorted(1000 * v for v in values)
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) > 1 else ms[0]
    return f"p50 {statistics.median(ms):,.0f} ms, p99 {p99:,.0f} ms, max {ms[-1]:,.0f} ms, min {ms[0]:,.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--poll", type=float, default=1.0, help="the short poll's interval (s)")
    parser.add_argument("--look-timers", type=int, default=200_000, help="timers in the near wheel for the looks")
    parser.add_argument("--looks", type=int, default=2000, help="looks timed each way (0: none)")
    args = parser.parse_args()
    started = datetime.now(UTC)
    url = fresh_database(DB)
    _airflow_env(url)
    rng = random.Random(5)
    with Store(url) as store:
        store.prepare()
        results: dict[str, list[float]] = {"trigger": [], "poll": [], "watcher": []}
        for n in range(args.samples):  # alternate, so both see the same machine
            log(f"sample {n + 1}/{args.samples}")
            results["trigger"].append(asyncio.run(_sample(store, lambda: _trigger(5.0), rng)))
            results["poll"].append(asyncio.run(_sample(store, lambda: _short_poll(args.poll), rng)))
            results["watcher"].append(asyncio.run(_announced(store, rng)))
        if args.looks:
            log(f"{args.look_timers:,} timers across the near wheel, then {args.looks:,} looks each way")
            fill(store, args.look_timers, 10_000, near_only=True)
            partitions = wheel_partitions(store.conn)
            looked = asyncio.run(_looks(args.looks))
    early = sum(v < 0 for v in results["trigger"] + results["poll"])
    print(
        f"\nCommand: `python -m bench.trigger_wake --samples {args.samples} --poll {args.poll:g}"
        f" --look-timers {args.look_timers} --looks {args.looks}` — started "
        f"{started:%Y-%m-%d %H:%M} UTC\n"
    )
    print("| waiter | noticed after due | queries per idle minute |")
    print("|---|---|---:|")
    print(
        f"| DueMessagesTrigger (LISTEN/NOTIFY + countdown, safety look every 5 s) | {_summary(results['trigger'])} | 24 |"
    )
    print(
        f"| short poll every {args.poll:g} s (same query) | {_summary(results['poll'])} | {2 * 60 / args.poll:,.0f} |"
    )
    print(f"\n- {args.samples} messages each, due 0.5-2 s after the waiter went to sleep; noticed before due: {early}")
    print("- a look is two queries (the lane's head, the database clock)")
    print(
        f"\nTopic watcher (TopicMessagesTrigger, LISTEN + a look every 1 s): a message in the topic was announced "
        f"{_summary(results['watcher'])} after it landed ({args.samples} samples)."
    )
    if args.looks:
        now, then = looked["prepared"], looked["planned per call"]
        ratio = statistics.median(now) / statistics.median(then)
        print(
            f"\nA look at the wheel's head (the head and the clock), {args.look_timers:,} timers in {partitions}"
            f" near-wheel partitions, {args.looks:,} looks each way, interleaved: on the trigger's connection (prepared)"
            f" p50 {statistics.median(now):.3f} ms, p99 {pct(now, 0.99):.3f} ms; planned per call (before) p50"
            f" {statistics.median(then):.3f} ms, p99 {pct(then, 0.99):.3f} ms; p50 {ratio:.2f} x."
        )


if __name__ == "__main__":
    main()
