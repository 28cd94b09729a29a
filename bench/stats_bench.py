"""`Store.stats()` on an empty store and with 10 million pending messages (issue 18, finding 11: within 200 ms).

Its own database (`delaywheel_stats_bench`, dropped at the end unless `--keep`), loaded by `Store.send_many` as
producers would leave it: 3M messages over the 18 delay levels, and 7M wheel timers — 1M due within the next
24 h, 1M in the rest of the near window (4-hour partitions) and 5M due 4-30 days out (daily far blocks) — plus
1,000 cancellations among them. Nothing delivers while it runs, so the first level and wheel messages fall due
and stay overdue, as with a stopped deliverer. Each figure is the p50 and max of several calls, beside two
baselines of the same run: a `SELECT 1` round trip, and counting the pending messages the plain way (one
`count(*)` over the pending view, which is what the figures would cost if they were counted message by message).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

from psycopg.conninfo import make_conninfo

from delaywheel import Store
from delaywheel.db import connect
from delaywheel.migrate import migrate
from delaywheel.ops import stats as stats_module
from delaywheel.pending import PENDING
from delaywheel.produce.validation import Message

from .common import Check, body, chunks, log, print_section, server_url

DB = "delaywheel_stats_bench"
EMPTY_DB = "delaywheel_stats_bench_empty"
TARGET_S = 0.200
ROUNDS = 7


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every count (1.0 = 10M pending)")
    parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many call")
    parser.add_argument("--keep", action="store_true", help="keep the loaded database (and reuse it if it exists)")
    return parser.parse_args()


def load(store: Store, scale: float, batch: int) -> dict[str, int]:
    """The 10M (times `scale`) pending messages; returns how many went where."""
    rng = random.Random(18)
    now = store.clock()
    plan = {
        "levels": int(3_000_000 * scale),
        "wheel, next 24 h": int(1_000_000 * scale),
        "wheel, 1-3.5 days": int(1_000_000 * scale),
        "wheel, 4-30 days (far)": int(5_000_000 * scale),
    }
    spans = {
        "wheel, next 24 h": (timedelta(seconds=5), timedelta(hours=24)),
        "wheel, 1-3.5 days": (timedelta(hours=24), timedelta(days=3.5)),
        "wheel, 4-30 days (far)": (timedelta(days=4), timedelta(days=30)),
    }
    sent = 0
    for what, count in plan.items():
        started = time.perf_counter()
        for start, size in chunks(count, batch):
            if what == "levels":
                messages = [
                    Message("bench.stats", body(start + j), delay_level=1 + (start + j) % 18, key=f"l-{start + j}")
                    for j in range(size)
                ]
            else:
                lo, hi = spans[what]
                messages = [
                    Message(
                        "bench.stats",
                        body(start + j),
                        key=f"w-{sent + start + j}",
                        deliver_at=now + lo + rng.random() * (hi - lo),
                    )
                    for j in range(size)
                ]
            store.send_many(messages)
        sent += count
        log(f"loaded {count:,} ({what}) in {time.perf_counter() - started:,.0f} s")
    ids = [
        row[0]
        for row in store.conn.execute(
            "(SELECT id FROM delaywheel.wheel ORDER BY random() LIMIT %(n)s)"
            " UNION ALL (SELECT ids[1] FROM delaywheel.wheel_far_segments ORDER BY random() LIMIT %(n)s)",
            {"n": max(1, int(500 * min(scale, 1.0)))},
        )
    ]
    for message_id in ids:
        store.cancel(message_id=message_id, reason="bench")
    plan["cancelled"] = len(ids)
    return plan


def timed(fn, rounds: int = ROUNDS) -> list[float]:  # type: ignore[no-untyped-def]
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return seconds


def p50_max(seconds: list[float]) -> str:
    return f"p50 {statistics.median(seconds) * 1000:,.1f} ms, max {max(seconds) * 1000:,.1f} ms"


def measure(url: str, label: str, notes: list[str], checks: list[Check]) -> None:
    with Store(url) as store:
        store.stats()  # the connection and the first planning, untimed
        one = timed(lambda: store.conn.execute("SELECT 1").fetchone(), 50)
        stats = timed(lambda: store.stats())
        figures = store.stats()
        profile = [f"{name} {ms:,.1f} ms" for name, ms in statement_times(store)]
        count_started = time.perf_counter()
        (pending,) = store.conn.execute(f"SELECT count(*) FROM ({PENDING}) p").fetchone()  # type: ignore[misc]
        count_s = time.perf_counter() - count_started
    wheel = figures["wheel"]
    backlog = sum(row["backlog"] for row in figures["levels"])
    notes.append(
        f"{label}: stats() {p50_max(stats)} over {ROUNDS} calls; `SELECT 1` round trip {p50_max(one)}; "
        f"`count(*)` over the pending view once: {count_s * 1000:,.0f} ms ({pending:,} rows, cancellations "
        f"not subtracted; timers already due when their batch was sent went straight to their topic); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; stats said: level backlog {backlog:,}, wheel pending {wheel['pending']:,} "
        f"(overdue {wheel['overdue']:,}, next minute {wheel['next_minute']:,}, hour {wheel['next_hour']:,}, "
        f"day {wheel['next_day']:,}, later {wheel['later']:,})"
    )
    notes.append(f"{label}: where one stats() call's time goes, statement by statement: " + "; ".join(profile))
    checks.append(
        Check(
            f"stats() p50, {label} (ms)",
            statistics.median(stats) * 1000,
            TARGET_S * 1000,
            f"<= {TARGET_S * 1000:.0f} ms",
            statistics.median(stats) <= TARGET_S,
        )
    )
    checks.append(
        Check(
            f"stats() max, {label} (ms)",
            max(stats) * 1000,
            TARGET_S * 1000,
            f"<= {TARGET_S * 1000:.0f} ms",
            max(stats) <= TARGET_S,
        )
    )


def fresh_database(name: str) -> str:
    with connect(server_url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]
        conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    url = make_conninfo(server_url(), dbname=name)
    migrate(url)
    return url


def drop_database(name: str) -> None:
    with connect(server_url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]


def statement_times(store: Store) -> list[tuple[str, float]]:
    """One stats() call with each statement timed (stats._rows wrapped), named by what it reads."""
    plain = stats_module._rows
    times: list[tuple[str, float]] = []

    def timed_rows(conn, sql, params=None):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return plain(conn, sql, params)
        finally:
            words = " ".join(sql.split())
            name = next((n for key, n in STATEMENTS if key in words), words[:40])
            times.append((name, (time.perf_counter() - started) * 1000))

    stats_module._rows = timed_rows
    try:
        store.stats()
    finally:
        stats_module._rows = plain
    return times


STATEMENTS = [
    ("FROM delaywheel.wheel_state", "state"),
    ("FROM delaywheel.topic_messages WHERE origin", "lateness"),
    ("generate_series(1, greatest", "levels"),
    ("pg_stat_get_live_tuples", "near partitions"),
    ("count(*) FROM delaywheel.wheel w", "near wheel counts"),
    ("w.xid >= ", "stragglers"),
    ("FROM delaywheel.cancellations c", "cancelled"),
    ("wheel_far_segments s WHERE s.block >", "far blocks"),
    ("t.topic, t.depth", "topics"),
    ("FROM delaywheel.quarantine GROUP", "quarantine counts"),
    ("unnest(%(reasons)s", "quarantine recent"),
    ("FROM delaywheel.set_aside GROUP", "set-aside counts"),
    ("FROM delaywheel.set_aside ORDER", "set-aside recent"),
]


def exists(name: str) -> bool:
    with connect(server_url(), autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def main() -> list[Check]:
    args = parse_args()
    started = datetime.now(UTC)
    checks: list[Check] = []
    notes: list[str] = []
    empty = fresh_database(EMPTY_DB)
    measure(empty, "empty store", notes, checks)
    drop_database(EMPTY_DB)
    url = make_conninfo(server_url(), dbname=DB)
    if args.keep and exists(DB):
        migrate(url)
        log(f"reusing {DB}")
    else:
        url = fresh_database(DB)
        with Store(url) as store:
            store.prepare()
            loaded = load(store, args.scale, args.batch)
            store.conn.execute("VACUUM (ANALYZE)")  # what autovacuum does after a bulk load (insert threshold)
        notes.append(
            "loaded by send_many: " + ", ".join(f"{v:,} {k}" for k, v in loaded.items()) + ", then VACUUM (ANALYZE)"
        )
    total = int(10_000_000 * args.scale)
    measure(url, f"{total:,} pending", notes, checks)
    if not args.keep:
        drop_database(DB)
    command = "python -m bench.stats_bench" + (f" --scale {args.scale}" if args.scale != 1.0 else "")
    print_section("stats: figures for operators (issue 18, finding 11)", checks, notes, started, command)
    return checks


if __name__ == "__main__":
    main()
