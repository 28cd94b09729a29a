"""Consumer-observed lateness through the Airflow long-running consumer (issue 19, item 3), lease hand-overs included.

A live Airflow (`scripts/airflow.sh standalone`: API server, scheduler with the LocalExecutor, triggerer, DAG processor)
on its own metadata database, with a DAG folder of two DAGs: `delaywheel_deliver` (the project's, its lanes' leases as
configured; `--deliver-tasks one` gives it one task for every lane) and `bench_consumer_lease`, a copy of
`delaywheel_consumer_lease_template` with a short lease (a run every `--interval` s, each task consuming until
`--interval + --overlap` s after its run's scheduled time), so that several hand-overs fall inside the load. Its handler
(`apply_function_batch`) appends, per message, (message_id, received, due, delivered_at) to a file per task process,
`received` being `time.time()` when the batch reached the handler (the database's clock on this machine). A producer
sends a steady `--rate` (1,000) messages/s with delays uniform in 1-10 s (timing-wheel timers; bench.consumer_lateness's
producer). The DAG file also records each full garbage collection of the consumer task processes from their first batch
on (one would hold messages up).

Reported, against the issue's targets (p50 <= 50 ms, p99 <= 250 ms, max <= 1 s; 0 early, duplicates, missing):
received - due per message, beside the baseline of the same run, the delivery-only lateness of the same messages
(delivered_at - due), as ratios; the hand-overs seen in the records (the task handling changes) with their gaps
(last message of the old task to the first of the new) and the lateness of the messages the new task handled in
its first 2 s; the lateness of the messages received in the 20 s after a deliver lane task started during the load,
apart from all the others, how long each deliver run took to start its lane tasks, and how many lanes' old tasks
ended before their successors ran; Airflow's start latency of the consumer tasks and their failed tries.
`--handover-slots N` sets the deliver pool's hand-over slots (`[delaywheel] deliver_handover_slots`; 19 starts a run's
lane tasks all at once, as before 2026-11-30).

Run: `python -m bench.airflow_consumer_lateness --minutes 10` (about 16 minutes; `--minutes 2` for a trial).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import psycopg

from delaywheel import load_settings

from .airflow_lateness import DAG_ID as DELIVER_DAG_ID
from .airflow_lateness import METADATA_DB, ROOT, failed_tries, standalone, wait_running
from .common import Check, ProcessCpu, drop_database, fresh_database, load_options, log, print_section
from .consumer_lateness import TOPIC, percentiles, produce

DB = "delaywheel_bench_airflow_consumer"
DAG_ID = "bench_consumer_lease"
GROUP = "bench-airflow"
WORK = ROOT / ".delaywheel" / "bench" / "airflow_consumer"
AFTER_HANDOVER_S = 2.0
# Starting a deliver lane task is a burst of CPU; 19 at once (the next run's, before the pool's hand-over slots)
# made the slowest messages on 2 cores (DESIGN.md, "What sets its p99 on two cores"), so the lateness of this long
# after each deliver task's start is reported apart from the rest.
AFTER_DELIVER_START_S = 20.0

# The consumer DAG: delaywheel_consumer_lease_template with the bench's topic, group, lease and a recording handler.
DAG_TEXT = '''"""Bench copy of delaywheel_consumer_lease_template (bench/airflow_consumer_lateness.py writes it)."""

from __future__ import annotations

import gc
import os
import time
from datetime import datetime, timedelta
from typing import IO, Any

from airflow.sdk import DAG

from delaywheel.airflow.operators import ConsumeOperator

RECORDS = {records!r}
_out: IO[str] | None = None
_full_since = 0.0


def _full_collections(phase: str, info: dict[str, int]) -> None:
    """The duration of each full (generation 2) collection in this task process once it handles, to its own file."""
    global _full_since
    if info["generation"] != 2:
        return
    if phase == "start":
        _full_since = time.perf_counter()
        return
    with open(os.path.join(RECORDS, f"gc-{{os.getpid()}}.tsv"), "a") as out:
        out.write(f"{{time.time():.6f}}\\t{{(time.perf_counter() - _full_since) * 1000:.3f}}\\n")


def record(messages: list[Any]) -> None:
    """(message_id, received, due, delivered_at) per message, to this task process's own file."""
    global _out
    now = time.time()
    if _out is None:  # the task's first batch: from now on, its full collections are recorded too
        _out = open(os.path.join(RECORDS, f"consumer-{{os.getpid()}}.tsv"), "a")
        gc.callbacks.append(_full_collections)
    _out.write("".join(f"{{m.message_id}}\\t{{now:.6f}}\\t{{m.deliver_at.timestamp():.6f}}\\t"
                       f"{{m.delivered_at.timestamp():.6f}}\\n" for m in messages))
    _out.flush()


