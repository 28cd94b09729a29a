"""Shared benchmark plumbing: the databases, the same rows for ours and the baselines (and their plain tables), the
deliverer's process, and the report every run ends with: the ratios against the baseline measured in the same run,
printed and written as JSON (command, commit, figures) under bench/results/."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from delaywheel.config import load_settings
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url
from delaywheel.migrate import migrate

RESULTS = Path(__file__).resolve().parent / "results"  # `python -m bench --results DIR` sends a run elsewhere
ROOT = RESULTS.parents[1]
STARTED = datetime.now(UTC)  # the running benchmark's start (set by __main__ for each)
BODY_PAD = "x" * 64  # bodies of ~90 bytes: a typical small JSON event
# The baselines' plain table: every field a message carries, one row per message, no index; filled by binary COPY.
RAW_COLUMNS = "id, topic, key, tags, properties, body, is_json, deliver_at, enqueued_at"
RAW_TYPES = ["int8", "text", "text", "text", "jsonb", "bytea", "bool", "timestamptz", "timestamptz"]
RAW_TABLE = """CREATE TABLE {name} (id bigint, topic text, key text, tags text, properties jsonb, body bytea,
    is_json boolean, deliver_at timestamptz, enqueued_at timestamptz)"""
# The raw move a delivery pass is measured against: a batch from a plain table with a primary key into another.
RAW_MOVE = """WITH m AS (DELETE FROM raw_src WHERE id IN (SELECT id FROM raw_src ORDER BY id LIMIT %s) RETURNING *)
    INSERT INTO raw_dst SELECT * FROM m"""


def options(doc: str | None, scale: str = "multiply every count", batch: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser with the options most take: `--scale` (1.0 = the sizes the targets are set at) and
    `--batch` (messages per send_many / COPY)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help=scale)
    if batch:
        parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many / COPY batch")
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


def copy_rows(conn: psycopg.Connection, table: str, rows: Iterable[tuple[int, str, str, datetime, datetime]]) -> None:
    """The raw baseline: messages (i, topic, key, due, now) as rows of a plain table (RAW_TABLE), by binary COPY with
    write_row, exactly what a hand-written loader does."""
    sql = f"COPY {table} ({RAW_COLUMNS}) FROM STDIN (FORMAT BINARY)"
    with conn.cursor().copy(sql) as copy:  # type: ignore[arg-type]
        copy.set_types(RAW_TYPES)
        for i, topic, key, due, now in rows:
            copy.write_row((10**12 + i, topic, key, "created", None, body(i), False, due, now))


def raw_source(conn: psycopg.Connection, *sources: str) -> None:
    """The raw move's tables: raw_src holding the rows of `sources` (RAW_COLUMNS) with a primary key, raw_dst empty."""
    conn.execute("DROP TABLE IF EXISTS raw_src, raw_dst")
    conn.execute(RAW_TABLE.format(name="raw_src"))
    select = " UNION ALL ".join(f"SELECT {RAW_COLUMNS} FROM {source}" for source in sources)
    conn.execute(f"INSERT INTO raw_src {select}")  # type: ignore[arg-type]
    conn.execute("ALTER TABLE raw_src ADD PRIMARY KEY (id)")
    conn.execute(RAW_TABLE.format(name="raw_dst"))
    conn.execute("ANALYZE raw_src")


def server_url() -> str:
    """A role that may create databases: DELAYWHEEL_DATABASE_URL's, or the embedded cluster's superuser (its default
    URL is the runtime role's, which may create nothing; README, "Roles")."""
    settings = load_settings()
    if settings.database_url:
        return make_conninfo(settings.database_url, dbname="postgres")
    return embedded.start().admin_url("postgres")  # (started if need be, idempotently)


@contextmanager
def database(name: str) -> Iterator[str]:
    """A fresh database `name` on the project's cluster, migrated, for the block (its URL); dropped after it."""
    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]
        conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    url = make_conninfo(server, dbname=name)
    try:
        migrate(url)
        yield url
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_note(before: float, note: str) -> str:
    """The load average before and now, and the run's `--note` (the background load)."""
    note = f"; {note}" if note else ""
    return f"load average before {before:.1f}, after {os.getloadavg()[0]:.1f} (2 cores shared){note}"


def chunks(count: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive batches covering range(count)."""
    for start in range(0, count, size):
        yield start, min(size, count - start)


class Deliverer:
    """One `delaywheel deliver` process on every lane, as operators run it: when it said it was ready, and (with
    `progress`) how many it has delivered, from its progress lines every 0.2 s."""

    def __init__(self, url: str, seconds: float = 1800, progress: bool = False) -> None:
        command = [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", f"{seconds:.0f}s"]
        self.proc = subprocess.Popen(
            command + (["--progress-every", "0.2"] if progress else []),
            env={**os.environ, "DELAYWHEEL_DATABASE_URL": as_url(url)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ready_at, self.delivered = 0.0, 0  # time.time() when the ready line was read; delivered so far
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(120):
            self.stop()
            raise RuntimeError("delaywheel deliver did not say it was ready within 120 s")

    def _read(self) -> None:
        for line in self.proc.stderr or ():
            if "ready" in line and not self._ready.is_set():
                self.ready_at = time.time()
                self._ready.set()
            elif match := re.match(r"delivered (\d+) ", line):
                self.delivered = int(match.group(1))

    def wait_for(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.delivered < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"delivered {self.delivered:,} of {count:,}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def spark(app: str) -> Any:
    """A quiet local Spark session, warm; with spark/ on sys.path: its jobs are imported by name, as the tests do."""
    sys.path.insert(0, str(ROOT / "spark"))
    import sparkjob

    session = sparkjob.session(f"delaywheel bench: {app}")
    session.sparkContext.setLogLevel("ERROR")
    session.range(1).count()
    return session


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


def commit() -> str:
    """The checkout's commit, `+` when its tracked files differ from it (the run measured uncommitted code)."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "plugins", "bench"]).returncode
    return head.stdout.strip() + ("+" if dirty else "")


def report(
    name: str, title: str, checks: list[Check], notes: list[str], argv: list[str], figures: dict | None = None
) -> list[Check]:
    """Print the run's markdown section (the checks with their ratios and pass/fail, then the notes) and write it as
    bench/results/<date>-<name>-<time>.json: date, command, commit, figures (the checks, and any `figures`), target
    and verdict when the run has checks, notes. Returns the checks."""
    command, started = " ".join(["python -m bench", name, *argv]), STARTED
    print(f"\n### {title}\n\nCommand: `{command}` at {commit()} — started {started:%Y-%m-%d %H:%M} UTC\n")
    if checks:
        print("| measure | ours | baseline | ratio | target | result |\n|---|---:|---:|---:|---|---|")
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
    return checks
