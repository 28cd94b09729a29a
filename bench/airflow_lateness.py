"""Delivery lateness through the running Airflow deliver DAG (issue 4), beside the store's own delivery loop.

Two phases on the same machine, each on a fresh store database, with the same steady load (default
1,000 messages/s for 10 minutes, then a drain): about half on the delay levels (every level whose delay
still falls due inside the run), the rest on the timing wheel at arbitrary millisecond due times, plus 3 %
far-future wheel messages that must stay pending (any delivery of one is early).
  1. baseline: `delaywheel deliver` (the store's own loop, one process, no Airflow);
  2. Airflow: `scripts/airflow.sh standalone` (scheduler, DAG processor, triggerer, API server, LocalExecutor)
     on its own metadata database, running `delaywheel_deliver` continuously with leases, so the lease
     hand-overs between runs fall inside the measurement.
Reported: lateness p50/p99/max, early, duplicates, missing; Airflow's overhead from its metadata database
(queued -> start of each deliver task, the idle gap of each lane between consecutive runs) and the CPU of
its processes from /proc (triggerer, scheduler, API server, DAG processor, task processes).

Run: `python -m bench.airflow_lateness --minutes 10` (use `--minutes 2 --lease 60` for a trial).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from delaywheel import Message, Store, load_settings
from delaywheel.dev.local_airflow import as_url
from delaywheel.ops.stats import LATENESS_P50_P99, LATENESS_S

from .common import ProcessCpu, fresh_database, load_options, log, server_url

ROOT = Path(__file__).resolve().parents[1]  # the checkout: scripts/airflow.sh, dags/, .delaywheel/
OUT = ROOT / ".delaywheel" / "bench"
METADATA_DB = "airflow_bench"
DAG_ID = "delaywheel_deliver"
TOPICS = ("bench.orders", "bench.payments", "bench.reminders")
FAR_SHARE, LEVEL_SHARE = 0.03, 0.47  # the rest goes to the wheel at arbitrary times
DUE_MARGIN_S = 5.0  # every non-far message falls due at least this long before the phase's end
TICK_S = 0.1
TARGETS = {"p50": 0.100, "p99": 1.0, "max": 5.0}


@dataclass
class Sent:
    due_ids: set[int] = field(default_factory=set)  # must be delivered by the end
    far_ids: set[int] = field(default_factory=set)  # must not be delivered
    seconds: float = 0.0


@dataclass
class Outcome:
    name: str
    sent: Sent
    figures: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_message(
    seq: int, remaining_s: float, rng: random.Random, levels: list[tuple[int, float]]
) -> tuple[Message, bool]:
    """One message of the mix; returns (message, is_far). `remaining_s`: time left before the phase ends."""
    topic = TOPICS[seq % len(TOPICS)]
    body = {"seq": seq, "note": "x" * 48}
    r = rng.random()
    if r < FAR_SHARE:
        return Message(topic, body, delay=timedelta(seconds=rng.uniform(2 * 3600, 3 * 86400)), key=f"far-{seq}"), True
    horizon = remaining_s - DUE_MARGIN_S
    eligible = [level for level, delay in levels if delay <= horizon]
    if r < FAR_SHARE + LEVEL_SHARE and eligible:
        return Message(topic, body, delay_level=rng.choice(eligible), key=f"lvl-{seq}"), False
    return Message(
        topic, body, delay=timedelta(seconds=rng.uniform(0.05, max(0.1, min(600.0, horizon)))), key=f"whl-{seq}"
    ), False


def produce(url: str, rate: int, load_s: float, total_s: float, seed: int) -> Sent:
    """Send `rate` messages/s for `load_s` seconds in 100 ms batches (catching up if a batch runs late)."""
    rng = random.Random(seed)
    sent = Sent()
    with Store(url) as store:
        levels = [(i, d.total_seconds()) for i, d in enumerate(store.settings.levels, start=1)]
        start = time.monotonic()
        seq = 0
        while (elapsed := time.monotonic() - start) < load_s:
            target = int(min(elapsed + TICK_S, load_s) * rate)  # by wall time: a late batch catches up
            made = [make_message(s, total_s - elapsed, rng, levels) for s in range(seq, target)]
            ids = store.send_many([m for m, _ in made])
            for message_id, (_, far) in zip(ids, made, strict=True):
                (sent.far_ids if far else sent.due_ids).add(message_id)
            seq = target
            time.sleep(TICK_S - (time.monotonic() - start) % TICK_S)  # to the next 100 ms boundary
        sent.seconds = time.monotonic() - start
    return sent


def measure(url: str, sent: Sent, settle_s: float) -> dict[str, Any]:
    """Wait (up to `settle_s`) until every due message is delivered, then compute the figures."""
    deadline = time.monotonic() + settle_s
    with psycopg.connect(url) as conn:
        while True:
            delivered = conn.execute(
                "SELECT message_id FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel')"
            ).fetchall()
            ids = [r[0] for r in delivered]
            missing = len(sent.due_ids - set(ids))
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        row = conn.execute(
            sql.SQL("""
            SELECT delivered, early, p[1], p[2], max_s, level[2], wheel[2]
            FROM (SELECT count(*) AS delivered, count(*) FILTER (WHERE delivered_at < deliver_at) AS early,
                         {p50_p99} AS p,
                         max({lateness}) AS max_s, {p50_p99} FILTER (WHERE origin = 'level') AS level,
                         {p50_p99} FILTER (WHERE origin = 'wheel') AS wheel
                  FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel')) l""").format(
                p50_p99=LATENESS_P50_P99, lateness=LATENESS_S
            )
        ).fetchone()
        assert row is not None
        worst = conn.execute(
            sql.SQL("""
            SELECT to_timestamp(floor(extract(epoch FROM deliver_at) / 10) * 10), max({lateness}), count(*)
            FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel')
            GROUP BY 1 ORDER BY 2 DESC LIMIT 3""").format(lateness=LATENESS_S)
        ).fetchall()
        over_1s = conn.execute(
            "SELECT count(*) FROM delaywheel.topic_messages"
            " WHERE origin IN ('level', 'wheel') AND delivered_at - deliver_at > interval '1 second'"
        ).fetchone()
    return {
        "delivered": row[0],
        "early": row[1],
        "p50": row[2],
        "p99": row[3],
        "max": row[4],
        "p99_level": row[5],
        "p99_wheel": row[6],
        "duplicates": len(ids) - len(set(ids)),
        "missing": missing,
        "far_delivered": len(sent.far_ids & set(ids)),
        "over_1s": over_1s[0] if over_1s else 0,
        "worst_10s": [(f"{w[0]:%H:%M:%S}", float(w[1]), w[2]) for w in worst],
    }


