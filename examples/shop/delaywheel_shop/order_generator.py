"""Spark job: place N orders over a period, in waves, each order with its timeout message enqueued in
the same transaction (delaywheel_shop.orders.place_orders), in parallel partitions.

    spark-submit examples/shop/delaywheel_shop/order_generator.py --db-url URL --orders 100000 --timeout 20s --period 30s
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import sparkjob

from delaywheel.config import load_settings, parse_duration
from delaywheel.store import Store
from delaywheel_shop import orders

# Orders per transaction. Small, because a transaction holds back the store's commit horizon (DESIGN.md) for as long
# as it runs: a delivered timeout becomes readable to the sweep only once every older transaction has ended, and
# at 2,000 orders a chunk the demo's cancellations reached p99 0.76 s (their timers: p99 43 ms after due).
CHUNK = 250


def place_range(db_url: str, first_id: int, count: int, timeout: timedelta, seed: int) -> int:
    """One partition's share: plans are deterministic per order id, so a retried task writes the same orders
    (a retry of a committed chunk fails on the orders' primary key instead of duplicating them)."""
    plans = orders.plan_orders(first_id, count, timeout, seed=seed)
    with Store(db_url) as store:
        for start in range(0, len(plans), CHUNK):
            orders.place_orders(store, plans[start : start + CHUNK], timeout)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = sparkjob.parser(__doc__ or "")
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--timeout", default="30m", help="order payment timeout (30m in production, seconds in demos)")
    parser.add_argument("--period", default="30s", help="spread the orders over this long")
    # orders arrive through the period, not in a few bursts: with 6 waves 5 s apart and the demo's 20 s timeout,
    # each burst of deadlines fell due exactly while the next burst was being placed
    parser.add_argument("--waves", type=int, default=30)
    parser.add_argument("--first-id", type=int, default=1)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    timeout = parse_duration(args.timeout, "--timeout")
    period = parse_duration(args.period, "--period").total_seconds()
    began = time.monotonic()
    spark = sparkjob.session("delaywheel-order-generator")
    sc = spark.sparkContext
    # read by the demo, which says how long the orders waited for Spark (deadlines count from each placement)
    print(f"order generator: Spark started in {time.monotonic() - began:.1f} s", flush=True)
    ((_, db_url),) = sparkjob.stores(parser, args, load_settings()).items()  # the shop's store: --db-url or --store
    seed = args.seed

    def place(share: tuple[int, int]) -> int:
        return place_range(db_url, share[0], share[1], timeout, seed) if share[1] else 0

    per_wave = -(-args.orders // args.waves)
    started = time.monotonic()
    placed = 0
    for wave in range(args.waves):
        wave_first = args.first_id + wave * per_wave
        wave_count = max(0, min(per_wave, args.first_id + args.orders - wave_first))
        per_part = -(-wave_count // args.partitions)
        ranges = [
            (wave_first + i * per_part, max(0, min(per_part, wave_first + wave_count - (wave_first + i * per_part))))
            for i in range(args.partitions)
        ]
        sc.setJobDescription(f"place orders, wave {wave + 1}/{args.waves}")
        placed += sum(sc.parallelize(ranges, len(ranges)).map(place).collect())
        print(f"order generator: wave {wave + 1}/{args.waves} placed, {placed} orders so far", flush=True)
        next_wave = started + period * (wave + 1) / args.waves
        if wave + 1 < args.waves:
            time.sleep(max(0.0, next_wave - time.monotonic()))
    spark.stop()
    print(f"order generator: placed {placed} orders in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
