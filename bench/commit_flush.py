"""What a durable commit costs on this machine, idle and beside busy loops, against a bare fdatasync of the same
size on the same filesystem, measured in the same run.

A cancel commits its cancellations durably (a lost one would let a message be delivered after its caller was told
`cancelled`), and beside two busy loops its p50 grew from ~2 ms to ~4 ms while its lookup did not (DESIGN, "Lookup
cost"). This asks where a commit's time goes there: a one-row INSERT committed under each `wal_sync_method`, with
`synchronous_commit = off` and a `SELECT 1` for the round trip, and, as the baseline, this process writing 8 kB to
a file in the cluster's filesystem and calling fdatasync, with a pause of a client's round trip between calls. With
`--stacks`, the backend's kernel stack is sampled while the commits run (`/proc/<pid>/stack`, root only) to name
where it sleeps. First, the durable commit on a backend with the server's CPU slice (the embedded cluster asks for a
short one: delaywheel.dev.sched) against one set back to the kernel's default, in ABBA blocks (root, or the server's
user): what decides, beside busy loops, whether the backend woken by its flush runs at once or at the next tick.

`--busy N` starts N `yes > /dev/null` loops for the run (the contract's background load) and stops them after.
The cluster's `wal_sync_method` is set with ALTER SYSTEM and reset at the end (a superuser's URL: `server_url`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from delaywheel.dev import sched

from .common import log, pct, server_url

DB = "delaywheel_commit_bench"
METHODS = ("fdatasync", "open_datasync", "fsync")


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    loops = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        time.sleep(0.5 if loops else 0)
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def bare_fdatasync(folder: Path, calls: int, pause_s: float) -> list[float]:
    """8 kB written into a 16 MB file (a WAL segment's size) two calls a page, then fdatasync: what the commit's flush
    would cost if the kernel did no more than that. Milliseconds per fdatasync."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix="commit_flush.") as f:
        fd = f.fileno()
        os.pwrite(fd, b"\0" * (16 << 20), 0)
        os.fsync(fd)
        page, times = b"x" * 8192, []
        for i in range(calls):
            time.sleep(pause_s)
            os.pwrite(fd, page, 8192 * (i // 2))
            started = time.perf_counter()
            os.fdatasync(fd)
            times.append(1000 * (time.perf_counter() - started))
    return times


@contextmanager
def sampling_stacks(pid: int, seen: collections.Counter[str], enabled: bool) -> Iterator[None]:
    """While the block runs, count the innermost kernel frames the backend is in, every millisecond ("(running)":
    nothing to read); root only. Off unless `enabled`: the sampler's wake-ups change the timings."""
    stop = threading.Event()

    def sample() -> None:
        path = Path(f"/proc/{pid}/stack")
        while not stop.wait(0.001):
            try:
                frames = [line.split("] ", 1)[-1].split("+")[0] for line in path.read_text().splitlines()[:3]]
            except OSError:  # not root, or gone
                return
            seen[" < ".join(frames) or "(running)"] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    if enabled:
        sampler.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            sampler.join()


def commits(conn: psycopg.Connection, statement: str, calls: int) -> list[float]:
    times = []
    for i in range(calls + 20):
        started = time.perf_counter()
        conn.execute(statement, prepare=True)
        if i >= 20:
            times.append(1000 * (time.perf_counter() - started))
    return times


def slice_against_default(conn: psycopg.Connection, insert: str, calls: int) -> dict[str, list[float]]:
    """The durable commit on `conn`, whose backend has the server's CPU slice (the embedded cluster asks for a short
    one: delaywheel.dev.sched), against the same on a backend set back to the kernel's default, in ABBA blocks."""
    with psycopg.connect(conn.info.dsn, autocommit=True) as plain:
        try:
            sched.set_slice(plain.info.backend_pid, 0)
        except PermissionError:  # another user's process: root, or the server's user
            log("the slice arms skipped: run as root or as the server's user")
            return {}
        slices = [(sched.slice_of(c.info.backend_pid) or 0) / 1e6 for c in (conn, plain)]
        names = [
            f"commit, backend at the server's CPU slice ({slices[0]:g} ms)",
            f"commit, backend at the kernel's default CPU slice ({slices[1]:g} ms)",
        ]
        times: dict[str, list[float]] = {name: [] for name in names}
        for block in (0, 1, 1, 0):  # ABBA: call by call, a backend waiting for its tick delayed the other's next call
            times[names[block]] += commits((conn, plain)[block], insert, calls // 2)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per arm")
    parser.add_argument("--busy", type=int, default=0, help="`yes > /dev/null` loops to run beside it")
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="sample the backend's kernel stack every millisecond (root only; the sampling thread's wake-ups change "
        "the timings: take figures from a run without it)",
    )
    args = parser.parse_args()
    started = datetime.now(UTC)
    server = server_url()
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DB)))
        data_dir = Path(conn.execute("SHOW data_directory").fetchone()[0])  # type: ignore[index]
    figures: dict[str, list[float]] = {}
    stacks: collections.Counter[str] = collections.Counter()
    try:
        with busy_loops(args.busy), psycopg.connect(make_conninfo(server, dbname=DB), autocommit=True) as conn:
            conn.execute("CREATE TABLE commit_flush (id bigserial PRIMARY KEY, v int)")
            insert = "INSERT INTO commit_flush (v) VALUES (1)"
            slice_arms = slice_against_default(conn, insert, args.calls)  # (the server's wal_sync_method)
            figures.update(slice_arms)
            for method in METHODS:
                conn.execute(sql.SQL("ALTER SYSTEM SET wal_sync_method = {}").format(sql.Literal(method)))
                conn.execute("SELECT pg_reload_conf()")
                time.sleep(0.3)
                with sampling_stacks(conn.info.backend_pid, stacks, args.stacks):
                    figures[f"commit, wal_sync_method={method}"] = commits(conn, insert, args.calls)
            conn.execute("SET synchronous_commit = off")
            figures["commit, synchronous_commit=off"] = commits(conn, insert, args.calls)
            figures["SELECT 1 (round trip)"] = commits(conn, "SELECT 1", args.calls)
            figures["bare fdatasync, same filesystem"] = bare_fdatasync(data_dir.parent, args.calls, 0.0002)
    finally:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET wal_sync_method")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
    baseline = statistics.median(figures["bare fdatasync, same filesystem"])
    durable = statistics.median(figures["commit, wal_sync_method=fdatasync"])
    notes = [
        f"{name}: p50 {statistics.median(v):.3f} ms, p90 {pct(v, 0.9):.3f} ms, p99 {pct(v, 0.99):.3f} ms"
        for name, v in figures.items()
    ]
    total = sum(stacks.values()) or 1
    notes += [
        f"backend's kernel stack during the commits: {n / total:.0%} {where}" for where, n in stacks.most_common(4)
    ]
    log(f"done ({args.busy} busy loops)")
    print(f"\n### A durable commit against a bare fdatasync, {args.busy} busy loops beside it\n")
    print(
        f"Command: `python -m bench.commit_flush --calls {args.calls} --busy {args.busy}{' --stacks' * args.stacks}` — "
        f"started {started:%Y-%m-%d %H:%M} UTC\n"
    )
    print(f"- durable commit p50 / bare fdatasync p50: {durable / baseline:.1f} x ({durable:.3f} / {baseline:.3f} ms)")
    if slice_arms:
        short, default = slice_arms.values()
        print(
            f"- durable commit p50 at the server's CPU slice / at the kernel's default: {statistics.median(short) / statistics.median(default):.2f} x"
        )
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
