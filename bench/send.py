"""Sending, against what a hand-written table costs on the same server in the same run.

1. A single `send` (level, wheel, and inside a caller's transaction) against a single-row INSERT into a plain
   delayed-jobs table (a bigint primary key and a due-time index), interleaved call by call. Target: p50 <= 2 x.
2. `send_many` against a raw binary COPY of the same rows into a plain table, interleaved batch by batch (the order
   rotating): levels 2-17 at random, and wheel timers due 1 s - 30 days ahead. Targets: >= 0.60 x (levels),
   >= 0.50 x (wheel).

    python -m bench send [--scale 0.1] [--batch 20000]
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import psycopg

from delaywheel import Message, Store

from .common import RAW_TABLE, Check, at_least, body, chunks, copy_rows, database, log, options, pct, report, scaled

DB = "delaywheel_bench_send"
TOPIC = "bench.orders"
JOBS = """CREATE TABLE raw_timers (id bigserial PRIMARY KEY, topic text NOT NULL, key text, tags text,
    properties jsonb, body bytea NOT NULL, is_json boolean NOT NULL, deliver_at timestamptz NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp());
    CREATE INDEX ON raw_timers (deliver_at)"""
INSERT = (
    "INSERT INTO raw_timers (topic, key, tags, body, is_json, deliver_at)"
    " VALUES (%s, %s, %s, %s, false, clock_timestamp() + %s * interval '1 millisecond') RETURNING id"
)


def single_sends(store: Store, raw: psycopg.Connection, count: int) -> dict[str, list[float]]:
    """µs per call, by case; each round runs every case once, in turn, so that load hits them alike."""
    raw.execute(JOBS)

    def in_tx(conn: psycopg.Connection, call: Callable[[], object]) -> None:
        with conn.transaction():  # BEGIN, the one call, COMMIT: the caller's own transaction
            call()

    cases: dict[str, Callable[[int], object]] = {
        "send, level": lambda i: store.send(TOPIC, body(i), delay_level=3, key=f"l-{i}", tags="created"),
        "send, wheel": lambda i: store.send(TOPIC, body(i), delay=30_000, key=f"w-{i}", tags="created"),
        "INSERT": lambda i: raw.execute(INSERT, (TOPIC, f"r-{i}", "created", body(i), 30_000)).fetchone(),
        "send in tx, wheel": lambda i: in_tx(
            store.conn, lambda: store.send(TOPIC, body(i), delay=30_000, key=f"t-{i}", tags="created")
        ),
        "INSERT in tx": lambda i: in_tx(
            raw, lambda: raw.execute(INSERT, (TOPIC, f"x-{i}", "created", body(i), 30_000)).fetchone()
        ),
    }
    for i in range(50):  # warm up: connections, prepared statements, partitions
        for call in cases.values():
            call(i)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(count):
        for name, call in cases.items():
            started = time.perf_counter()
            call(i)
            times[name].append(1e6 * (time.perf_counter() - started))
    return times


def send_many_vs_copy(
    store: Store, raw: psycopg.Connection, count: int, batch: int, kind: str, seed: int
) -> tuple[float, float]:
    """(ours, raw COPY) in msg/s for the same rows: `kind` "level" (levels 2-17) or "wheel" (due 1 s - 30 days)."""
    table = f"raw_copy_{kind}"
    raw.execute(RAW_TABLE.format(name=table))
    rng, seconds = random.Random(seed), {"ours": 0.0, "raw": 0.0}
    warm_up = [(count, min(batch, 5000))]  # untimed: the first batch creates the partitions it meets, once a store
    for n, (start, size) in enumerate([*warm_up, *chunks(count, batch)], -1):
        now = datetime.now(UTC)
        if kind == "level":
            levels: list[int | None] = [rng.randint(2, 17) for _ in range(size)]
            dues = [now + store.settings.level_delay(lv) for lv in levels]  # type: ignore[arg-type]
        else:
            levels, dues = [None] * size, [now + timedelta(seconds=rng.uniform(1, 30 * 86400)) for _ in range(size)]
        messages = [
            Message(TOPIC, body(i), lv, deliver_at=None if lv else due, key=f"{kind}-{i}", tags="created")
            for i, lv, due in zip(range(start, start + size), levels, dues, strict=True)
        ]
        rows = [(i, TOPIC, f"{kind}-{i}", due, now) for i, due in zip(range(start, start + size), dues, strict=True)]
        for side in ("ours", "raw") if n % 2 else ("raw", "ours"):
            started = time.perf_counter()
            if side == "ours":
                store.send_many(messages)
            else:
                with raw.transaction():
                    copy_rows(raw, table, rows)
            if n >= 0:  # not the warm-up
                seconds[side] += time.perf_counter() - started
    return count / seconds["ours"], count / seconds["raw"]


def main(argv: list[str], name: str) -> list[Check]:
    args = options(__doc__).parse_args(argv)
    n_single, n_many = scaled(2000, args.scale, 100), scaled(500_000, args.scale)
    with database(DB) as url, Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
        store.prepare()
        log(f"single sends: {n_single} rounds of 5 cases")
        times = single_sends(store, raw, n_single)
        many = {}
        for kind, seed in (("level", 2), ("wheel", 3)):
            log(f"send_many vs raw COPY, {kind}: {n_many} messages in batches of {args.batch}")
            many[kind] = send_many_vs_copy(store, raw, n_many, args.batch, kind, seed)
    p50 = {case: pct(v, 0.5) for case, v in times.items()}
    p99 = {case: pct(v, 0.99) for case, v in times.items()}
    checks = [
        Check(f"{case} p50 (µs), / INSERT", p50[case], p50[base], "ratio <= 2.00", p50[case] <= 2 * p50[base])
        for case, base in (("send, level", "INSERT"), ("send, wheel", "INSERT"), ("send in tx, wheel", "INSERT in tx"))
    ]
    checks.append(at_least("send_many, levels / raw COPY (msg/s)", *many["level"], 0.60))
    checks.append(at_least("send_many, wheel / raw COPY (msg/s)", *many["wheel"], 0.50))
    notes = [f"{case}: p50 {p50[case]:,.0f} µs, p99 {p99[case]:,.0f} µs ({n_single:,} calls)" for case in times]
    notes.append(f"send_many: {n_many:,} messages a kind in batches of {args.batch:,}, interleaved with the COPY")
    return report(name, "Sending against a single-row INSERT and a raw COPY", checks, notes, argv)
