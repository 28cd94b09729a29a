"""`delaywheel_deliver` on the CeleryExecutor: two Celery workers, lease hand-overs under load, a worker killed.

Redis (Debian's `redis-server`) on a loopback port of its own, and the Airflow services through
`scripts/airflow.sh` on a metadata database, AIRFLOW_HOME and ports of their own (as the Airflow script test
does): API server, DAG processor, scheduler on the CeleryExecutor, and two `airflow celery worker`s (distinct
Celery hostnames, queue `default`, concurrency `CONCURRENCY`). The DAG folder holds the deliver DAG alone, with
two delay levels (1 s, 5 s) and the wheel, so three lanes and a pool of 2 x 3 slots; a run every `LEASE_S` and
an overlap of `OVERLAP_S`.

While a steady load is sent to all three lanes, the test waits for the first run's lanes, then for the second
run's to be alone (the first one's handed over), kills the worker running most of them (SIGKILL to its whole
session: the worker, its pool, its task processes, as a lost machine), and goes on until the fourth run holds
every lane and the third has let go: three hand-overs, one of them after the kill, carried by the survivor.
Then: every message sent is delivered exactly once and none early, the survivor ran the later runs, no lane was
unserved longer than `DEAD_WORKER_GRACE_S` (docs/celery.md: the scheduler's heartbeat timeout, its detection
interval, the DAG's retry delay and a task start), measured as each lane's largest lateness and its longest time
without a delivery, and away from the kill lateness stayed small. Every socket the run listens on is on loopback.
Lateness figures are printed (`-s`) and recorded in docs/celery.md.

Needs `redis-server` and apache-airflow-providers-celery (installed for the tests only: docs/celery.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from delaywheel import Message, Settings, Store
from delaywheel.config import parse_levels
from delaywheel.dev.local_airflow import as_url
from tests.helpers import ROOT, SCRIPT, free_ports, processes

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (docs/celery.md)"),
    pytest.mark.timeout(720),
]

DAG_ID = "delaywheel_deliver"
LEVELS = "1s 5s"
LANES = ["deliver_level_1", "deliver_level_2", "advance_wheel"]
LEASE_S, OVERLAP_S = 60, 20  # [delaywheel] deliver_lease_seconds / deliver_overlap_seconds
WORKERS = ("worker1", "worker2")
# Each worker alone must hold a whole hand-over (2 runs x 3 lanes = the pool's 6 slots): the survivor does.
CONCURRENCY = 2 * len(LANES)
HEARTBEAT_TIMEOUT_S, DETECTION_S, RETRY_DELAY_S = 20, 5, 5  # [scheduler] ...; the DAG's retry_delay
TASK_START_S = 30  # allowance for queued -> running on a busy 2-core machine
DEAD_WORKER_GRACE_S = HEARTBEAT_TIMEOUT_S + DETECTION_S + RETRY_DELAY_S + TASK_START_S
STEADY_MAX_S = 10.0  # away from the kill the hand-overs overlap (measured max 0.4 s quiet, 2.5-4.8 s busy)
RATE = 20  # messages/s, a third per lane
STARTED_WITHIN_S = 240  # services start -> the first run's lanes running (measured 25-60 s)


# Airflow on the CeleryExecutor with a throwaway Redis, all on loopback.
#
# Every Airflow service runs through `scripts/airflow.sh <command>` (what docs/celery.md tells a user to run: the
# project's airflow.cfg, the secrets generated into AIRFLOW_HOME, the store's connection), each in a session of its
# own and in a working directory of its own under one run directory. That gives a worker a whole identity: a task
# process is a worker's by its working directory (Airflow records the task's pid), and killing a worker kills the
# session and everything in its directory at once, as losing the machine would. At the end every process in a
# session or a directory of the run is killed, so nothing outlives the test, whatever failed.

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


def pss_mib(pids: list[int]) -> float:
    """Proportional set size of the processes, MiB: shared pages counted once across them all."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def redis_ping(port: int) -> bool:
    """Whether a Redis server answers PING on the loopback port (RESP inline command)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
    return False


class CeleryAirflow:
    """A run directory of services: `start` a service, `run` a one-off command, `kill` one, `close` them all."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir, self.env = run_dir, env
        self.services: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        where = self.run_dir / name
        where.mkdir(parents=True, exist_ok=True)
        log = (self.run_dir / f"{name}.log").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(argv, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.services[name] = proc
        return proc

    def start_redis(self) -> str:
        """redis-server on a free loopback port, nothing persisted (its directory is the run's); its broker URL."""
        (port,) = free_ports(1)
        proc = self._spawn(
            "redis",
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.run_dir / "redis"),
            ],
            dict(os.environ),
        )
        deadline = time.monotonic() + 20
        while not redis_ping(port):
            assert proc.poll() is None, self.log("redis")
            assert time.monotonic() < deadline, "redis-server did not answer PING within 20 s"
            time.sleep(0.1)
        return f"redis://127.0.0.1:{port}/0"

    def start(self, name: str, *command: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`scripts/airflow.sh <command>` as service `name` (its own session and directory), once the script has
        handed over to Airflow (`exec`): its set-up (`delaywheel db start`'s GRANTs) run by two scripts at once
        fails with "tuple concurrently updated"."""
        proc = self._spawn(name, [str(SCRIPT), *command], {**self.env, **(env or {})})
        deadline = time.monotonic() + 60
        while SCRIPT.name in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace"):
            assert proc.poll() is None, self.log(name)
            assert time.monotonic() < deadline, f"{name}: scripts/airflow.sh still setting up after 60 s"
            time.sleep(0.1)
        return proc

    def run(self, *command: str, timeout: float = 300) -> str:
        """`scripts/airflow.sh <command>` to the end; its output (a failure raises with it)."""
        done = subprocess.run(
            [str(SCRIPT), *command], cwd=self.run_dir, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"airflow {' '.join(command)}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        return done.stdout

    def owner(self, pid: int) -> str | None:
        """The service a process belongs to, by its working directory (a task process is its worker's)."""
        try:
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except OSError:
            return None
        return cwd.name if cwd.parent == self.run_dir and cwd.name in self.services else None

    def members(self, names: list[str] | None = None) -> list[int]:
        """Live processes of the given services (all by default): by session or working directory."""
        wanted = set(names or self.services)
        sessions = {self.services[n].pid for n in wanted}
        dirs = {str(self.run_dir / n) for n in wanted}
        return [
            pid for pid, (cwd, sid, _) in processes().items() if (sid in sessions or cwd in dirs) and pid != os.getpid()
        ]

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of service `name` at once, as a lost machine; the pids killed."""
        pids = self.members([name])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.services[name].wait(timeout=30)
        return pids

    def tree(self, name: str) -> dict[int, int]:
        """pid -> parent pid of service `name`'s live processes."""
        parents = {}
        for pid in self.members([name]):
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                parents[pid] = int(stat[stat.rindex(")") + 2 :].split()[1])
        return parents

    def listening(self) -> set[str]:
        """The addresses the run's processes listen on (TCP, `host:port` as the kernel shows them in hex)."""
        inodes = set()
        for pid in self.members():
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        target = os.readlink(fd)
                        if target.startswith("socket:["):
                            inodes.add(target[8:-1])
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.add(fields[1])
        return found

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def close(self) -> None:
        """Kill everything the run started (tasks included) and reap the services; checks nothing is left."""
        for _ in range(3):  # a process forked while we kill is caught by the next round
            for pid in self.members():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for proc in self.services.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            if not self.members():
                break
            time.sleep(0.5)
        for log in self._logs:
            log.close()
        left = {pid: processes().get(pid) for pid in self.members()}
        assert not left, f"processes left behind: {left}"


@dataclass
class Try:
    run: str
    run_after: datetime
    task: str
    try_number: int
    state: str | None
    start: datetime | None
    end: datetime | None


@dataclass
class Load:
    """Sends RATE messages/s on its own thread until stopped: level 1, level 2 and wheel delays in turn."""

    url: str
    settings: Settings
    ids: list[int] = field(default_factory=list)
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        rng = random.Random(21)
        try:
            with Store(self.url, self.settings) as store:
                seq, started = 0, time.monotonic()
                while not self.stop.wait(0.1):
                    target = int((time.monotonic() - started) * RATE)
                    batch = [self._message(n, rng) for n in range(seq, target)]
                    if batch:
                        self.ids += store.send_many(batch)
                    seq = target
        except BaseException as exc:  # reported by the test, not lost on the thread
            self.error = exc

    @staticmethod
    def _message(n: int, rng: random.Random) -> Message:
        if n % 3 == 2:  # the wheel: arbitrary due times, off the levels' delays
            return Message("celery.test", {"n": n}, delay=timedelta(seconds=rng.uniform(1.5, 9.5)))
        return Message("celery.test", {"n": n}, delay_level=n % 3 + 1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[CeleryAirflow]:
    services = CeleryAirflow(tmp_path / "run", {})
    services.run_dir.mkdir()
    try:
        yield services
    finally:
        services.close()


def tries(meta: str) -> list[Try]:
    """Every try of every lane task (earlier tries from task_instance_history), by run order."""
    with psycopg.connect(meta) as conn:
        rows = conn.execute(
            """SELECT t.run_id, r.run_after, t.task_id, t.try_number, t.state, t.start_date, t.end_date
               FROM (SELECT dag_id, run_id, task_id, try_number, state, start_date, end_date FROM task_instance
                     UNION ALL
                     SELECT dag_id, run_id, task_id, try_number, state, start_date, end_date
                     FROM task_instance_history) t
               JOIN dag_run r USING (dag_id, run_id)
               WHERE t.dag_id = %s AND t.task_id = ANY(%s)
               ORDER BY r.run_after, t.task_id, t.try_number""",
            (DAG_ID, LANES),
        ).fetchall()
    return [Try(*row) for row in rows]


def runs_of(all_tries: list[Try]) -> list[str]:
    seen: dict[str, None] = {}
    for t in all_tries:
        seen.setdefault(t.run)
    return list(seen)


def holding(all_tries: list[Try], run: str) -> set[str]:
    return {t.task for t in all_tries if t.run == run and t.state == "running"}


def released(all_tries: list[Try], run: str) -> bool:
    """Every lane task of the run has started and none is running or waiting to run again."""
    mine = [t for t in all_tries if t.run == run]
    return {t.task for t in mine} == set(LANES) and all(
        t.start and t.state in ("success", "failed")
        for t in mine
        if t.try_number == max(u.try_number for u in mine if u.task == t.task)
    )


LANE = "CASE origin WHEN 'wheel' THEN 'wheel' ELSE 'level ' || level END"


def lateness(db_url: str, away_from: tuple[datetime, datetime] | None = None) -> dict[str, dict[str, Any]]:
    """Lateness per lane and overall ('all'), in seconds; with `away_from`, of messages due outside that window."""
    window = ("AND deliver_at NOT BETWEEN %s AND %s", away_from) if away_from else ("", ())
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            f"""SELECT coalesce({LANE}, 'all'), count(*), count(*) FILTER (WHERE delivered_at < deliver_at),
                       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)),
                       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM delivered_at - deliver_at)),
                       max(extract(epoch FROM delivered_at - deliver_at))
                FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel') {window[0]}
                GROUP BY ROLLUP ({LANE})""",
            window[1],
        ).fetchall()
    return {
        r[0]: {
            "n": r[1],
            "early": r[2],
            "p50": round(float(r[3]), 3),
            "p99": round(float(r[4]), 3),
            "max": round(float(r[5]), 3),
        }
        for r in rows
    }


def largest_gaps(db_url: str, since: datetime) -> dict[str, tuple[float, float]]:
    """Per lane, the longest time without a delivery (s) and when it began (s after `since`): at a third of the
    load per lane, deliveries come every 0.15 s while a lane is served."""
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            f"""SELECT DISTINCT ON (lane) lane, extract(epoch FROM gap), extract(epoch FROM previous - %s)
                FROM (SELECT {LANE} AS lane, delivered_at - lag(delivered_at) OVER w AS gap,
                             lag(delivered_at) OVER w AS previous
                      FROM delaywheel.topic_messages WHERE origin IN ('level', 'wheel')
                      WINDOW w AS (PARTITION BY {LANE} ORDER BY delivered_at)) g
                WHERE gap IS NOT NULL ORDER BY lane, gap DESC""",
            (since,),
        ).fetchall()
    return {r[0]: (round(float(r[1]), 1), round(float(r[2]), 1)) for r in rows}


def memory(cluster: CeleryAirflow, worker: str, task_pids: set[int]) -> dict[str, float]:
    """A worker's PSS (MiB): in all, and per running task (the task process and the pool process supervising it)."""
    parents = cluster.tree(worker)
    tasks = [pid for pid in parents if pid in task_pids]
    busy = tasks + [parents[pid] for pid in tasks]
    return {
        "tasks": len(tasks),
        "total_mib": round(pss_mib(list(parents))),
        "per_task_mib": round(pss_mib(busy) / len(tasks)) if tasks else 0.0,
    }


def test_two_celery_workers_hand_over_under_load_and_survive_a_killed_worker(
    tmp_path: Path, server_url: str, db_url: str, metadata_db: str, cluster: CeleryAirflow
) -> None:
    pytest.importorskip("airflow.providers.celery", reason="needs apache-airflow-providers-celery (docs/celery.md)")
    began = time.monotonic()
    dags = tmp_path / "dags"  # the deliver DAG alone: nothing else parsed or scheduled beside it
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "delaywheel_deliver.py", dags)
    broker = cluster.start_redis()
    (api_port,) = free_ports(1)
    cluster.env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {
        "DELAYWHEEL_DATABASE_URL": as_url(db_url),
        "DELAYWHEEL_AIRFLOW_HOME": str(tmp_path / "airflow"),
        "DELAYWHEEL_AIRFLOW_DB": metadata_db,
        "DELAYWHEEL_LEVELS": LEVELS,
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__DELAYWHEEL__DELIVER_LEASE_SECONDS": str(LEASE_S),
        "AIRFLOW__DELAYWHEEL__DELIVER_OVERLAP_SECONDS": str(OVERLAP_S),
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": broker,
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(CONCURRENCY),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": str(DETECTION_S),
    }
    meta = make_conninfo(server_url, dbname=metadata_db)
    cluster.run("db", "migrate")
    cluster.run("pools", "set", "delaywheel_deliver", str(2 * len(LANES)), "two runs' lanes during a hand-over")
    cluster.start("api-server", "api-server")
    cluster.start("dag-processor", "dag-processor")
    cluster.start("scheduler", "scheduler")
    for name in WORKERS:  # no log server: it would listen on every interface ([logging] has no host for it)
        cluster.start(name, "celery", "worker", "--celery-hostname", name, "--queues", "default", "--skip-serve-logs")

    worker_of: dict[tuple[str, str, int], str] = {}  # (run, task, try) -> the worker its process ran on
    task_pids: set[int] = set()  # of the lane tasks running at the last look

    def look() -> list[Try]:
        for name, proc in cluster.services.items():
            assert proc.poll() is None or name == killed, f"{name} exited: {cluster.log(name)}"
        with psycopg.connect(meta) as conn:
            running = conn.execute(
                "SELECT run_id, task_id, try_number, pid FROM task_instance WHERE dag_id = %s AND state = 'running'"
                " AND task_id = ANY(%s) AND pid IS NOT NULL",
                (DAG_ID, LANES),
            ).fetchall()
        task_pids.clear()
        for run, task, try_number, pid in running:
            task_pids.add(pid)
            if (owner := cluster.owner(pid)) is not None:
                worker_of.setdefault((run, task, try_number), owner)
        return tries(meta)

    def wait_for(what: str, done: Any, within: float) -> list[Try]:
        deadline = time.monotonic() + within
        while True:
            try:
                now = look()
            except psycopg.errors.UndefinedTable:  # not migrated yet
                now = []
            if done(now):
                return now
            assert load.error is None, load.error
            assert time.monotonic() < deadline, (what, now, {n: cluster.log(n, 1500) for n in cluster.services})
            time.sleep(1.0)

    killed = ""
    load = Load(db_url, Settings(levels=parse_levels(LEVELS)))
    wait_for(
        "the first run's lanes running",
        lambda ts: bool(ts) and holding(ts, runs_of(ts)[0]) == set(LANES),
        STARTED_WITHIN_S,
    )
    started_after = time.monotonic() - began
    listening = cluster.listening()
    assert listening and all(address.split(":")[0] in LOOPBACK for address in listening), listening
    sender = load.start()
    try:
        # The second run alone on every lane (the first handed over), then kill the worker holding most of it.
        def second_alone(ts: list[Try]) -> bool:
            runs = runs_of(ts)
            return len(runs) >= 2 and holding(ts, runs[1]) == set(LANES) and released(ts, runs[0])

        now = wait_for("the first hand-over", second_alone, LEASE_S + 3 * OVERLAP_S + TASK_START_S)
        run2 = runs_of(now)[1]
        time.sleep(3.0)
        look()
        on = {w: sorted(t for (r, t, _), o in worker_of.items() if r == run2 and o == w) for w in WORKERS}
        killed = max(WORKERS, key=lambda w: len(on[w]))
        survivor = next(w for w in WORKERS if w != killed)
        assert on[killed], ("no lane task of the second run found on a worker", worker_of)
        sizes = {w: memory(cluster, w, task_pids) for w in WORKERS}
        before_kill = {w: sum(1 for o in worker_of.values() if o == w) for w in WORKERS}
        kill_at = datetime.now(UTC)
        cluster.kill(killed)

        # Two more hand-overs, carried by the survivor: the fourth run on every lane, the third let go.
        def fourth_took_over(ts: list[Try]) -> bool:
            runs = runs_of(ts)
            return len(runs) >= 4 and holding(ts, runs[3]) == set(LANES) and released(ts, runs[2])

        wait_for("three hand-overs", fourth_took_over, 2 * LEASE_S + 3 * OVERLAP_S + DEAD_WORKER_GRACE_S)
    finally:
        load.stop.set()
        sender.join(timeout=30)
    assert load.error is None, load.error
    sent = set(load.ids)
    with psycopg.connect(db_url) as conn:  # drain: the last sends fall due within 10 s
        deadline = time.monotonic() + 60
        while (conn.execute("SELECT count(DISTINCT message_id) FROM delaywheel.topic_messages").fetchone() or [0])[
            0
        ] < len(sent) and time.monotonic() < deadline:
            time.sleep(1.0)
        delivered = [r[0] for r in conn.execute("SELECT message_id FROM delaywheel.topic_messages").fetchall()]
    final = look()
    runs = runs_of(final)
    figures = lateness(db_url)
    lane_of = {"deliver_level_1": "level 1", "deliver_level_2": "level 2", "advance_wheel": "wheel"}
    away = lateness(db_url, (kill_at, kill_at + timedelta(seconds=DEAD_WORKER_GRACE_S)))

    def started(run: str, task: str, try_number: int) -> float | None:
        when = next((t.start for t in final if (t.run, t.task, t.try_number) == (run, task, try_number)), None)
        return round((when - kill_at).total_seconds(), 1) if when else None

    gaps = largest_gaps(db_url, kill_at)
    recovery = {
        task: {"retry_started_s": started(run2, task, 2), "next_run_started_s": started(runs[2], task, 1)}
        for task in on[killed]
    }
    report = {
        "started_s": round(started_after),
        "total_s": round(time.monotonic() - began),
        "sent": len(sent),
        "runs": len(runs),
        "killed": killed,
        "killed_lanes": on[killed],
        "recovery_after_kill": recovery,
        "lane_tasks_per_worker_before_kill": before_kill,
        "lane_tasks_per_worker": {w: sum(1 for o in worker_of.values() if o == w) for w in WORKERS},
        "memory_before_kill": sizes,
        "not_successful_tries": sorted(
            (t.task, t.try_number, t.state) for t in final if t.state not in ("success", "running")
        ),
        "largest_gap_s_and_its_start_after_kill_s": gaps,
        "lateness_s": figures,
        "lateness_away_from_kill_s": away["all"],
    }
    print(f"\ncelery deliver run: {report}")

    assert len(delivered) == len(set(delivered)), "a message was delivered twice"
    assert sent <= set(delivered), f"{len(sent - set(delivered))} messages never delivered"
    assert set(figures) == {"all", "level 1", "level 2", "wheel"} and figures["all"]["early"] == 0, figures
    assert any(o == survivor and r not in runs[:2] for (r, _, _), o in worker_of.items()), worker_of
    for lane, f in figures.items():  # no lane unserved longer than a dead worker's grace
        assert f["max"] <= DEAD_WORKER_GRACE_S, (lane, report)
    assert set(gaps) == set(lane_of.values()) and all(gap <= DEAD_WORKER_GRACE_S for gap, _ in gaps.values()), report
    assert away["all"]["max"] <= STEADY_MAX_S, report  # the hand-overs themselves cost nothing
