"""Who holds a transaction id in a store database, and for how long: the commit horizon every consumer waits below.

A delivery becomes readable only once every transaction that took an xid before it has ended (DESIGN.md, "The
commit horizon"), whatever that transaction writes. Run this beside a benchmark (for instance
`bench.airflow_consumer_lateness`) to see which transactions hold the horizon back: every `--every-ms` it reads
`pg_stat_activity` for backends of `--database` with an xid, and groups each (pid, xid) by what its backend ran over
the run (COPY or the wheel's FOR KEY SHARE: a producer; the wheel pass's statements: the wheel lane; else the
statements themselves). Durations are as sampled: to `--every-ms` resolution, and the sampler is a load itself.

Run: `python -m bench.xid_holders --database delaywheel_bench_airflow_consumer --seconds 150` (it waits for the
database to exist).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import psycopg
from psycopg.conninfo import make_conninfo

from .common import log, pct, server_url

HOLDERS = """SELECT pid, backend_xid::text, left(query, 50) FROM pg_stat_activity
WHERE datname = current_database() AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()"""


def connect_when_there(url: str, timeout: float = 600.0) -> psycopg.Connection:
    end = time.monotonic() + timeout
    while True:
        try:
            return psycopg.connect(url, autocommit=True)
        except psycopg.OperationalError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def kind(statements: set[str]) -> str:
    text = " ".join(statements)
    if "COPY" in text or "FOR KEY SHARE" in text:
        return "producer"
    if "wheel" in text:
        return "wheel lane"
    return " | ".join(sorted(statements))[:80]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", required=True)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--every-ms", type=float, default=5.0)
    args = parser.parse_args()
    conn = connect_when_there(make_conninfo(server_url(), dbname=args.database))
    seen: dict[tuple[int, str], list[float]] = {}  # (pid, xid) -> [first seen, last seen]
    ran: defaultdict[int, set[str]] = defaultdict(set)  # pid -> statements seen while it held an xid
    samples = held = 0
    end = time.monotonic() + args.seconds
    log(f"sampling {args.database} every {args.every_ms:g} ms for {args.seconds:g} s")
    while (started := time.monotonic()) < end:
        rows = conn.execute(HOLDERS).fetchall()
        samples += 1
        held += bool(rows)
        for pid, xid, statement in rows:
            seen.setdefault((pid, xid), [started, started])[1] = started
            ran[pid].add(statement[:30])
        time.sleep(max(0.0, started + args.every_ms / 1000 - time.monotonic()))
    by_kind: defaultdict[str, list[float]] = defaultdict(list)
    for (pid, _), (first, last) in seen.items():
        by_kind[kind(ran[pid])].append((last - first) * 1000)
    print(f"\n{samples:,} samples, {held:,} with an xid held ({held / max(samples, 1):.0%})")
    print("| holder | transactions | held p50 / p90 / p99 / max (ms) | total (s) |\n|---|---:|---|---:|")
    for name, ms in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        figures = " / ".join(f"{pct(ms, q):.1f}" for q in (0.5, 0.9, 0.99)) + f" / {max(ms):.1f}"
        print(f"| {name} | {len(ms):,} | {figures} | {sum(ms) / 1000:.1f} |")


if __name__ == "__main__":
    main()
