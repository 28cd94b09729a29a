"""One SparkSession (local mode) for the whole test run: starting Spark costs tens of seconds here.
The jobs in spark/ are scripts, so their folder goes on sys.path and they are imported by module name.
`spark_cluster`: a standalone Spark cluster on loopback, for jobs submitted by spark-submit."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SPARK_DIR, SPARK_HOME, SparkCluster, free_ports

sys.path.insert(0, str(SPARK_DIR))
os.environ.setdefault("DELAYWHEEL_SHUFFLE_PARTITIONS", "2")
MASTER, WORKER = "org.apache.spark.deploy.master.Master", "org.apache.spark.deploy.worker.Worker"


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    import sparkjob

    os.environ.setdefault("DELAYWHEEL_SPARK_MASTER", "local[2]")
    session = sparkjob.session("delaywheel tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    # py4j logs "Closing down clientserver connection" from __del__ at exit, after pytest closed its streams
    logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A master and two workers (1 core and 1 GB each: one executor of Spark's default size) on 127.0.0.1, started
    as the pip `pyspark` allows (spark-daemon.sh), their logs, pid files and work folders in a temporary folder;
    stopped whatever the tests did, with no JVM of theirs left. Their PATH starts with a `python3` that has only
    the standard library, and no PYSPARK_* variable is set, as on a host whose default Python is not the jobs':
    a job run there must choose its driver's and executors' Python itself."""
    root = tmp_path_factory.mktemp("spark-cluster")
    bare = root / "bin" / "python3"
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')  # -S: no site-packages
    bare.chmod(0o755)
    venv_bin = Path(sys.executable).parent
    path = [str(bare.parent), *(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != venv_bin)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "DELAYWHEEL_SPARK_"))} | {
        "PATH": os.pathsep.join(path),
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_PID_DIR": str(root / "pids"),
        "SPARK_IDENT_STRING": "dwtest",
    }
    port, ui, *worker_uis = free_ports(4)
    master = f"spark://127.0.0.1:{port}"
    cluster = SparkCluster(master, f"http://127.0.0.1:{ui}", env)

    def daemon(action: str, role: str, n: int, *args: str) -> None:
        subprocess.run(
            ["bash", str(SPARK_HOME / "sbin" / "spark-daemon.sh"), action, role, str(n), *args],
            env=env,
            check=action == "start",
            capture_output=True,
        )

    try:
        daemon("start", MASTER, 1, "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui))
        for n, worker_ui in enumerate(worker_uis, start=1):
            daemon(
                "start",
                WORKER,
                n,
                master,
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(worker_ui),
                "--work-dir",
                str(root / f"work{n}"),
            )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{cluster.ui}/json/", timeout=5) as page:
                    if json.load(page)["aliveworkers"] == 2:
                        break
            except OSError:  # the master's UI is not up yet
                pass
            assert time.monotonic() < deadline, f"the workers did not register; logs in {root / 'logs'}"
            time.sleep(1)
        yield cluster
    finally:
        pids = [int(f.read_text()) for f in (root / "pids").glob("*.pid")]  # stop removes the files
        for n in range(len(worker_uis), 0, -1):
            daemon("stop", WORKER, n)
        daemon("stop", MASTER, 1)
        deadline = time.monotonic() + 30  # stop sends SIGTERM and does not wait
        while (left := [pid for pid in pids if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        masters = subprocess.run(["pgrep", "-af", "deploy.master"], capture_output=True, text=True).stdout
        assert not left and f"--port {port} " not in masters, f"Spark daemons outlived stop: {left}"
