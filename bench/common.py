"""Shared benchmark plumbing: the benchmark database, the same rows for ours and the baselines, stopwatches
and the pass/fail table each module prints (markdown, pasted into bench/RESULTS.md)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from delaywheel.config import load_settings
from delaywheel.dev import embedded
from delaywheel.migrate import migrate

BENCH_DB = "delaywheel_bench"
BODY_PAD = "x" * 64  # bodies of ~90 bytes: a typical small JSON event
CLK_TCK = os.sysconf("SC_CLK_TCK")


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every message count (1.0 = the issue's sizes: 1M backlog, 10M pending)",
    )
    parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many / COPY batch")
    return parser.parse_args()


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


def wheel_partitions(conn: psycopg.Connection) -> int:
    """How many partitions the near wheel has now (a cancel by key opens each of them)."""
    row = conn.execute("SELECT count(*) FROM delaywheel.partitions WHERE parent = 'wheel'").fetchone()
    return int(row[0]) if row else 0


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


class ProcessCpu:
    """CPU seconds (utime + stime, from /proc/<pid>/stat) of processes over the `with` block, sampled every
    `every_s` seconds: a process that exits loses at most its last `every_s`, one born inside the block counts
    whole. `root`: count that process and its descendants (e.g. an Airflow standalone's tree); None: every process
    on the machine (to see who else shares the cores). Each process is known by its command line as last seen
    (`title`), which `kind` functions map to what it is: a forked Airflow task process first carries its parent's
    title (`airflow worker -- LocalExecutor: ...`) and names itself after its task instance a moment later."""

    def __init__(self, root: int | None = None, every_s: float = 2.0) -> None:
        self.root, self.every = root, every_s
        self.first: dict[int, int] = {}  # pid -> ticks at its first sample (0 if born during the window)
        self.last: dict[int, int] = {}
        self.title: dict[int, str] = {}
        self.seconds = 0.0  # the window's length
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ProcessCpu:
        self.seconds = -time.monotonic()
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.seconds += time.monotonic()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def _sample(self, initial: bool = False) -> None:
        stats = proc_stats()
        for pid in stats.keys() if self.root is None else _tree(self.root, stats):
            title = title_of(pid)
            if title is None:  # gone since the stat
                continue
            if pid not in self.first:
                self.first[pid] = stats[pid][1] if initial else 0
            self.title[pid] = title
            self.last[pid] = stats[pid][1]

    def by_kind(self, kind: Callable[[str], str]) -> dict[str, float]:
        """CPU seconds over the window per kind of process, `kind` naming it from its title."""
        totals: dict[str, float] = defaultdict(float)
        for pid, last in self.last.items():
            totals[kind(self.title[pid])] += (last - self.first[pid]) / CLK_TCK
        return dict(totals)

    def shares(self, kind: Callable[[str], str]) -> dict[str, float]:
        """`by_kind` as shares of one core over the window (2 cores: up to 200 %), largest first."""
        return {k: v / self.seconds for k, v in sorted(self.by_kind(kind).items(), key=lambda kv: -kv[1])}

    def census(self, kind: Callable[[str], str]) -> str:
        """Which titles were counted as which kind (to check a classification)."""
        seen: dict[str, set[str]] = defaultdict(set)
        for title in self.title.values():
            seen[kind(title)].add(title[:60])
        return "; ".join(f"{k}: {len(v)} titles, e.g. {sorted(v)[:3]}" for k, v in sorted(seen.items()))


def title_of(pid: int) -> str | None:
    """The process's command line as it names itself now, or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def proc_stats() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, utime + stime ticks, start time in ticks since boot) of every process now (one read of each
    /proc/<pid>/stat)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]))
    return stats


def _tree(root: int, stats: dict[int, tuple[int, int, int]]) -> set[int]:
    """`root` and all its descendants among `stats`' processes."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, *_) in stats.items():
        children[ppid].append(pid)
    members, frontier = {root}, [root]
    while frontier:
        for child in children[frontier.pop()]:
            if child not in members:
                members.add(child)
                frontier.append(child)
    return members & stats.keys()


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
        print(
            f"| {c.name} | {c.ours:,.0f} | {c.baseline:,.0f} | {c.ratio:.2f} | {c.target} | "
            f"{'PASS' if c.passed else 'FAIL'} |"
        )
    print()
    for note in notes:
        print(f"- {note}")
    print(flush=True)
