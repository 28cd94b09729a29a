"""Shared benchmark plumbing: the benchmark database, the same rows for ours and the baselines, stopwatches
and the pass/fail table each module prints (markdown, pasted into bench/RESULTS.md)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.conninfo import make_conninfo

from delaywheel.config import load_settings
from delaywheel.db import database_url
from delaywheel.dev import embedded
from delaywheel.migrate import migrate

BENCH_DB = "delaywheel_bench"
BODY_PAD = "x" * 64  # bodies of ~90 bytes: a typical small JSON event


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every message count (1.0 = the issue's sizes: 1M backlog, 10M pending)")
    parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many / COPY batch")
    return parser.parse_args()


def scaled(count: int, scale: float, minimum: int = 1000) -> int:
    return max(minimum, int(count * scale))


def body(i: int) -> bytes:
    """The same body for ours and the baseline (bytes, so both write identical rows)."""
    return f'{{"order":{i:010d},"note":"{BODY_PAD}"}}'.encode()


def server_url() -> str:
    """A role that may create databases: DELAYWHEEL_DATABASE_URL's, or the embedded cluster's superuser (its default
    URL is the runtime role's, which may create nothing; README, "Roles")."""
    settings = load_settings()
    if settings.database_url:
        return make_conninfo(settings.database_url, dbname="postgres")
    database_url(settings)  # starts the embedded cluster (idempotent)
    return embedded.default_cluster().admin_url("postgres")


def fresh_database(name: str = BENCH_DB) -> str:
    """Drop and recreate `name` (default `delaywheel_bench`) on the project's cluster, migrate it, return its URL."""
    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    url = make_conninfo(server, dbname=name)
    migrate(url)
    return url


def drop_database(name: str) -> None:
    with psycopg.connect(server_url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def chunks(count: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive batches covering range(count)."""
    for start in range(0, count, size):
        yield start, min(size, count - start)


def copy_rows(conn: psycopg.Connection, table: str, columns: Sequence[str], types: list[str], rows: Iterable[tuple]) -> None:
    """The raw baseline: binary COPY with write_row, exactly what a hand-written loader does."""
    sql = f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
    with conn.cursor().copy(sql) as copy:  # type: ignore[arg-type]
        copy.set_types(types)
        for row in rows:
            copy.write_row(row)


class Stopwatch:
    """Accumulates the time of the timed sections only (setup between them is not counted)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0

    @contextmanager
    def run(self, count: int = 0) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started
            self.count += count

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0


def table_bytes(conn: psycopg.Connection, table: str) -> int:
    """Heap + indexes + TOAST of a table, summed over its partitions when it is partitioned."""
    row = conn.execute(
        "SELECT CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)"
        " FROM pg_partition_tree(c.oid) t) ELSE pg_total_relation_size(c.oid) END FROM pg_class c WHERE c.oid = %s::regclass",
        (table,),
    ).fetchone()
    return int(row[0]) if row else 0


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class Check:
    """One target of an issue: ours against the baseline of the same run."""

    name: str
    ours: float
    baseline: float
    target: str
    passed: bool

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("nan")


def at_least(name: str, ours: float, baseline: float, minimum: float) -> Check:
    return Check(name, ours, baseline, f"ratio >= {minimum:.2f}", baseline > 0 and ours / baseline >= minimum)


def flat(name: str, loaded: float, empty: float, tolerance: float = 0.2) -> Check:
    """Cost stays flat: the rate with the store loaded is within `tolerance` of the empty store's."""
    ratio = loaded / empty if empty else float("nan")
    return Check(name, loaded, empty, f"ratio within 1 ± {tolerance:.2f}", abs(ratio - 1) <= tolerance)


def smaller(name: str, ours: float, baseline: float) -> Check:
    return Check(name, ours, baseline, "ours < baseline", ours < baseline)


def print_section(title: str, checks: list[Check], notes: list[str], started: datetime, command: str) -> None:
    """A markdown section: the command, the checks with ratios and pass/fail, and the other figures."""
    print(f"\n### {title}\n")
    print(f"Command: `{command}` — started {started:%Y-%m-%d %H:%M} UTC\n")
    print("| measure | ours | baseline | ratio | target | result |")
    print("|---|---:|---:|---:|---|---|")
    for c in checks:
        print(f"| {c.name} | {c.ours:,.0f} | {c.baseline:,.0f} | {c.ratio:.2f} | {c.target} | "
              f"{'PASS' if c.passed else 'FAIL'} |")
    print()
    for note in notes:
        print(f"- {note}")
    print(flush=True)
