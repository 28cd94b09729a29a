"""Shared benchmark plumbing: the benchmark database, the same rows for ours and the baselines, stopwatches, and
the report every run ends with: a table of ratios against the baseline measured in the same run, printed and
written as JSON (command, commit, figures) under bench/results/."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from delaywheel.config import load_settings
from delaywheel.dev import embedded
from delaywheel.migrate import migrate

BENCH_DB = "delaywheel_bench"
BODY_PAD = "x" * 64  # bodies of ~90 bytes: a typical small JSON event


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every message count (1.0 = the issue's sizes: 1M backlog, 10M pending)",
    )
    parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many / COPY batch")
    return parser.parse_args(argv)


def load_options(
    parser: argparse.ArgumentParser, *, minutes: float, seed: int, minutes_help: str = "producing time (the issue: 10)"
) -> argparse.ArgumentParser:
    """The options of the lateness benches, which all produce a steady load: how long (`--minutes`), how fast
    (`--rate`), with which random `--seed`, and a `--note` for the results (e.g. the background load)."""
    parser.add_argument("--minutes", type=float, default=minutes, help=minutes_help)
    parser.add_argument("--rate", type=int, default=1000, help="messages per second")
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--note", default="", help="a note for the results (e.g. the background load)")
    return parser


def pct(values: list[float], q: float) -> float:
    """The `q` quantile (0-1) of `values`, by rank; nan for none."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


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
    return embedded.start().admin_url("postgres")  # (started if need be, idempotently)


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


def copy_rows(
    conn: psycopg.Connection, table: str, columns: Sequence[str], types: list[str], rows: Iterable[tuple]
) -> None:
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

    @property
    def result(self) -> str:
        return "PASS" if self.passed else "FAIL"


def at_least(name: str, ours: float, baseline: float, minimum: float) -> Check:
    return Check(name, ours, baseline, f"ratio >= {minimum:.2f}", baseline > 0 and ours / baseline >= minimum)


def smaller(name: str, ours: float, baseline: float) -> Check:
    return Check(name, ours, baseline, "ours < baseline", ours < baseline)


RESULTS = Path(__file__).resolve().parent / "results"  # `python -m bench --results DIR` sends a run elsewhere
ROOT = RESULTS.parents[1]


def commit() -> str:
    """The checkout's commit, `+` when its tracked files differ from it (the run measured uncommitted code)."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "plugins", "bench"]).returncode
    return head.stdout.strip() + ("+" if dirty else "")


def report(
    name: str,
    title: str,
    checks: list[Check],
    notes: list[str],
    started: datetime,
    argv: list[str] | None,
    figures: dict[str, Any] | None = None,
) -> Path:
    """Print the run's markdown section (the checks with their ratios and pass/fail, then the notes) and write it as
    bench/results/<date>-<name>-<time>.json: date, command, commit, figures (the checks, and any `figures`), target
    and verdict when the run has checks, notes."""
    command = " ".join(["python -m bench", name, *(argv if argv is not None else sys.argv[2:])])
    print(f"\n### {title}\n")
    print(f"Command: `{command}` at {commit()} — started {started:%Y-%m-%d %H:%M} UTC\n")
    if checks:
        print("| measure | ours | baseline | ratio | target | result |")
        print("|---|---:|---:|---:|---|---|")
        for c in checks:
            print(f"| {c.name} | {c.ours:,.2f} | {c.baseline:,.2f} | {c.ratio:.2f} | {c.target} | {c.result} |")
        print()
    for note in notes:
        print(f"- {note}")
    record: dict[str, Any] = {"date": f"{started:%Y-%m-%d}", "section": title, "command": command, "commit": commit()}
    if checks:
        record["target"] = "; ".join(f"{c.name}: {c.target}" for c in checks)
        record["verdict"] = "; ".join(f"{c.name}: {c.result}" for c in checks)
    record["figures"] = {
        **{c.name: {"ours": c.ours, "baseline": c.baseline, "ratio": c.ratio, "result": c.result} for c in checks},
        **(figures or {}),
    }
    record["notes"] = notes or [title]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{started:%Y-%m-%d}-{name}-{started:%H%M}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str) + "\n")
    print(f"\nrecorded: {path}", flush=True)
    return path
