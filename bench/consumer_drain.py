"""End-to-end drain by one consumer (issue 19): 1,000,000 due messages delivered and acked, against two baselines
measured in the same run on the same server.

(a) Delivery only: 1,000,000 due level-1 messages in the store, one `delaywheel deliver` process moves them into
    their topic; rate = messages / (last `delivered_at` - the moment the deliverer said it was ready).
(b) End to end: another 1,000,000 due messages, one `delaywheel deliver` process and one consumer process
    (`Store.consume`, batches of `--max-messages`, a handler that only looks at each message) waiting on the topic
    before the deliverer starts; rate = messages / (last ack committed - the deliverer ready).
(c) Raw drain: the rows (a) delivered, copied into a plain table keyed by their delivery order, drained by a loop of
    `DELETE FROM t WHERE id IN (SELECT id FROM t ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING *` (the
    queue-table idiom of PGMQ and its kind) with the same n, each batch read by the client (psycopg's fetchall).
    On a million-row table the planner, left to itself, joins the subquery's ids by hashing them against a
    sequential scan of the whole table, every batch (about ten times slower per batch here, and quadratic over the
    drain); the baseline runs with `enable_seqscan = off`, which gives the plan a queue table is meant to have:
    the ids from the primary key, each row deleted through it.

The messages are made due by an injected send clock (`send_many(now=…)` a minute in the past): the deliverer and the
consumer run on the real clock. Bodies are the benchmarks' ~90-byte bytes (common.body), not JSON: no body decode
on either side. Targets: (b) >= 0.8 x (a) and (b) >= 1.0 x (c).

    python -m bench consumer_drain [--scale 0.1] [--max-messages 1000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import resource
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from delaywheel import Message, Store
from delaywheel.dev.local_airflow import as_url

from .common import Check, at_least, body, chunks, drop_database, fresh_database, log, report, scaled

DB = "delaywheel_bench_drain"
TOPIC_DELIVERY = "bench.drain.delivery"
TOPIC_E2E = "bench.drain.e2e"
GROUP = "bench"
RAW_TABLE = "raw_drain"
RAW_DRAIN = (
    f"DELETE FROM {RAW_TABLE} WHERE id IN (SELECT id FROM {RAW_TABLE} ORDER BY id LIMIT %s"
    " FOR UPDATE SKIP LOCKED) RETURNING *"
)
_DELIVERED = re.compile(r"^delivered (\d+) ")


def load(store: Store, topic: str, count: int, batch: int) -> float:
    """`count` level-1 messages sent a minute ago by the injected clock, so all are due; returns seconds taken."""
    at = store.clock() - timedelta(minutes=1)
    started = time.perf_counter()
    for start, size in chunks(count, batch):
        store.send_many(
            [Message(topic, body(start + j), delay_level=1, key=f"drain-{start + j}") for j in range(size)], now=at
        )
    return time.perf_counter() - started


class Deliverer:
    """One `delaywheel deliver` process (every lane): when it said it was ready, and how many it has delivered (its
    progress lines, every 0.2 s)."""

    def __init__(self, url: str) -> None:
        env = {**os.environ, "DELAYWHEEL_DATABASE_URL": as_url(url)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", "30m", "--progress-every", "0.2"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ready_at = 0.0  # time.time() when the ready line was read
        self.delivered = 0
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(120):
            self.stop()
            raise RuntimeError("delaywheel deliver did not say it was ready within 120 s")

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "ready" in line and not self._ready.is_set():
                self.ready_at = time.time()
                self._ready.set()
            elif match := _DELIVERED.match(line):
                self.delivered = int(match.group(1))

    def wait_for(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.delivered < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"delivered {self.delivered:,} of {count:,}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def consumer(url: str, count: int, max_messages: int, ready: Any, out: Any) -> None:
    """The consumer process: `count` messages through `Store.consume`, then (time of the last ack, its totals,
    its CPU seconds)."""
    seen = 0

    def handler(messages: list) -> None:
        nonlocal seen
        for m in messages:  # look at each message, as a real handler would
            seen += len(m.body)

    with Store(url) as store:
        store.conn  # noqa: B018  (connected before the clock starts)
        ready.set()
        totals = store.consume(TOPIC_E2E, GROUP, handler, max_messages=max_messages, limit=count)
        finished = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.send((finished, vars(totals), usage.ru_utime + usage.ru_stime))


def last_delivery(conn: psycopg.Connection, topic: str) -> tuple[float, float, int]:
    """(first, last delivered_at as epoch seconds, rows) of a topic."""
    row = conn.execute(
        "SELECT extract(epoch FROM min(delivered_at)), extract(epoch FROM max(delivered_at)), count(*)"
        " FROM delaywheel.topic_messages WHERE topic = %s",
        (topic,),
    ).fetchone()
    assert row is not None
    return float(row[0]), float(row[1]), int(row[2])


def settle(conn: psycopg.Connection) -> None:
    """Between phases: dead rows vacuumed and dirty pages written, so no phase pays for the one before."""
    conn.execute("VACUUM (ANALYZE)")
    conn.execute("CHECKPOINT")


def delivery_only(url: str, store: Store, count: int, batch: int) -> tuple[float, float]:
    """(a): returns (rate, seconds from ready to the first delivery)."""
    log(f"(a) loading {count:,} due messages ({load(store, TOPIC_DELIVERY, count, batch):.1f} s)")
    settle(store.conn)
    deliverer = Deliverer(url)
    try:
        deliverer.wait_for(count, 600)
    finally:
        deliverer.stop()
    first, last, rows = last_delivery(store.conn, TOPIC_DELIVERY)
    if rows != count:
        raise RuntimeError(f"(a) the topic holds {rows:,} rows, expected {count:,}")
    seconds = last - deliverer.ready_at
    log(f"(a) delivery only: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    return count / seconds, first - deliverer.ready_at


def end_to_end(url: str, store: Store, count: int, batch: int, max_messages: int) -> dict[str, Any]:
    """(b): the consumer waits on the topic; the deliverer starts once everything is loaded."""
    log(f"(b) loading {count:,} due messages ({load(store, TOPIC_E2E, count, batch):.1f} s)")
    settle(store.conn)
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    proc = ctx.Process(target=consumer, args=(url, count, max_messages, ready, tx))
    proc.start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError("(b) the consumer did not start within 120 s")
    time.sleep(1.0)  # listening, and its first pull found nothing: it waits
    deliverer = Deliverer(url)
    try:
        if not rx.poll(900):
            raise RuntimeError("(b) the consumer did not finish within 900 s")
        finished, totals, cpu_s = rx.recv()
        proc.join(30)
    finally:
        deliverer.stop()
        if proc.is_alive():
            proc.kill()
    _, delivered_last, _ = last_delivery(store.conn, TOPIC_E2E)
    row = store.conn.execute(
        "SELECT acked FROM delaywheel.consumer_offsets WHERE grp = %s AND topic = %s", (GROUP, TOPIC_E2E)
    ).fetchone()
    acked = int(row[0]) if row else 0
    if totals["messages"] != count or acked != count:
        raise RuntimeError(f"(b) handled {totals['messages']:,}, acked {acked:,}, expected {count:,}")
    seconds = finished - deliverer.ready_at
    log(f"(b) end to end: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    return {
        "rate": count / seconds,
        "seconds": seconds,
        "delivery_seconds": delivered_last - deliverer.ready_at,
        "totals": totals,
        "cpu_s": cpu_s,
    }


def raw_drain(conn: psycopg.Connection, count: int, n: int) -> tuple[float, bool]:
    """(c): (a)'s rows in a plain table, drained n at a time by DELETE ... RETURNING, read by the client. Returns
    the rate and whether the planner, left to itself, would have read the whole table for every batch."""
    conn.execute(f"DROP TABLE IF EXISTS {RAW_TABLE}")  # type: ignore[arg-type]
    conn.execute(
        f"""CREATE TABLE {RAW_TABLE} AS
        SELECT row_number() OVER (ORDER BY xid, queue_offset) AS id, topic, queue_offset, message_id, key, tags,
               properties, body, is_json, reconsume_times, deliver_at, delivered_at
        FROM delaywheel.topic_messages WHERE topic = %s""",
        (TOPIC_DELIVERY,),
    )  # type: ignore[arg-type]
    conn.execute(f"ALTER TABLE {RAW_TABLE} ADD PRIMARY KEY (id)")  # type: ignore[arg-type]
    settle(conn)
    planned = conn.execute(f"EXPLAIN {RAW_DRAIN}", (n,)).fetchall()  # type: ignore[arg-type]
    conn.execute("SET enable_seqscan = off")  # the index plan (see the module docstring)
    drained = 0
    started = time.perf_counter()
    while True:
        rows = conn.execute(RAW_DRAIN, (n,)).fetchall()  # type: ignore[arg-type]
        if not rows:
            break
        drained += len(rows)
    seconds = time.perf_counter() - started
    conn.execute("RESET enable_seqscan")
    if drained != count:
        raise RuntimeError(f"(c) drained {drained:,}, expected {count:,}")
    log(f"(c) raw drain: {count:,} in {seconds:.2f} s = {count / seconds:,.0f} msg/s")
    return count / seconds, "Seq Scan" in "".join(r[0] for r in planned)


def run(args: argparse.Namespace) -> tuple[list[Check], list[str]]:
    count = scaled(1_000_000, args.scale)
    url = fresh_database(DB)
    load_before = os.getloadavg()
    with Store(url) as store:
        store.prepare()
        delivery, first_s = delivery_only(url, store, count, args.batch)
        raw, seq_planned = raw_drain(store.conn, count, args.max_messages)
        e2e = end_to_end(url, store, count, args.batch, args.max_messages)
    load_after = os.getloadavg()
    drop_database(DB)
    totals = e2e["totals"]
    checks = [
        at_least("end-to-end drain vs delivery only (msg/s)", e2e["rate"], delivery, 0.8),
        at_least("end-to-end drain vs raw DELETE ... RETURNING drain (msg/s)", e2e["rate"], raw, 1.0),
    ]
    notes = [
        f"{count:,} due level-1 messages per phase (~90-byte bytes bodies, a key each), sent by `send_many` with the"
        f" clock injected a minute back; one `delaywheel deliver` process (every lane) from its ready line",
        f"(a) delivery only {delivery:,.0f} msg/s (first delivery {first_s:.2f} s after ready)",
        f"(b) end to end {e2e['rate']:,.0f} msg/s: last ack {e2e['seconds']:.2f} s after ready, last delivery"
        f" {e2e['delivery_seconds']:.2f} s after ready (delivery beside the consumer:"
        f" {count / e2e['delivery_seconds']:,.0f} msg/s); one `Store.consume` process, max_messages"
        f" {args.max_messages}: {totals['batches']:,} batches, {totals['empty_pulls']:,} empty pulls,"
        f" {totals['notified_wakes']:,} notified wakes, {totals['safety_wakes']} safety wakes;"
        f" consumer CPU {e2e['cpu_s']:.1f} s ({e2e['cpu_s'] / count * 1e6:.1f} µs a message)",
        f"(c) raw drain {raw:,.0f} msg/s: `{RAW_DRAIN % args.max_messages}`, autocommit, fetchall, the same rows;"
        f" planned with enable_seqscan off (a nested loop over the primary key)"
        + (
            "; left to itself the planner chose a hash semi join over a sequential scan of the whole table for every"
            " batch"
            if seq_planned
            else ""
        ),
        f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (2 cores shared)"
        + (f"; {args.note}" if args.note else ""),
    ]
    return checks, notes


def main(argv: list[str] | None = None, name: str = "consumer_drain") -> list[Check]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the message count (1.0 = 1,000,000)")
    parser.add_argument("--batch", type=int, default=20_000, help="messages per send_many when loading")
    parser.add_argument(
        "--max-messages", type=int, default=1000, help="the consumer's batch (max_messages) and the raw drain's LIMIT"
    )
    parser.add_argument("--note", default="", help="a note for the results (e.g. the background load)")
    args = parser.parse_args(argv)
    started = datetime.now(UTC)
    checks, notes = run(args)
    report(name, "End-to-end drain by one consumer", checks, notes, started, argv)
    return checks
