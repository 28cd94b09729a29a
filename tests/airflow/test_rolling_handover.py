"""The deliver DAG's rolling hand-over in a live Airflow: the next run's lane tasks start a few at a time.

`scripts/airflow.sh` as a user runs it (API server, scheduler with the LocalExecutor, triggerer, DAG processor), on
its own AIRFLOW_HOME, metadata database and ports, with two delay levels and the wheel (three lanes), a run every
`LEASE_S`, an overlap of `OVERLAP_S` and `[delaywheel] deliver_handover_slots = 1`: the pool the script creates then
has 3 + 1 slots. Starting 19 lane tasks at once took both cores of a small machine for seconds at every hand-over
(DESIGN.md, "A rolling hand-over"); with the pool's hand-over slots the next run may start one task beside the
running run's three, and each of the others when an old task has handed its lane over and freed its slot.

Then, from Airflow's own record of the tasks: the pool has lanes + 1 slots; never more lane tasks ran at once than
that; the second run started one lane task beside the first run's, and the others only after one of the first run's
had ended; and no lane was left without a task, because each of the first run's tasks, past its lease, kept its lane
until its successor was running (`handover_grace_seconds`). Every lane task of the first run succeeded at its first
try."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests.helpers import LANES, SCRIPT, ours, processes, script_env

pytestmark = [pytest.mark.airflow, pytest.mark.timeout(600)]

# The first run's lanes hand over LEASE_S + OVERLAP_S after it (most of the test's time): the overlap, also each old
# task's grace, need only cover the next run's two lane tasks starting one after the other (4 s here) with room for a
# busy machine.
LEASE_S, OVERLAP_S, HANDOVER_SLOTS = 20, 40, 1
WITHIN_S = 360  # script start -> the first run's lanes all handed over (about 110 s here)

Task = tuple[str, str, str, datetime | None, datetime | None, int]  # run, task, state, start, end, try


def lane_tasks(meta: str) -> list[Task]:
    with psycopg.connect(meta, connect_timeout=5) as conn:
        return conn.execute(
            "SELECT run_id, task_id, state, start_date, end_date, try_number FROM task_instance"
            " WHERE dag_id = 'delaywheel_deliver' AND task_id = ANY(%s)",
            (list(LANES),),
        ).fetchall()


def most_at_once(tasks: list[Task]) -> int:
    """The most lane tasks running at one moment, from their start and end times (a running one ends now)."""
    moments = sorted(
        [(start, 1) for _, _, _, start, _, _ in tasks if start]
        + [(end, -1) for _, _, _, start, end, _ in tasks if start and end]
    )
    running = most = 0
    for _, step in moments:
        running += step
        most = max(most, running)
    return most


def test_the_next_runs_lane_tasks_start_one_by_one_and_every_lane_keeps_a_task(
    tmp_path: Path, server_url: str, db_url: str, metadata_db: str
) -> None:
    home, run_dir = tmp_path / "airflow", tmp_path / "run"
    run_dir.mkdir()
    env = script_env(home, db_url, metadata_db) | {
        "AIRFLOW__DELAYWHEEL__DELIVER_LEASE_SECONDS": str(LEASE_S),
        "AIRFLOW__DELAYWHEEL__DELIVER_OVERLAP_SECONDS": str(OVERLAP_S),
        "AIRFLOW__DELAYWHEEL__DELIVER_HANDOVER_SLOTS": str(HANDOVER_SLOTS),
    }
    meta = make_conninfo(server_url, dbname=metadata_db)
    output = tmp_path / "airflow.sh.log"
    with output.open("wb") as out:
        script = subprocess.Popen(
            [str(SCRIPT)], cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    sessions: set[int] = set()
    try:
        started = time.monotonic()
        tasks: list[Task] = []
        first = second = ""
        while True:
            assert script.poll() is None, output.read_text()[-5000:]
            assert time.monotonic() - started < WITHIN_S, (tasks, output.read_text()[-5000:])
            time.sleep(2)
            with contextlib.suppress(psycopg.Error):  # not migrated yet
                tasks = lane_tasks(meta)
            runs = sorted(
                {t[0] for t in tasks if t[3]}, key=lambda run: min(t[3] for t in tasks if t[0] == run and t[3])
            )
            if len(runs) < 2:
                continue
            first, second = runs[:2]
            ended = [t for t in tasks if t[0] == first and t[4]]
            running = [t for t in tasks if t[0] == second and t[3]]
            if len(ended) == len(LANES) and len(running) == len(LANES):
                break
        sessions = {pid for pid, (cwd, sid, _) in processes().items() if cwd == str(run_dir) and sid == pid}
        with psycopg.connect(meta) as conn:
            slots = conn.execute("SELECT slots FROM slot_pool WHERE pool = 'delaywheel_deliver'").fetchone()
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGINT)  # Ctrl-C: the script stops every service in order
            try:
                script.wait(timeout=150)
            except subprocess.TimeoutExpired:
                os.killpg(script.pid, signal.SIGKILL)
                script.wait()
        for pid in ours(run_dir, sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    assert slots == (len(LANES) + HANDOVER_SLOTS,)
    assert most_at_once(tasks) <= len(LANES) + HANDOVER_SLOTS, tasks
    old = {t[1]: t for t in tasks if t[0] == first}
    new = {t[1]: t for t in tasks if t[0] == second}
    first_end = min(when(t[4]) for t in old.values())
    # one of the second run's tasks started beside the first run's three; the others once a slot was handed back
    assert sorted(when(t[3]) < first_end for t in new.values()) == [False, False, True], (old, new)
    for lane in LANES:  # each old task kept its lane until its successor ran
        assert when(old[lane][4]) >= when(new[lane][3]), (lane, old[lane], new[lane])
        assert (old[lane][2], old[lane][5]) == ("success", 1), old[lane]


def when(moment: datetime | None) -> datetime:
    """A start or end time the wait above made sure of."""
    assert moment is not None
    return moment
