"""Airflow on the CeleryExecutor with a throwaway Redis, all on loopback, for tests/airflow/test_celery.py.

Every Airflow service runs through `scripts/airflow.sh <command>` (what docs/celery.md tells a user to run: the
project's airflow.cfg, the secrets generated into AIRFLOW_HOME, the store's connection), each in a session of its
own and in a working directory of its own under one run directory. That gives a worker a whole identity: a task
process is a worker's by its working directory (Airflow records the task's pid), and killing a worker kills the
session and everything in its directory at once, as losing the machine would. At the end every process in a
session or a directory of the run is killed, so nothing outlives the test, whatever failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

from tests.conftest import free_ports
from tests.dev.test_airflow_script import processes

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "airflow.sh"


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
