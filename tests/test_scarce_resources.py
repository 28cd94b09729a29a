"""A server short of a resource (SQLSTATE class 53) is transient: the delivery loop and a consumer wait, log why and
go on once the resource is back, instead of ending. A full disk (a tablespace on a small tmpfs) refuses a pass with
53100; a full lock table (a session taking advisory locks until none is left) refuses a consumer's pull with 53200.

A throwaway cluster of their own (a temporary folder, a free port): the shared one is never filled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.consume.topics import Delivered
from delaywheel.deliver import runner
from delaywheel.dev import embedded

pytestmark = pytest.mark.timeout(180)


def _waiting_for(
    records: list[logging.LogRecord], text: str, thread: threading.Thread, out: dict[str, object], seconds: float = 30.0
) -> logging.LogRecord:
    """The first record logging `text`, while `thread` (the loop) lives; fails if it ends first (with `out`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = [r for r in records if text in r.getMessage()]
        if found:
            return found[0]
        assert thread.is_alive(), f"the loop ended: {out}"
        time.sleep(0.1)
    pytest.fail(f"nothing logged {text!r} in {seconds:.0f} s")


def _count(url: str, topic: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM delaywheel.topic_messages WHERE topic = %s", (topic,)).fetchone()
        assert row is not None
        return int(row[0])


@contextlib.contextmanager
def _small_disk(cluster: embedded.Cluster) -> Iterator[Path]:
    """The store's database moved onto a tablespace of its own, on a tmpfs a few MB larger than it; yields the
    mount point (fill it to make the disk full). The database goes back to the default tablespace afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = cluster.root / "small"
    mount.mkdir()
    with psycopg.connect(cluster.admin_url("delaywheel")) as conn:
        size = int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])  # type: ignore[index]
    mb = size // 2**20 + 24
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        owner = cluster.data_dir.stat()
        os.chown(mount, owner.st_uid, owner.st_gid)
        with psycopg.connect(cluster.admin_url(), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE TABLESPACE small LOCATION {}").format(sql.Literal(str(mount))))
            admin.execute("ALTER DATABASE delaywheel SET TABLESPACE small")
        try:
            yield mount
        finally:
            with psycopg.connect(cluster.admin_url(), autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = 'delaywheel' AND pid <> pg_backend_pid()"
                )
                time.sleep(0.5)
                admin.execute("ALTER DATABASE delaywheel SET TABLESPACE pg_default")
                admin.execute("DROP TABLESPACE small")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path) -> Path:
    """Write a file until the filesystem has no byte left; returns it (remove it to free the space)."""
    filler = mount / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (2**20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    return filler


@contextlib.contextmanager
def _full_lock_table(cluster: embedded.Cluster) -> Iterator[None]:
    """A session holding advisory locks until the server's lock table has no room left (53200, out of shared memory,
    for any statement that needs one more); they are freed when the block ends (the session with them)."""
    with psycopg.connect(cluster.admin_url("delaywheel"), autocommit=True) as hog:
        with pytest.raises(psycopg.errors.OutOfMemory):  # session locks stay held after the error
            hog.execute("SELECT count(pg_advisory_lock(0, n)) FROM generate_series(1, 10000000) n")
        try:
            yield
        finally:
            hog.execute("SELECT pg_advisory_unlock_all()")  # at once, not when the closed session's backend exits


def test_the_delivery_loop_waits_out_a_full_disk(
    own_cluster: embedded.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass refused with 53100 (disk full: no room for the rows it copies into the topic) did nothing; the loop
    logs why, waits and tries again, and delivers everything once there is room."""
    url, topic = own_cluster.url(), "scarce.disk"
    out: dict[str, object] = {}
    stop = threading.Event()
    with _small_disk(own_cluster) as mount:
        with Store(url) as store:
            store.send_many([Message(topic, {"n": n, "pad": "x" * 1000}, delay_level=1) for n in range(300)])
        filler = _fill(mount)

        def deliver() -> None:
            try:
                with Store(url) as own:
                    out["totals"] = runner.run(own, [1], 120, stop=stop)
            except BaseException as exc:  # the test fails below, with this
                out["error"] = exc

        thread = threading.Thread(target=deliver, name="deliverer")
        with caplog.at_level(logging.WARNING, logger="delaywheel.deliver.runner"):
            thread.start()
            try:
                record = _waiting_for(caplog.records, "short of a resource", thread, out)
                assert "53100" in record.getMessage(), record.getMessage()
                time.sleep(1.0)  # a retry or two, still refused
                assert thread.is_alive(), f"the delivery loop ended: {out}"
                assert _count(url, topic) == 0
                filler.unlink()  # room again
                deadline = time.monotonic() + 30
                while _count(url, topic) < 300 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert thread.is_alive(), f"the delivery loop ended: {out}"
            finally:
                stop.set()
                thread.join(timeout=30)
    assert "error" not in out, out.get("error")
    totals = out["totals"]
    assert isinstance(totals, runner.RunTotals)
    assert totals.delivered == 300 and totals.short_of_resources >= 1
    assert _count(url, topic) == 300


def test_a_consumer_waits_out_a_full_lock_table(
    own_cluster: embedded.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A pull refused with 53200 (out of shared memory: the lock table is full) ends nothing: the consumer logs why,
    backs off, and handles the next message once the locks are free again."""
    url, topic = own_cluster.url(), "scarce.locks"
    handled: list[int] = []
    out: dict[str, object] = {}
    stop = threading.Event()

    def handler(messages: list[Delivered]) -> None:
        handled.extend(m.message_id for m in messages)

    def consume() -> None:
        try:
            with Store(url) as own:
                out["totals"] = own.consume(topic, "scarce", handler, stop=stop, safety_wake_s=0.2)
        except BaseException as exc:  # the test fails below, with this
            out["error"] = exc

    thread = threading.Thread(target=consume, name="consumer")
    with caplog.at_level(logging.WARNING, logger="delaywheel.consume.consumer"):
        thread.start()
        try:
            with Store(url) as store:
                first = store.send(topic, {"n": 1})  # no delay: straight into the topic
                deadline = time.monotonic() + 15
                while first not in handled and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert handled == [first]
                time.sleep(0.5)  # idle past a safety wake
                with _full_lock_table(own_cluster):
                    record = _waiting_for(caplog.records, "short of a resource", thread, out)
                    assert "53200" in record.getMessage(), record.getMessage()
                    time.sleep(1.0)
                    assert thread.is_alive(), f"the consumer ended: {out}"
                # the locks are free again
                second = store.send(topic, {"n": 2})
                deadline = time.monotonic() + 20
                while second not in handled and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert thread.is_alive(), f"the consumer ended: {out}"
                assert handled == [first, second]
        finally:
            stop.set()
            thread.join(timeout=30)
    assert "error" not in out, out.get("error")


@pytest.mark.airflow
def test_the_due_trigger_waits_out_a_full_lock_table(
    own_cluster: embedded.Cluster, airflow_db: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trigger's look at the wheel's head refused with 53200 is no error event (which would fail the sensor's
    task): it backs off, reconnects, and fires once a message is due after the locks are free."""
    import asyncio

    from delaywheel.airflow.triggers import DueMessagesTrigger
    from delaywheel.dev.local_airflow import as_url

    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_DEFAULT", as_url(own_cluster.url()))

    async def go() -> dict[str, object]:
        due = DueMessagesTrigger(poll_interval=0.2).run()
        event = asyncio.ensure_future(due.__anext__())
        await asyncio.sleep(1.5)  # looking every 0.2 s
        with _full_lock_table(own_cluster):
            await asyncio.sleep(3.0)  # a dozen looks refused
            assert not event.done(), event.result().payload
        with Store(own_cluster.url()) as store:
            await asyncio.to_thread(store.send, "scarce.trigger", {"n": 1}, delay=timedelta(seconds=1))
        fired = await asyncio.wait_for(event, 30)
        await due.aclose()  # type: ignore[attr-defined]
        return dict(fired.payload)

    payload = asyncio.run(go())
    assert payload["status"] == "success" and payload["lane"] == "wheel", payload
