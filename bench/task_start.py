"""What Airflow spends starting a deliver run's tasks: 19 lane tasks (`per_lane`, the default) against one (`one`).

Each mode runs in its own live Airflow (`scripts/airflow.sh standalone`: LocalExecutor, fresh metadata database, an
empty store) with a DAG folder holding only `delaywheel_deliver`, a run every `--lease` s. Once the first run's tasks
run, the CPU of every process of the standalone's tree is counted for `--runs` lease periods (bench.common.ProcessCpu,
/proc), by kind: the deliver task processes, the LocalExecutor workers (each supervises a task: its heartbeats, its
log), the scheduler, the API server (the task's calls to the execution API), the rest. With an empty store a lane task
does almost nothing but start, so the task processes' and workers' CPU per run is what starting the run costs; the
scheduler's and the API server's include their idle work over the same seconds. A task process's own start is also read
directly: its CPU when it is 25-30 s old.

On 2 cores this is the burst that sets an Airflow consumer's p99 under `per_lane` (DESIGN.md, "What sets its p99 on
two cores"). Run: `python -m bench.task_start` (about 12 minutes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from delaywheel import load_settings

from .airflow_lateness import DAG_ID, ROOT, service_kind, standalone, wait_running
from .common import CLK_TCK, Check, ProcessCpu, drop_database, fresh_database, log, print_section, proc_stats, title_of

DB = "delaywheel_bench_task_start"
FOLDER = ROOT / ".delaywheel" / "bench" / "task_start_dags"
YOUNG_S = (25.0, 30.0)  # a task process's age at which its CPU is read as its start's


def kind(title: str) -> str:
    """What a process of the standalone's tree is, from its title: a LocalExecutor worker, a deliver task process, or
    one of the standalone's services (`service_kind`, whose "tasks and other" holds what is left)."""
    if title.startswith("airflow worker -- LocalExecutor"):
        return "LocalExecutor workers (supervisors)"
    if title.startswith("airflow worker -- "):
        return "deliver task processes"
    return service_kind(title)


def young_cpu(started_after: float) -> dict[int, float]:
    """CPU seconds of each task process born after `started_after` (seconds since boot) that is now 25-30 s old."""
    now = float(Path("/proc/uptime").read_text().split()[0])
    found = {}
    for pid, (_, ticks, born_ticks) in proc_stats().items():
        born = born_ticks / CLK_TCK
        young = born > started_after and YOUNG_S[0] <= now - born <= YOUNG_S[1]
        if young and kind(title_of(pid) or "") == "deliver task processes":  # titles read only for the young
            found[pid] = ticks / CLK_TCK
    return found


def measure(mode: str, lease: float, runs: int) -> dict[str, float]:
    """CPU per deliver run by kind of process, and the task processes' CPU when 25-30 s old, for one mode."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "dags" / "delaywheel_deliver.py", FOLDER)
    url = fresh_database(DB)
    tasks = 1 if mode == "one" else load_settings().max_level + 1
    env = {
        "AIRFLOW__CORE__DAGS_FOLDER": str(FOLDER),
        "AIRFLOW__DELAYWHEEL__DELIVER_TASKS": mode,
        "AIRFLOW__DELAYWHEEL__DELIVER_OVERLAP_SECONDS": str(lease / 3),
    }
    with standalone(url, lease, env) as (proc, metadata_url):
        wait_running(metadata_url, tasks, proc, timeout=900)
        log(f"{mode}: the first run's {tasks} task(s) running; counting CPU over {runs} runs of {lease:g} s")
        since = datetime.now(UTC)
        boot = float(Path("/proc/uptime").read_text().split()[0])
        young: dict[int, float] = {}
        with ProcessCpu(root=proc.pid, every_s=1.0) as cpu:
            deadline = time.monotonic() + runs * lease
            while time.monotonic() < deadline:
                young.update(young_cpu(boot))
                time.sleep(1.0)
        with psycopg.connect(metadata_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM task_instance WHERE dag_id = %s AND start_date >= %s", (DAG_ID, since)
            ).fetchone()
    drop_database(DB)
    started = row[0] if row else 0
    per_run = {k: v / runs for k, v in cpu.by_kind(kind).items()}
    figures = {f"{k} (s a run)": v for k, v in sorted(per_run.items(), key=lambda kv: -kv[1])}
    figures["tasks started"] = started
    start = per_run.get("deliver task processes", 0.0) + per_run.get("LocalExecutor workers (supervisors)", 0.0)
    figures["task processes + their supervisors (s a run)"] = start
    if young:
        figures["a task process at 25-30 s old, median (s)"] = statistics.median(young.values())
        figures["a task process at 25-30 s old, max (s)"] = max(young.values())
    return figures


def main() -> list[Check]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=60.0, help="a deliver run starts this often (s)")
    parser.add_argument("--runs", type=int, default=3, help="deliver runs counted per mode")
    args = parser.parse_args()
    started = datetime.now(UTC)
    found = {mode: measure(mode, args.lease, args.runs) for mode in ("per_lane", "one")}
    key = "task processes + their supervisors (s a run)"
    one, per_lane = found["one"][key], found["per_lane"][key]
    checks = [
        Check("CPU starting a deliver run's tasks, one vs per_lane (s)", one, per_lane, "ratio < 1.00", one < per_lane)
    ]
    notes = [
        f"{mode}: " + "; ".join(f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        for mode, figures in found.items()
    ]
    print_section(
        "Starting a deliver run's tasks",
        checks,
        notes,
        started,
        f"python -m bench.task_start --lease {args.lease:g} --runs {args.runs}",
    )
    return checks


if __name__ == "__main__":
    main()