class OldestTransaction:
    """Samples, every second, the age of the oldest transaction holding an xid anywhere on the cluster (other
    sessions' work in any database): context for the contention, since xid horizons are cluster-wide."""

    def __init__(self, url: str) -> None:
        self.url, self.ages = url, [0.0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> OldestTransaction:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(1.0):
                row = conn.execute(
                    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)::float8"
                    " FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
                ).fetchone()
                self.ages.append(row[0] if row else 0.0)

    def note(self) -> str:
        over = sum(1 for a in self.ages if a > 1.0)
        return (
            f"oldest xid-holding transaction on the cluster (any database, sampled each second): max "
            f"{max(self.ages):.1f} s; older than 1 s in {over} of {len(self.ages)} samples"
        )


def run_load(url: str, args: argparse.Namespace) -> tuple[Sent, dict[str, Any]]:
    load_s = args.minutes * 60
    total_s = load_s + args.drain
    log(f"load: {args.rate}/s for {load_s:.0f} s, every due time inside {total_s:.0f} s")
    started = time.monotonic()
    with OldestTransaction(url) as oldest:
        sent = produce(url, args.rate, load_s, total_s, args.seed)
        log(
            f"sent {len(sent.due_ids) + len(sent.far_ids):,} in {sent.seconds:.1f} s "
            f"({(len(sent.due_ids) + len(sent.far_ids)) / sent.seconds:,.0f}/s); draining"
        )
        time.sleep(max(0.0, started + total_s - time.monotonic()))
    figures = measure(url, sent, settle_s=60.0)
    figures["oldest_xact"] = oldest.note()
    return sent, figures


# --- baseline: the store's own delivery loop --------------------------------------------------------------


