"""The CPU slice the embedded cluster's processes ask for (`delaywheel.dev.sched`), read back from the kernel's own
account of each process (`/proc/<pid>/sched`), on a cluster of the test's own."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from delaywheel.dev import embedded, sched
from tests.conftest import free_ports

pytestmark = pytest.mark.timeout(120)


def kernel_slice(pid: int | str = "self") -> int | None:
    """The slice the kernel keeps for `pid`, in ns (None on a kernel that shows none)."""
    for line in Path(f"/proc/{pid}/sched").read_text().splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


DEFAULT = kernel_slice()
release = tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit())
needs_custom_slices = pytest.mark.skipif(
    DEFAULT is None or release < (6, 12), reason="tasks may ask for their own slice from Linux 6.12"
)


@pytest.fixture
def own_cluster() -> Iterator[embedded.Cluster]:
    root = Path(tempfile.mkdtemp(prefix="delaywheel-slice-", dir="/var/tmp"))
    root.chmod(0o755)  # the postgres user (we may be root) must reach it
    cluster = embedded.Cluster(root=root, port=free_ports(1)[0])
    try:
        yield cluster
    finally:
        embedded.stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


def server_slices(cluster: embedded.Cluster) -> dict[str, int | None]:
    """The slices of the postmaster, of the processes it started with it, and of a backend forked for a new
    connection."""
    postmaster = int((cluster.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    with psycopg.connect(cluster.admin_url()) as conn:
        backend = conn.info.backend_pid
        slices: dict[str, int | None] = {"postmaster": kernel_slice(postmaster), "backend": kernel_slice(backend)}
    for pid in children:
        with contextlib.suppress(FileNotFoundError):  # (a child that has exited since: a backend's, a worker)
            slices[f"child {pid}"] = kernel_slice(pid)
    return slices


@needs_custom_slices
def test_the_clusters_processes_ask_for_a_short_slice_and_the_starter_does_not_keep_it(
    own_cluster: embedded.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(embedded.SLICE_ENV, raising=False)
    embedded.start(own_cluster)
    slices = server_slices(own_cluster)
    assert len(slices) >= 5  # the checkpointer, the WAL writer, ... beside the postmaster and the backend
    assert set(slices.values()) == {embedded.DEFAULT_SLICE_US * 1000}, slices
    assert embedded.cpu_slice_ms(own_cluster) == embedded.DEFAULT_SLICE_US / 1000
    assert kernel_slice(f"self/task/{threading.get_native_id()}") == DEFAULT  # the thread that started it went back

    embedded.stop(own_cluster)
    monkeypatch.setenv(embedded.SLICE_ENV, "0")  # the kernel's default
    embedded.start(own_cluster)
    assert set(server_slices(own_cluster).values()) == {DEFAULT}

    embedded.stop(own_cluster)
    monkeypatch.setenv(embedded.SLICE_ENV, "2000")
    embedded.start(own_cluster)
    assert set(server_slices(own_cluster).values()) == {2_000_000}


@needs_custom_slices
def test_a_process_started_inside_inherits_the_slice_and_keeps_it() -> None:
    with sched.slice_for_children(700_000):
        assert kernel_slice(f"self/task/{threading.get_native_id()}") == 700_000
        child = subprocess.Popen(["sleep", "30"])
    try:
        assert kernel_slice(child.pid) == 700_000
        assert kernel_slice(f"self/task/{threading.get_native_id()}") == DEFAULT
        assert sched.slice_of(child.pid) == 700_000  # what `db status` reads
    finally:
        child.kill()
        child.wait()
    with sched.slice_for_children(0):  # nothing asked
        assert kernel_slice(f"self/task/{threading.get_native_id()}") == DEFAULT


@pytest.mark.parametrize("text", ["abc", "-1", "50", "100001", "0.5", "1e3"])
def test_a_slice_the_kernel_cannot_take_is_refused_with_a_reason(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(embedded.SLICE_ENV, text)
    with pytest.raises(embedded.EmbeddedError, match=r"DELAYWHEEL_PG_SLICE_US must be 0 .* or 100-100000 micro"):
        embedded.server_slice_ns()


def test_the_cli_refuses_a_bad_slice_without_a_traceback(own_cluster: embedded.Cluster) -> None:
    env = os.environ | {
        embedded.SLICE_ENV: "50",
        "DELAYWHEEL_PG_DIR": str(own_cluster.root),
        "DELAYWHEEL_PG_PORT": str(own_cluster.port),
    }
    env.pop("DELAYWHEEL_DATABASE_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "delaywheel.cli", "db", "start"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "DELAYWHEEL_PG_SLICE_US must be 0 (the kernel's default slice) or 100-100000 microseconds" in result.stderr
    assert embedded.status(own_cluster) == "absent"  # refused before anything was made
