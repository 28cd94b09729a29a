"""What one `cancel(key=…)` costs in CPU, in the caller and in its server process, against the code at a git revision.

Cancels share the database's cores with the deliverers (bench.cancel_bench: 700 cancels a second beside 1,000
deliveries need more than two cores), so what matters beside a cancel's latency is the CPU it takes. One store, timers
all in the near wheel (the order-timeout profile, `--timers` of them), then alternating blocks of `--per-block` cancels
of distinct keys, back to back: one block by this checkout's code, one by the code at `--before` (exported from git, as
bench.send_bench does), each in a process of its own with a connection of its own, warmed up first (its prepared
statements and plans made). Per cancel: the caller's CPU (process time), its server process's CPU (/proc), wall time.
Reported: the median over the blocks of each, and this code's over the revision's.

    python -m bench.cancel_cpu [--before 494e614] [--timers 200000] [--blocks 6] [--per-block 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from bench.cancel_bench import SAMPLES, fill_at_rest
from bench.common import drop_database, fresh_database, log
from bench.send_bench import export_revision
from delaywheel import Store

DB = "delaywheel_bench_cancel_cpu"
ROOT = Path(__file__).resolve().parents[1]  # the checkout
WARM_UP = 50  # cancels before the block is timed: the connection's prepared statements and plans

# A block of cancels in a process of its own, on the `delaywheel` its PYTHONPATH finds: keys on stdin (one per line,
# the first WARM_UP untimed), one JSON line out: µs per cancel in the caller, in its server process, and wall. It is
# self-contained, so its `cpu` is bench.cancel_bench.cpu_seconds again: importing the bench would import this
# checkout's modules beside the code under test.
WORKER = """
import json, os, sys, time
from pathlib import Path
from delaywheel import Store

def cpu(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

keys = sys.stdin.read().split()
warm, timed = keys[:WARM_UP], keys[WARM_UP:]
with Store(sys.argv[1]) as store:
    for key in warm:
        store.cancel(key=key)
    backend = store.conn.info.backend_pid
    caller, server, wall = time.process_time(), cpu(backend), time.perf_counter()
    outcomes = [r.outcome for key in timed for r in store.cancel(key=key)]
    n = len(timed)
    print(json.dumps({"caller": 1e6 * (time.process_time() - caller) / n, "server": 1e6 * (cpu(backend) - server) / n,
                      "wall": 1e6 * (time.perf_counter() - wall) / n, "cancelled": outcomes.count("cancelled")}))
""".replace("WARM_UP", str(WARM_UP))


def block(url: str, plugins: str, keys: list[str]) -> dict[str, float]:
    """One block of cancels by the code under `plugins`; its figures (WORKER)."""
    env = {**os.environ, "PYTHONPATH": plugins}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, url], input="\n".join(keys), env=env, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"a cancel block failed: {done.stderr.strip()[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout)
    if figures["cancelled"] != len(keys) - WARM_UP:
        raise RuntimeError(f"{figures['cancelled']} of {len(keys) - WARM_UP} keys cancelled")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="494e614", help="the git revision to compare with (default 494e614)")
    parser.add_argument("--timers", type=int, default=200_000, help="pending timers, all in the near wheel")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each code, alternating")
    parser.add_argument("--per-block", type=int, default=1000, help="timed cancels a block")
    args = parser.parse_args()
    started = datetime.now(UTC)
    url = fresh_database(DB)
    try:
        with Store(url) as store, psycopg.connect(url, autocommit=True) as other:
            log(f"fill {args.timers:,} near-wheel timers")
            fill_at_rest(store, other, args.timers, 20_000, near_only=True)
            size = WARM_UP + args.per_block
            keys = [k for (k,) in other.execute(SAMPLES["near"], (2 * args.blocks * size,))]
        if len(keys) < 2 * args.blocks * size:
            raise SystemExit(f"only {len(keys)} timers to cancel: raise --timers")
        with tempfile.TemporaryDirectory() as tmp:
            codes = {"this code": str(ROOT / "plugins"), args.before: export_revision(args.before, Path(tmp))}
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
            for i in range(args.blocks):
                for j, (name, plugins) in enumerate(codes.items()):
                    start = (2 * i + j) * size
                    runs[name].append(block(url, plugins, keys[start : start + size]))
                    log(f"block {i + 1}, {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in runs[name][-1].items()))
    finally:
        drop_database(DB)
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("caller", "server", "wall")}
        for name, rs in runs.items()
    }
    ours, theirs = medians["this code"], medians[args.before]
    print(f"\n### cancel_cpu, started {started:%Y-%m-%d %H:%M} UTC\n")
    print(
        f"Command: `python -m bench.cancel_cpu --before {args.before} --timers {args.timers} --blocks {args.blocks}"
        f" --per-block {args.per_block}`; load average before {os.getloadavg()[0]:.2f}\n"
    )
    print("| per cancel(key=…), median of blocks | this code | " + args.before + " | ratio |")
    print("|---|---:|---:|---:|")
    for what, label in (
        ("caller", "CPU in the caller, µs"),
        ("server", "CPU in its server process, µs"),
        ("wall", "wall, µs"),
    ):
        print(f"| {label} | {ours[what]:,.0f} | {theirs[what]:,.0f} | {ours[what] / theirs[what]:.2f} |")
    total = (ours["caller"] + ours["server"]) / (theirs["caller"] + theirs["server"])
    print(f"\n- CPU in all, this code over {args.before}: {total:.2f} x; {args.blocks} blocks of {args.per_block} each")


if __name__ == "__main__":
    main()
