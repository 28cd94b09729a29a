"""The near wheel's partition width (migrations/025), measured in one run on one server.

Two stores, each filled with the same `10M x scale` timers, all in the near wheel (order timeouts,
`cancel_bench.fill(near_only=True)`): one whose near wheel is in hourly partitions, as every store was before
migrations/025 (made here ahead of the fill, as a superuser; the store keeps partitions it finds), and one in the
4-hour partitions the store makes now. Then, interleaved store by store:

1. `cancel(key=…)` of a random pending timer, the figure issue 19 sets (p50 <= 2 ms with 10M pending): a lookup by
   key prunes no partition of the wheel, so it opens and locks every one with its key index;
2. `send_many` of keyed near timers (batches spread over the near window), since the width changes the B-trees a
   batch writes into.

    python -m bench.partition_width [--scale 1.0] [--calls 300] [--batches 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

from bench.cancel_bench import SAMPLES, fill
from bench.common import body, drop_database, fresh_database, log, pct, wheel_partitions
from delaywheel import Message, Settings, Store
from delaywheel.deliver import wheel
from delaywheel.partitions import HOUR, floor_to

STORES = {"hourly": "delaywheel_bench_width_hourly", "4-hour": "delaywheel_bench_width_four"}


def hourly_partitions(url: str) -> None:
    """The near wheel's partitions as hourly ones, from this hour to where the first roll puts `near_until` (what
    the fill fills), named as `ensure_partition` names them (`partition_name`); made before the store's first send,
    which then finds them."""
    near_until = wheel._roll_target(datetime.now(UTC), Settings())
    with psycopg.connect(url, autocommit=True) as conn:
        (now,) = conn.execute("SELECT now()").fetchone()  # type: ignore[misc]
        start = floor_to(now, HOUR)
        for i in range(int((near_until - start) / HOUR)):
            lo = start + i * HOUR
            (name,) = conn.execute("SELECT delaywheel.partition_name('wheel', %s)", (lo,)).fetchone()  # type: ignore[misc]
            conn.execute(
                sql.SQL("CREATE TABLE {} PARTITION OF delaywheel.wheel FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier("delaywheel", name), sql.Literal(lo), sql.Literal(lo + HOUR)
                )
            )


def partitions(url: str) -> int:
    with psycopg.connect(url) as conn:
        return wheel_partitions(conn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="pending timers per store = 10M x scale")
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=300, help="cancels timed per store")
    parser.add_argument("--batches", type=int, default=10, help="send_many batches of 5,000 timed per store")
    args = parser.parse_args()
    started = datetime.now(UTC)
    urls = {width: fresh_database(name) for width, name in STORES.items()}
    hourly_partitions(urls["hourly"])
    n = int(10_000_000 * args.scale)
    for width, url in urls.items():
        log(f"fill {n:,} near timers, {width} partitions")
        t = time.perf_counter()
        with Store(url) as store, psycopg.connect(url, autocommit=True) as other:
            store.prepare()
            fill(store, n, args.batch, near_only=True)
            other.execute("VACUUM (ANALYZE)")  # at rest, as cancel_bench leaves its store
            other.execute("CHECKPOINT")
        log(f"   {time.perf_counter() - t:.0f} s, {partitions(url)} wheel partitions")

    stores = {width: Store(url) for width, url in urls.items()}
    try:
        keys = {}
        for width, url in urls.items():
            with psycopg.connect(url) as conn:
                keys[width] = [k for (k,) in conn.execute(SAMPLES["near"], (args.calls + 20,))]
        took: dict[str, list[float]] = {width: [] for width in urls}
        for i in range(args.calls + 20):  # interleaved, each store first in turn; the first 20 warm up
            for width in list(urls)[:: 1 if i % 2 else -1]:
                t = time.perf_counter()
                outcome = [r.outcome for r in stores[width].cancel(key=keys[width][i])]
                if i >= 20:
                    took[width].append(1000 * (time.perf_counter() - t))
                assert outcome == ["cancelled"], (width, outcome)
        lines = [f"- pending: {n:,} timers per store (10M x {args.scale}), all in the near wheel"]
        for width, url in urls.items():
            v = took[width]
            lines.append(
                f"- {width}: {partitions(url)} wheel partitions; cancel(key=…) p50 {statistics.median(v):.2f} ms,"
                f" p90 {pct(v, 0.9):.2f} ms, p99 {pct(v, 0.99):.2f} ms ({len(v)} calls)"
            )
        lines.append(
            f"- cancel p50, 4-hour / hourly: {statistics.median(took['4-hour']) / statistics.median(took['hourly']):.2f} x"
        )

        rng = random.Random(11)
        sent: dict[str, list[float]] = {width: [] for width in urls}
        size = 5_000
        for b in range(args.batches + 1):  # the first batch of each warms up
            for width in list(urls)[:: 1 if b % 2 else -1]:
                store = stores[width]
                first = store.clock() + timedelta(minutes=1)
                batch = [
                    Message(
                        "bench.width",
                        body(j),
                        deliver_at=first + rng.random() * timedelta(days=2),
                        key=f"width-{b}-{j}",
                    )
                    for j in range(size)
                ]
                t = time.perf_counter()
                store.send_many(batch)
                if b:
                    sent[width].append(1e6 * (time.perf_counter() - t) / size)
        for width in urls:
            lines.append(
                f"- send_many of {size:,} keyed near timers due over the next 2 days, {width}: median"
                f" {statistics.median(sent[width]):.2f} us a message ({args.batches} batches)"
            )
        lines.append(
            f"- send_many, 4-hour / hourly: {statistics.median(sent['4-hour']) / statistics.median(sent['hourly']):.2f} x"
        )
    finally:
        for store in stores.values():
            store.close()
        for name in STORES.values():
            drop_database(name)
    print(f"\n## partition width ({started:%Y-%m-%d %H:%M} UTC): python -m bench.partition_width --scale {args.scale}")
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
