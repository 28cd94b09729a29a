"""A small end-to-end run: send messages over several levels and wheel times, deliver them, report."""

from __future__ import annotations

import json
import random
import time
from datetime import timedelta

from . import runner, stats
from .migrate import migrate
from .store import Store
from .validation import Message


def run_demo(count: int, *, json_output: bool = False) -> int:
    store = Store()
    print(f"store: {store.url}; migrations applied: {migrate(store.url) or 'none needed'}", flush=True)
    store.prepare()
    started = store.clock()
    rng = random.Random(42)
    messages = [
        Message("demo.orders", {"n": n}, delay_level=rng.randint(1, 3), key=f"demo-{n}") if n % 2 else
        Message("demo.orders", {"n": n}, delay=timedelta(milliseconds=rng.randint(500, 8000)), key=f"demo-{n}")
        for n in range(count)
    ]
    t = time.monotonic()
    store.send_many(messages)
    print(f"sent {count} messages (half on levels 1-3, half on the wheel, due within 10 s) "
          f"in {time.monotonic() - t:.2f} s; delivering...", flush=True)
    totals = runner.run(store, [1, 2, 3, None], 60, until_idle=True,
                        progress=lambda tot: print(f"  delivered {tot.delivered}", flush=True), progress_every_s=2)
    figures = stats.lateness(store.conn, started)
    summary = {"sent": count, "delivered": totals.delivered, "early": figures["early"],
               "lateness_p50_ms": round(1000 * (figures["p50_s"] or 0), 1),
               "lateness_p99_ms": round(1000 * (figures["p99_s"] or 0), 1),
               "lateness_max_ms": round(1000 * (figures["max_s"] or 0), 1)}
    store.close()
    print(json.dumps(summary) if json_output else
          f"delivered {summary['delivered']}/{count}, early {summary['early']}, lateness p50 "
          f"{summary['lateness_p50_ms']} ms, p99 {summary['lateness_p99_ms']} ms, max {summary['lateness_max_ms']} ms")
    return 0 if totals.delivered == count and figures["early"] == 0 else 1