with DAG(dag_id={dag_id!r}, schedule=timedelta(seconds={interval}), max_active_runs=2, is_paused_upon_creation=False,
         start_date=datetime(2025, 1, 1), catchup=False,
         default_args={{"retries": 2, "retry_delay": timedelta(seconds=5)}}):
    ConsumeOperator(task_id="consume", topic={topic!r}, group={group!r}, apply_function_batch=record,
                    lease_seconds={lease}, handover_grace_seconds={overlap}, max_messages=500)
'''


def dag_folder(records: Path, interval: float, overlap: float) -> Path:
    """A DAG folder with the project's deliver DAG and the bench consumer DAG."""
    folder = WORK / "dags"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "delaywheel_deliver.py", folder)
    (folder / f"{DAG_ID}.py").write_text(
        DAG_TEXT.format(
            records=str(records),
            dag_id=DAG_ID,
            interval=interval,
            topic=TOPIC,
            group=GROUP,
            lease=interval + overlap,
            overlap=overlap,
        )
    )
    return folder


def full_collections(records: Path) -> list[float]:
    """The durations (ms) of the full garbage collections the consumer task processes ran once they handled their
    first batch (the DAG file records them): the ones that can hold a message up."""
    return [
        float(line.split("\t")[1])
        for path in sorted(records.glob("gc-*.tsv"))
        for line in path.read_text().splitlines()
    ]


def read_records(records: Path) -> list[tuple[int, float, float, float, int]]:
    """(message_id, received, due, delivered_at, task file index) of every handled message."""
    rows = []
    for index, path in enumerate(sorted(records.glob("consumer-*.tsv"))):
        for line in path.read_text().splitlines():
            mid, received, due, delivered = line.split("\t")
            rows.append((int(mid), float(received), float(due), float(delivered), index))
    return rows


def handovers(rows: list[tuple[int, float, float, float, int]]) -> list[tuple[float, float, int]]:
    """(moment the new task handled its first batch, gap since the old task's last, new task) per hand-over."""
    seq = sorted((r[1], r[4]) for r in rows)
    return [(t, t - t0, task) for (t0, a), (t, task) in pairwise(seq) if task != a]


def within(received: np.ndarray, since: float, seconds: float) -> np.ndarray:
    """Which messages were received in the `seconds` from `since` (a hand-over, a deliver run's start)."""
    return (received >= since) & (received < since + seconds)


def kind_of(tasks: dict[str, str]) -> Callable[[str], str]:
    """What a process on the machine is, from its title: this bench's consumer task, its deliver lane tasks (task
    processes are titled `airflow worker -- <task instance id>`; `tasks`: task instance id -> task id), task
    supervisors, Airflow services, PostgreSQL backends of the store and of Airflow's metadata, this bench's producer,
    or everything else on the machine (other work sharing the 2 cores)."""

    def kind(title: str) -> str:
        if title.startswith("airflow worker -- "):
            task = tasks.get(title.split()[-1], "")
            return (
                "consumer tasks"
                if task == "consume"
                else "wheel lane task"
                if task == "advance_wheel"
                else "level lane tasks"
                if task.startswith("deliver_level_")
                else "every-lane deliver task"
                if task == "deliver_all_lanes"
                else "other tasks"
            )
        if title.startswith("airflow supervisor"):
            return "task supervisors"
        if title.startswith("postgres: "):
            return (
                "PostgreSQL, store"
                if f" {DB} " in title
                else "PostgreSQL, Airflow metadata"
                if f" {METADATA_DB} " in title
                else "PostgreSQL, other"
            )
        if "airflow" in title:
            return "Airflow services"
        if f"{Path(sys.executable).name} -m bench.airflow_consumer_lateness" in title or "multiprocessing" in title:
            return "this bench (producer)"
        return "everything else"

    return kind


def task_figures(metadata_url: str, since: datetime) -> dict[str, Any]:
    with psycopg.connect(metadata_url) as conn:
        rows = conn.execute(
            "SELECT queued_dttm, start_date FROM task_instance WHERE dag_id = %s AND start_date >= %s", (DAG_ID, since)
        ).fetchall()
        failed = failed_tries(conn, DAG_ID)
        tis = {str(r[0]): r[1] for r in conn.execute("SELECT id, task_id FROM task_instance")}
        lane_tasks = conn.execute(  # the deliver DAG's lane tasks (not its publish task), by run
            "SELECT run_id, task_id, queued_dttm, start_date, end_date FROM task_instance"
            " WHERE dag_id = %s AND task_id <> 'publish_topic_events' AND start_date IS NOT NULL",
            (DELIVER_DAG_ID,),
        ).fetchall()
        pool = conn.execute("SELECT slots FROM slot_pool WHERE pool = 'delaywheel_deliver'").fetchone()
    return {
        "pool_slots": pool[0] if pool else None,
        **lane_handovers(lane_tasks, since),
        "tasks": len(rows),
        "ids": tis,
        **start_delays(rows),
        "failed": failed,
    }


def start_delays(rows: list[tuple[datetime | None, datetime]]) -> dict[str, float]:
    """The consumer tasks' waits from queued to running."""
    starts = sorted((s - q).total_seconds() for q, s in rows if q is not None)
    return {
        "start_p50": float(np.median(starts)) if starts else float("nan"),
        "start_max": max(starts, default=float("nan")),
    }


def lane_handovers(lane_tasks: list[tuple[Any, ...]], since: datetime) -> dict[str, Any]:
    """When the deliver lane tasks that started in the window started (each start is a burst of CPU on two cores),
    how long each run took to start them all after it queued its first, and how many lanes' old tasks ended before
    their successor was running (a lane without a deliverer; with the pool's hand-over slots the next run's tasks
    start a few at a time as the old ones hand over, DESIGN.md "A rolling hand-over")."""
    by_run: dict[str, list[tuple[Any, ...]]] = {}
    for task in lane_tasks:
        by_run.setdefault(task[0], []).append(task)
    first = {run: min(t[3] for t in tasks) for run, tasks in by_run.items()}
    spreads = [
        (max(t[3] for t in tasks) - min(t[2] or t[3] for t in tasks)).total_seconds()
        for run, tasks in by_run.items()
        if first[run] >= since
    ]
    started = {(run_id, task_id): start for run_id, task_id, _queued, start, _end in lane_tasks}
    ordered = sorted(by_run, key=first.__getitem__)
    ended = unserved = 0
    for old, new in pairwise(ordered):
        for _run, task_id, _queued, _start, end in by_run[old]:
            if end is not None and end >= since and (new, task_id) in started:
                ended += 1
                unserved += started[(new, task_id)] > end
    return {
        "deliver_starts": [t[3].timestamp() for t in lane_tasks if t[3] >= since],
        "run_spreads": spreads,
        "lanes_handed": ended,
        "lanes_unserved": unserved,
    }


def run(args: argparse.Namespace) -> tuple[list[Check], list[str]]:
    url = fresh_database(DB)
    records = WORK / "records"
    shutil.rmtree(records, ignore_errors=True)
    records.mkdir(parents=True)
    folder = dag_folder(records, args.interval, args.overlap)
    seconds = args.minutes * 60
    lanes = 1 if args.deliver_tasks == "one" else load_settings().max_level + 1
    ctx = mp.get_context("spawn")
    env = {"AIRFLOW__CORE__DAGS_FOLDER": str(folder), "AIRFLOW__DELAYWHEEL__DELIVER_TASKS": args.deliver_tasks}
    if args.handover_slots is not None:
        env["AIRFLOW__DELAYWHEEL__DELIVER_HANDOVER_SLOTS"] = str(args.handover_slots)
    with standalone(url, None, env) as (proc, metadata_url):
        wait_running(metadata_url, lanes, proc, timeout=900)
        wait_running(metadata_url, 1, proc, timeout=300, dag_id=DAG_ID)
        log(f"all {lanes} deliver tasks and a {DAG_ID} task running; settling 10 s")
        time.sleep(10)
        since = datetime.now(UTC)
        load_before = Path("/proc/loadavg").read_text().strip()
        produced_rx, produced_tx = ctx.Pipe(duplex=False)
        producer = ctx.Process(target=produce, args=(url, args.rate, seconds, args.seed, produced_tx))
        log(
            f"producing {args.rate}/s for {seconds:.0f} s (consumer lease {args.interval + args.overlap:g} s, "
            f"a run every {args.interval:g} s)"
        )
        with ProcessCpu() as cpu:  # every process on the machine: who else shares the 2 cores shows too
            producer.start()
            ids: list[int] = produced_rx.recv()
            producer.join()
        log(f"sent {len(ids):,}; waiting for the last to fall due and be handled")
        deadline = time.monotonic() + 60
        while len({r[0] for r in read_records(records)}) < len(ids) and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(3.0)  # anything extra (a duplicate) would show up now
        load_after = Path("/proc/loadavg").read_text().strip()
        tasks = task_figures(metadata_url, since)
    shares = cpu.shares(kind_of(tasks["ids"]))
    rows = read_records(records)
    got = np.array([r[0] for r in rows], dtype=np.int64)
    received, due, delivered = (np.array([r[i] for r in rows]) for i in (1, 2, 3))
    unique, first = np.unique(got, return_index=True)
    lateness_ms = (received[first] - due[first]) * 1000
    delivery_ms = (delivered[first] - due[first]) * 1000
    early = int((lateness_ms < 0).sum())
    duplicates = len(got) - len(unique)
    missing = len(set(ids) - set(unique.tolist()))
    p50, p99, worst = percentiles(lateness_ms)
    d50, d99, dworst = percentiles(delivery_ms)
    moments = handovers(rows)
    by_task = np.array([r[4] for r in rows])
    near = np.zeros(len(rows), dtype=bool)
    for t, _gap, task in moments:
        near |= within(received, t, AFTER_HANDOVER_S) & (by_task == task)
    near_ms = (received[near] - due[near]) * 1000
    h50, h99, hworst = percentiles(near_ms)
    burst = np.zeros(len(rows), dtype=bool)
    for t in tasks["deliver_starts"]:
        burst |= within(received, t, AFTER_DELIVER_START_S)
    _, b99, _ = percentiles((received[burst] - due[burst]) * 1000)
    _, o99, oworst = percentiles((received[~burst] - due[~burst]) * 1000)
    gaps = sorted(g * 1000 for _, g, _ in moments)
    spreads = tasks["run_spreads"]
    collected = full_collections(records)
    ok_counts = early == 0 and duplicates == 0 and missing == 0
    checks = [
        Check("consumer lateness p50 (ms) vs delivery-only p50", p50, d50, "<= 50 ms", p50 <= 50),
        Check("consumer lateness p99 (ms) vs delivery-only p99", p99, d99, "<= 250 ms", p99 <= 250),
        Check("consumer lateness max (ms) vs delivery-only max", worst, dworst, "<= 1000 ms", worst <= 1000),
        Check("early + duplicates + missing (messages)", early + duplicates + missing, len(ids), "0", ok_counts),
    ]
    handoff = lateness_ms - delivery_ms
    notes = [
        f"{len(ids):,} sent at {args.rate}/s over {args.minutes:g} min, delays uniform 1-10 s (timing wheel); "
        f"Airflow standalone (LocalExecutor) running `delaywheel_deliver` (deliver_tasks = {args.deliver_tasks}: "
        f"{lanes} deliver task(s) a run, leases as configured) "
        f"and `{DAG_ID}` (ConsumeOperator, batches of up to 500, a run every {args.interval:g} s, lease "
        f"{args.interval + args.overlap:g} s, grace {args.overlap:g} s)",
        f"consumer lateness (received - due): p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms; "
        f"early {early}, duplicates {duplicates}, missing {missing}",
        f"delivery-only lateness (delivered_at - due), same messages: p50 {d50:.1f} ms, p99 {d99:.1f} ms, "
        f"max {dworst:.1f} ms",
        f"what the consumer adds (received - delivered_at): p50 {np.percentile(handoff, 50):.1f} ms, "
        f"p99 {np.percentile(handoff, 99):.1f} ms, max {handoff.max():.1f} ms"
        if len(handoff)
        else "nothing received",
        f"hand-overs seen in the records: {len(moments)}; gap (old task's last message to the new one's first) "
        + (f"p50 {np.median(gaps):.0f} ms, max {max(gaps):.0f} ms" if gaps else "-")
        + f"; lateness of the {len(near_ms):,} messages the new task handled in its first {AFTER_HANDOVER_S:g} s: "
        f"p50 {h50:.1f} ms, p99 {h99:.1f} ms, max {hworst:.1f} ms",
        f"deliver lane tasks started during the load: {len(tasks['deliver_starts'])}"
        + (
            f" (each run's from its first queued to its last running: {', '.join(f'{s:.0f}' for s in spreads)} s)"
            if spreads
            else ""
        )
        + f"; lateness of the {int(burst.sum()):,} messages received in the {AFTER_DELIVER_START_S:g} s after any of "
        f"those starts: p99 {b99:.1f} ms; of all the others: p99 {o99:.1f} ms, max {oworst:.1f} ms",
        f"lane hand-overs from one deliver run to the next in the window: {tasks['lanes_handed']}, of which "
        f"{tasks['lanes_unserved']} left a lane without a deliver task (the old one ended before its successor ran); "
        f"the deliver pool's slots (as scripts/airflow.sh set them): {tasks['pool_slots']}",
        f"full garbage collections in the consumer task processes once they handled: {len(collected)}"
        + (f" (longest {max(collected):.1f} ms)" if collected else ""),
        f"consumer tasks started in the window: {tasks['tasks']} (queued -> running p50 {tasks['start_p50']:.2f} s, "
        f"max {tasks['start_max']:.2f} s); failed tries {tasks['failed']}",
        "CPU over the load window (share of one core; 2 cores = 200 %): "
        + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()),
        f"/proc/loadavg before the load {load_before}, after {load_after} (2 cores shared)"
        + (f"; {args.note}" if args.note else ""),
    ]
    drop_database(DB)
    return checks, notes


def main(argv: list[str] | None = None) -> list[Check]:
    parser = load_options(argparse.ArgumentParser(description=__doc__), minutes=10.0, seed=19)
    parser.add_argument("--interval", type=float, default=60.0, help="a consumer run (lease) starts this often (s)")
    parser.add_argument("--overlap", type=float, default=20.0, help="each lease lasts this much longer (s)")
    parser.add_argument(
        "--deliver-tasks",
        choices=("per_lane", "one"),
        default="per_lane",
        help="the deliver DAG's [delaywheel] deliver_tasks: a task per lane (the default) or one for every lane",
    )
    parser.add_argument(
        "--handover-slots",
        type=int,
        help="[delaywheel] deliver_handover_slots: the next deliver run's tasks that may start beside the running "
        "run's (default: as configured, 3); 19 starts them all at once",
    )
    args, _ = parser.parse_known_args(argv)
    started = datetime.now(UTC)
    checks, notes = run(args)
    print_section(
        "Airflow long-running consumer (issue 19, item 3)",
        checks,
        notes,
        started,
        "python -m bench.airflow_consumer_lateness " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    return checks


if __name__ == "__main__":
    sys.exit(0 if all(c.passed for c in main()) else 1)