def baseline(args: argparse.Namespace) -> Outcome:
    url = fresh_database("delaywheel_bench_loop")
    seconds = args.baseline_minutes * 60 + args.drain + 90
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": as_url(url)}
    deliverer = subprocess.Popen(
        [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", f"{seconds:.0f}s"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        load = argparse.Namespace(**{**vars(args), "minutes": args.baseline_minutes})
        sent, figures = run_load(url, load)
    finally:
        deliverer.terminate()
        deliverer.wait(timeout=30)
    return Outcome(
        "store loop (no Airflow)",
        sent,
        figures,
        [f"baseline: `delaywheel deliver` (one process, every lane), {args.baseline_minutes:g} min of load"],
    )


# --- Airflow ------------------------------------------------------------------------------------------------


def fresh_metadata_db(server: str) -> None:
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {METADATA_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {METADATA_DB}")


@contextmanager
def standalone(
    store_url: str, lease: float | None, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`scripts/airflow.sh standalone` on a free port, a fresh metadata database and the given store (and
    `extra_env`, e.g. another DAG folder)."""
    server = server_url()
    fresh_metadata_db(server)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    metadata = as_url(server, "postgresql+psycopg2", METADATA_DB)
    env = {
        **os.environ,
        "AIRFLOW_CONN_DELAYWHEEL_DEFAULT": as_url(store_url),
        "DELAYWHEEL_DATABASE_URL": as_url(store_url),  # what scripts/airflow.sh migrates: this store, not the default
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata,
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
    }
    if lease:
        env["AIRFLOW__DELAYWHEEL__DELIVER_LEASE_SECONDS"] = str(lease)
    env.update(extra_env or {})
    OUT.mkdir(parents=True, exist_ok=True)
    logfile = (OUT / "airflow-standalone.log").open("wb")
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "airflow.sh"), "standalone"],
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log(f"airflow standalone pid {proc.pid} on {base} (log {logfile.name})")
    try:
        yield proc, make_conninfo(server, dbname=METADATA_DB)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group already exited (a failed start)
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log("airflow stopped")


def wait_running(
    metadata_url: str, tasks: int, proc: subprocess.Popen[bytes], timeout: float, dag_id: str = DAG_ID
) -> None:
    """Until `tasks` tasks of `dag_id` (default: every deliver lane of the continuous run) are running: the load
    must not start before."""
    deadline = time.monotonic() + timeout
    running = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited ({proc.returncode}); see {OUT}/airflow-standalone.log")
        try:
            with psycopg.connect(metadata_url) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM task_instance WHERE dag_id = %s AND state = 'running'", (dag_id,)
                ).fetchone()
                running = row[0] if row else 0
        except (psycopg.OperationalError, psycopg.errors.UndefinedTable):  # not up, or not migrated yet
            running = 0
        if running >= tasks:
            return
        time.sleep(3.0)
    raise TimeoutError(f"only {running}/{tasks} {dag_id} tasks running after {timeout:.0f} s")


def failed_tries(conn: psycopg.Connection, dag_id: str) -> int:
    """Task tries of `dag_id` that failed: retried ones (in task_instance_history) and current ones."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM task_instance_history WHERE dag_id = %(d)s AND state = 'failed')"
        " + (SELECT count(*) FROM task_instance WHERE dag_id = %(d)s AND state = 'failed')",
        {"d": dag_id},
    ).fetchone()
    return row[0] if row else 0


def service_kind(cmdline: str) -> str:
    """Which Airflow service a process of the standalone's tree is, from its command line."""
    for kind, needles in (
        ("triggerer", ("triggerer",)),
        ("dag-processor", ("dag-processor", "dag_processor")),
        ("api-server", ("api-server", "api_server", "uvicorn")),
        ("scheduler", ("scheduler",)),
    ):
        if any(n in cmdline for n in needles):
            return kind
    return "tasks and other"


def task_overhead(metadata_url: str, since: datetime) -> dict[str, Any]:
    """From Airflow's task_instance table: queued -> start latency of each deliver task, and each lane's idle
    gap between one run's task ending and the next run's task starting (the lease hand-over)."""
    with psycopg.connect(metadata_url) as conn:
        rows = conn.execute(
            """
            SELECT task_id, queued_dttm, start_date, end_date FROM task_instance
            WHERE dag_id = %s AND start_date IS NOT NULL ORDER BY task_id, start_date""",
            (DAG_ID,),
        ).fetchall()
        runs = conn.execute("SELECT count(*) FROM dag_run WHERE dag_id = %s", (DAG_ID,)).fetchone()
        failed = failed_tries(conn, DAG_ID)
    starts = sorted((s - q).total_seconds() for _, q, s, _ in rows if q is not None and s >= since)
    gaps: list[float] = []
    for (task, _, _, end), (task2, _, start2, _) in pairwise(rows):
        if task == task2 and end is not None and start2 >= since:
            gaps.append((start2 - end).total_seconds())
    gaps.sort()
    return {
        "task_starts": len(starts),
        "start_p50": _pct(starts, 0.5),
        "start_max": max(starts, default=None),
        "handovers": len(gaps),
        "gap_p50": _pct(gaps, 0.5),
        "gap_max": max(gaps, default=None),
        "runs": runs[0] if runs else 0,
        "failed_tries": failed,
    }


def split_by_coverage(store_url: str, metadata_url: str) -> dict[str, Any]:
    """Lateness of messages due while their lane's deliver task was running ("steady") against those due while
    the lane had no task (between runs: the hand-over), from the task intervals in Airflow's metadata."""
    with psycopg.connect(metadata_url) as conn:
        tis = conn.execute(
            "SELECT task_id, start_date, end_date FROM task_instance WHERE dag_id = %s"
            " AND start_date IS NOT NULL ORDER BY start_date",
            (DAG_ID,),
        ).fetchall()
    intervals: dict[str, list[tuple[datetime, datetime]]] = defaultdict(list)
    far_future = datetime.max.replace(tzinfo=UTC)
    for task_id, start, end in tis:
        intervals[task_id].append((start, end or far_future))
    with psycopg.connect(store_url) as conn:
        rows = conn.execute(
            "SELECT origin, level, deliver_at, extract(epoch FROM delivered_at - deliver_at)::float8"
            " FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel')"
        ).fetchall()
    steady: list[float] = []
    between: list[float] = []
    for origin, level, due, late in rows:
        lane = "advance_wheel" if origin == "wheel" else f"deliver_level_{level}"
        covered = any(start <= due <= end for start, end in intervals[lane])
        (steady if covered else between).append(late)
    steady.sort()
    between.sort()
    return {
        "steady_n": len(steady),
        "steady_p50": _pct(steady, 0.5),
        "steady_p99": _pct(steady, 0.99),
        "steady_max": max(steady, default=None),
        "between_n": len(between),
        "between_p50": _pct(between, 0.5),
        "between_max": max(between, default=None),
    }


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def through_airflow(args: argparse.Namespace) -> Outcome:
    url = fresh_database("delaywheel_bench_airflow")
    lanes = load_settings().max_level + 1
    with standalone(url, args.lease) as (proc, metadata_url):
        wait_running(metadata_url, lanes, proc, timeout=900)
        log(f"all {lanes} deliver tasks running; settling 10 s")
        time.sleep(10)
        since = datetime.now(UTC)
        load0 = os.getloadavg()
        with ProcessCpu(root=proc.pid) as cpu:
            sent, figures = run_load(url, args)
        load1 = os.getloadavg()
        log(f"processes by kind: {cpu.census(service_kind)}")
        overhead = task_overhead(metadata_url, since)
        coverage = split_by_coverage(url, metadata_url)
    shares = cpu.shares(service_kind)
    notes = [
        f"lateness of messages due while their lane's deliver task was running: p50 {_ms(coverage['steady_p50'])}, "
        f"p99 {_ms(coverage['steady_p99'])}, max {_ms(coverage['steady_max'])} ({coverage['steady_n']:,} msgs); "
        f"due while the lane had no task (between runs): {coverage['between_n']:,} msgs, p50 "
        f"{_ms(coverage['between_p50'])}, max {_ms(coverage['between_max'])}",
        f"Airflow task start latency (queued -> running, deliver tasks started in the window): "
        f"p50 {_s(overhead['start_p50'])}, max {_s(overhead['start_max'])} over {overhead['task_starts']} starts; "
        f"{overhead['runs']} `{DAG_ID}` runs; {overhead['failed_tries']} deliver task tries failed (e.g. killed "
        "by Airflow after missed heartbeats; see the standalone log)",
        f"lease hand-overs in the window: {overhead['handovers']}, lane idle between runs p50 "
        f"{_s(overhead['gap_p50'])}, max {_s(overhead['gap_max'])}",
        "Airflow CPU over the load window (share of one core): " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()),
        f"load average (1 min) {load0[0]:.1f} at the start, {load1[0]:.1f} at the end, on {os.cpu_count()} cores "
        "shared with other work" + (f"; {args.note}" if args.note else ""),
    ]
    return Outcome("through Airflow", sent, figures, notes)


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f} s"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:,.0f} ms"


def report(outcomes: list[Outcome], args: argparse.Namespace, started: datetime, command: str) -> None:
    airflow = outcomes[-1].figures
    print("\n### Airflow delivery lateness (issue 4)\n")
    print(f"Command: `{command}` — started {started:%Y-%m-%d %H:%M} UTC\n")
    print("| measure | " + " | ".join(o.name for o in outcomes) + " | target | result |")
    print("|---|" + "---:|" * len(outcomes) + "---|---|")
    rows: list[tuple[str, Callable[[dict[str, Any]], str], str, bool]] = [
        ("messages sent (due / far)", lambda f: "", "", True),
        ("lateness p50", lambda f: _ms(f["p50"]), "≤ 100 ms", (airflow["p50"] or 0) <= TARGETS["p50"]),
        ("lateness p99", lambda f: _ms(f["p99"]), "≤ 1 s", (airflow["p99"] or 0) <= TARGETS["p99"]),
        ("lateness max", lambda f: _ms(f["max"]), "≤ 5 s", (airflow["max"] or 0) <= TARGETS["max"]),
        ("p99 levels / wheel", lambda f: f"{_ms(f['p99_level'])} / {_ms(f['p99_wheel'])}", "", True),
        ("later than 1 s", lambda f: f"{f['over_1s']:,}", "", True),
        (
            "early",
            lambda f: f"{f['early'] + f['far_delivered']:,}",
            "0",
            airflow["early"] + airflow["far_delivered"] == 0,
        ),
        ("duplicates", lambda f: f"{f['duplicates']:,}", "0", airflow["duplicates"] == 0),
        ("missing", lambda f: f"{f['missing']:,}", "0", airflow["missing"] == 0),
    ]
    for name, cell, target, passed in rows:
        if name.startswith("messages sent"):
            cells = [f"{len(o.sent.due_ids):,} / {len(o.sent.far_ids):,}" for o in outcomes]
        else:
            cells = [cell(o.figures) for o in outcomes]
        print(
            f"| {name} | " + " | ".join(cells) + f" | {target} | {('PASS' if passed else 'FAIL') if target else ''} |"
        )
    print()
    for o in outcomes:
        worst = "; ".join(f"{t} max {_ms(m)} ({n} msgs)" for t, m, n in o.figures["worst_10s"])
        print(f"- {o.name}: worst 10-s windows by due time: {worst}")
        print(f"- {o.name}: {o.figures['oldest_xact']}")
        for note in o.notes:
            print(f"- {note}")
    print(flush=True)


def main() -> None:
    parser = load_options(
        argparse.ArgumentParser(description=__doc__.split("\n")[0]),
        minutes=10.0,
        seed=4,
        minutes_help="minutes of steady load through Airflow",
    )
    parser.add_argument("--drain", type=float, default=60.0, help="seconds after the load in which the rest falls due")
    parser.add_argument("--lease", type=float, help="deliver task lease in seconds (default: airflow.cfg's)")
    parser.add_argument(
        "--baseline-minutes", type=float, default=2.0, help="minutes of load for the no-Airflow baseline (0 skips it)"
    )
    args = parser.parse_args()
    started = datetime.now(UTC)
    outcomes = [baseline(args)] if args.baseline_minutes > 0 else []
    outcomes.append(through_airflow(args))
    report(outcomes, args, started, "python -m bench.airflow_lateness " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
