"""Timing-wheel benchmark (issue 3), measured in one run on one server.

1. Enqueue with random due times (1 s - 30 days) via send_many vs a raw binary COPY of the same columns into a
   plain table, interleaved batch by batch, after one untimed batch each (the store's first creates its
   partitions, as the raw table was created before timing).
2. Burst on the real clock: 500k messages due in the same second, scheduled ahead, delivered by the advance
   loop (`delaywheel.deliver.runner.run`); lateness from topic_messages; the same rows then moved raw in batches.
3. Delivery rate on an (almost) empty store, injected clock.
4. 10M pending (due 4 h - 30 days ahead) in the wheel and in the naive design (bench/naive.py).
5. With 10M pending: enqueue, ours vs naive vs an empty store in a second database, interleaved (flat enqueue
   compares the loaded store with that empty one, in the same minutes); delivery, ours vs naive vs that empty
   store, interleaved pass by pass (flat delivery compares the loaded store with the empty one; step 3's figure,
   minutes earlier, moved by half between runs); single cancels by key of near and far timers (latency).
6. A full cycle on top of the 10M pending: 1M messages due within one hour enqueued in both, all delivered,
   ours retired, the naive one after its deletes, plain VACUUM on both; table sizes before and after.
"""

from __future__ import annotations

import random
import statistics
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.deliver import runner
from delaywheel.ops.stats import LATENESS_P50_P99
from delaywheel.partitions import HOUR, floor_to
from delaywheel.pending import not_cancelled
from delaywheel.produce.producer import SEGMENT_MAX

from . import naive
from .common import (
    Check,
    Stopwatch,
    at_least,
    body,
    chunks,
    copy_rows,
    drop_database,
    flat,
    fresh_database,
    log,
    mib,
    parse_args,
    print_section,
    scaled,
    smaller,
    table_bytes,
)

TOPIC = "bench.timers"
BURST_TOPIC = "bench.burst"
EMPTY_DB = "delaywheel_bench_empty"
MAX_DELAY_S = 30 * 86400
WHEEL_COLUMNS = ("id", "topic", "key", "tags", "properties", "body", "is_json", "deliver_at", "enqueued_at")
WHEEL_TYPES = ["int8", "text", "text", "text", "jsonb", "bytea", "bool", "timestamptz", "timestamptz"]
RAW_TABLE = """CREATE TABLE {name} (id bigint, topic text, key text, tags text, properties jsonb, body bytea,
    is_json boolean, deliver_at timestamptz, enqueued_at timestamptz)"""
RAW_MOVE = """WITH m AS (DELETE FROM raw_src WHERE id IN (SELECT id FROM raw_src ORDER BY id LIMIT %s) RETURNING *)
    INSERT INTO raw_dst SELECT * FROM m"""


def _delays(rng: random.Random, size: int) -> list[timedelta]:
    return [timedelta(seconds=rng.uniform(1, MAX_DELAY_S)) for _ in range(size)]


def enqueue_vs_copy(
    store: Store,
    other: psycopg.Connection,
    count: int,
    batch: int,
    seed: int,
    baseline: str,
    empty: Store | None = None,
) -> dict[str, float]:
    """Rates enqueueing the same random-time messages, interleaved batch by batch (the order rotating): "ours",
    the baseline ('raw' COPY or 'naive'), and, if given, a second, empty store ("empty")."""
    rng = random.Random(seed)
    watches = {"ours": Stopwatch(), baseline: Stopwatch(), **({"empty": Stopwatch()} if empty else {})}
    sides = list(watches)
    for n, (start, size) in enumerate(chunks(count, batch)):
        delays = _delays(rng, size)
        key = f"{baseline}{seed}"
        messages = [
            Message(TOPIC, body(start + j), delay=d, key=f"{key}-{start + j}", tags="created")
            for j, d in enumerate(delays)
        ]
        now = datetime.now(UTC)
        rows = [
            (TOPIC, f"{key}-{start + j}", "created", None, body(start + j), False, now + d, now)
            for j, d in enumerate(delays)
        ]
        for side in sides[n % len(sides) :] + sides[: n % len(sides)]:
            with watches[side].run(size):
                if side == "ours":
                    store.send_many(messages)
                elif side == "empty":
                    empty.send_many(messages)  # type: ignore[union-attr]
                elif side == "naive":
                    naive.enqueue(other, rows)
                else:
                    with other.transaction():
                        copy_rows(
                            other,
                            "raw_copy",
                            WHEEL_COLUMNS,
                            WHEEL_TYPES,
                            ((10**12 + start + j, *r) for j, r in enumerate(rows)),
                        )
    return {side: watch.rate for side, watch in watches.items()}


def burst(store: Store, url: str, count: int, batch: int, enqueue_rate: float) -> tuple[dict[str, float], list[str]]:
    """`count` messages due in the same second on the real clock, delivered by the advance loop."""
    lead = 15 + 1.5 * count / enqueue_rate
    due = floor_to(store.clock() + timedelta(seconds=lead), timedelta(seconds=1))
    for start, size in chunks(count, batch):
        store.send_many(
            [Message(BURST_TOPIC, body(start + j), deliver_at=due, key=f"burst-{start + j}") for j in range(size)]
        )
    margin = (due - store.clock()).total_seconds()
    stop = threading.Event()
    with psycopg.connect(url, autocommit=True) as watcher:

        def progress(totals: runner.RunTotals) -> None:
            if totals.delivered >= count:
                row = watcher.execute(
                    "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = %s", (BURST_TOPIC,)
                ).fetchone()
                if row and row[0] >= count:
                    stop.set()

        totals = runner.run(store, [None], margin + 900, stop=stop, progress=progress, progress_every_s=0.5)
        row = watcher.execute(
            sql.SQL(
                """
            SELECT count(*), count(DISTINCT message_id), count(*) FILTER (WHERE delivered_at < deliver_at),
                   count(*) FILTER (WHERE delivered_at - deliver_at <= interval '1 second'),
                   count(*) FILTER (WHERE delivered_at - deliver_at <= interval '5 seconds'),
                   count(*) FILTER (WHERE delivered_at - deliver_at <= interval '30 seconds'),
                   extract(epoch FROM max(delivered_at) - %(due)s), extract(epoch FROM max(delivered_at) - min(delivered_at)),
                   {p50_p99}
            FROM delaywheel.topic_messages WHERE topic = %(topic)s
            """
            ).format(p50_p99=LATENESS_P50_P99),
            {"due": due, "topic": BURST_TOPIC},
        ).fetchone()
    assert row is not None
    delivered, distinct, early, in1, in5, in30, span_due, span_first, (p50, p99) = row
    if delivered != count or distinct != count or early:
        raise RuntimeError(f"burst: delivered {delivered}, distinct {distinct}, early {early} of {count}")
    figures = {"rate": count / float(span_due), "drain_rate": count / max(float(span_first), 1e-3)}
    notes = [
        f"burst: {count:,} due at the same instant, sent {margin:.1f} s ahead of due (lead {lead:.0f} s); "
        f"delivered exactly once each, none early, by the advance loop in {totals.passes} passes",
        f"burst lateness: within 1 s {in1:,} ({100 * in1 / count:.1f} %), within 5 s {in5:,} "
        f"({100 * in5 / count:.1f} %), within 30 s {in30:,} ({100 * in30 / count:.1f} %); p50 {p50:.2f} s, "
        f"p99 {p99:.2f} s; last one {float(span_due):.2f} s after due (RocketMQ 5.x: ~4 % on time)",
        f"burst rate: {figures['rate']:,.0f} msg/s from due to last delivery; "
        f"{figures['drain_rate']:,.0f} msg/s from first to last delivery",
    ]
    return figures, notes


def raw_move(conn: psycopg.Connection, source_sql: str, params: tuple, batch: int) -> float:
    """The raw baseline: the same rows in a plain table with a primary key, moved in batches."""
    conn.execute("DROP TABLE IF EXISTS raw_src, raw_dst")
    conn.execute(RAW_TABLE.format(name="raw_src"))
    conn.execute(f"INSERT INTO raw_src SELECT {', '.join(WHEEL_COLUMNS)} FROM ({source_sql}) s", params)  # type: ignore[arg-type]
    conn.execute("ALTER TABLE raw_src ADD PRIMARY KEY (id)")
    conn.execute(RAW_TABLE.format(name="raw_dst"))
    conn.execute("ANALYZE raw_src")
    watch = Stopwatch()
    while True:
        with watch.run():
            moved = conn.execute(RAW_MOVE, (batch,)).rowcount
        watch.count += moved
        if not moved:
            return watch.rate


class WheelDrain:
    """Advances the wheel with an injected clock until a pass finds nothing more due."""

    def __init__(self, store: Store, now: datetime, expected: int) -> None:
        self.store, self.now, self.expected = store, now, expected
        self.delivered = 0
        self.idle = False
        self.watch = Stopwatch()

    def step(self) -> None:
        with self.watch.run():
            result = self.store.advance_wheel(now=self.now)
        self.delivered += result.delivered
        self.watch.count += result.delivered
        if not result.more:
            if self.delivered >= self.expected:
                self.idle = True
            else:
                time.sleep(0.02)  # another transaction holds the commit horizon (untimed)


def drain_all(
    stores: list[Store], other: psycopg.Connection, now: datetime, expected: int
) -> tuple[list[Stopwatch], Stopwatch]:
    """Deliver everything due by `now` in each of our stores and in the naive design, interleaved pass by pass, so
    all see the same load; returns each store's stopwatch and the naive one."""
    drains = [WheelDrain(store, now, expected) for store in stores]
    naive_watch = Stopwatch()
    naive_idle = False
    while not (all(d.idle for d in drains) and naive_idle):
        for drain in drains:
            if not drain.idle:
                drain.step()
        if not naive_idle:
            with naive_watch.run():
                moved = naive.deliver(other, now, stores[0].settings.batch_size)
            naive_watch.count += moved
            naive_idle = moved == 0
    return [d.watch for d in drains], naive_watch


def send_due_at(store: Store, count: int, batch: int, due: datetime, prefix: str) -> None:
    for start, size in chunks(count, batch):
        store.send_many(
            [Message(TOPIC, body(start + j), deliver_at=due, key=f"{prefix}-{start + j}") for j in range(size)]
        )


def fill_pending(store: Store, count: int, first_due: datetime, span: timedelta, batch: int) -> None:
    """`count` pending wheel messages due uniformly in [first_due, first_due + span), sent by send_many in batches:
    near ones in the fine wheel, the rest in far segments with their key filters, as producers would leave them."""
    rng = random.Random(7)
    for start, size in chunks(count, batch):
        store.send_many(
            [
                Message(
                    "bench.backdrop",
                    body(0),
                    deliver_at=first_due + rng.random() * span,
                    key=f"backdrop-{start + j}",
                    tags="created",
                )
                for j in range(size)
            ]
        )


def cycle(
    store: Store, other: psycopg.Connection, count: int, batch: int, hour: datetime
) -> tuple[Stopwatch, Stopwatch]:
    """`count` messages due uniformly within [hour, hour + 1 h) in both designs, then everything due by the end of
    the hour delivered (ours and naive interleaved); returns both stopwatches."""
    rng = random.Random(3)
    for start, size in chunks(count, batch):
        due = [hour + timedelta(seconds=rng.uniform(0, 3599)) for _ in range(size)]
        store.send_many(
            [Message(TOPIC, body(start + j), deliver_at=d, key=f"cycle-{start + j}") for j, d in enumerate(due)]
        )
        naive.enqueue(
            other,
            ((TOPIC, f"cycle-{start + j}", None, None, body(start + j), False, d, hour) for j, d in enumerate(due)),
        )
    store.prepare(now=hour + HOUR)
    (ours,), naive_watch = drain_all([store], other, hour + HOUR, count)
    return ours, naive_watch


def cancel_latency(store: Store, other: psycopg.Connection, count: int) -> dict[str, tuple[float, float]]:
    """Single cancels by key of pending backdrop timers: near ones (B-tree on key) and far ones (far-block segments,
    migrations/012); (p50, max) in ms for each."""
    figures = {}
    samples = {
        "near": sql.SQL(
            "SELECT key FROM delaywheel.wheel w WHERE key LIKE 'backdrop-%%' AND {} ORDER BY random() LIMIT %s"
        ).format(not_cancelled("w")),
        # each far segment's first message, its due time as the timestamptz a cancellation holds
        "far": sql.SQL(
            "SELECT m.key FROM delaywheel.wheel_far_segments s,"
            " unnest(s.ids[1:1], s.keys[1:1], s.deliver_ats[1:1]) u(id, key, due),"
            " LATERAL (SELECT u.id, u.key, u.due AT TIME ZONE 'UTC' AS deliver_at) m"
            " WHERE m.key LIKE 'backdrop-%%' AND {} ORDER BY random() LIMIT %s"
        ).format(not_cancelled("m")),
    }
    for lane, sample in samples.items():
        keys = [k for (k,) in other.execute(sample, (count,))]  # type: ignore[arg-type]
        times = []
        for key in keys:
            started = time.perf_counter()
            if [r.outcome for r in store.cancel(key=key)] != ["cancelled"]:
                raise RuntimeError(f"cancel {key}: not cancelled")
            times.append(1000 * (time.perf_counter() - started))
        figures[lane] = (statistics.median(times), max(times))
    return figures


def sizes(conn: psycopg.Connection) -> dict[str, int]:
    return {
        "ours_queue": table_bytes(conn, "delaywheel.wheel") + table_bytes(conn, "delaywheel.wheel_far_segments"),
        "ours_topic": table_bytes(conn, "delaywheel.topic_messages"),
        "naive_queue": table_bytes(conn, "naive.queue"),
        "naive_topic": table_bytes(conn, "naive.topic"),
    }


def main() -> list[Check]:
    args = parse_args(__doc__ or "")
    started = datetime.now(UTC)
    url = fresh_database()
    n_enqueue, n_burst = scaled(500_000, args.scale), scaled(500_000, args.scale)
    n_deliver, n_pending = scaled(200_000, args.scale), scaled(10_000_000, args.scale)
    n_cycle = scaled(1_000_000, args.scale)
    batch_move = 5000
    checks: list[Check] = []
    notes: list[str] = []
    with Store(url) as store, psycopg.connect(url, autocommit=True) as other:
        naive.create(other)
        other.execute(RAW_TABLE.format(name="raw_copy"))
        store.prepare()
        real0 = store.clock()

        log(f"1. enqueue vs raw COPY: {n_enqueue} messages, random due 1 s - 30 d")
        # Untimed, as in 5a: the first batch creates the wheel's partitions (4-hour over the near window, daily
        # beyond it), once per store; the raw table was created before timing too.
        first = enqueue_vs_copy(store, other, args.batch, args.batch, 8, "raw")
        notes.append(
            f"step 1 follows one untimed batch of {args.batch:,} on each side, the empty store's first "
            f"(it creates the wheel's partitions): ours {first['ours']:,.0f} msg/s, raw COPY "
            f"{first['raw']:,.0f} msg/s"
        )
        rates = enqueue_vs_copy(store, other, n_enqueue, args.batch, 1, "raw")
        empty_enqueue, raw_copy = rates["ours"], rates["raw"]
        checks.append(at_least("wheel send_many vs raw COPY, random 1 s - 30 d (msg/s)", empty_enqueue, raw_copy, 0.5))
        log(f"   ours {empty_enqueue:,.0f} msg/s, raw COPY {raw_copy:,.0f} msg/s")

        log(f"2. burst: {n_burst} due in the same second, real clock")
        figures, burst_notes = burst(store, url, n_burst, args.batch, empty_enqueue)
        notes += burst_notes
        log("   " + "\n   ".join(burst_notes))
        log("2b. raw move of the burst rows")
        move_rate = raw_move(other, "SELECT * FROM delaywheel.wheel WHERE topic = %s", (BURST_TOPIC,), batch_move)
        checks.append(
            at_least("burst delivery (due to last) vs raw batched move (msg/s)", figures["rate"], move_rate, 0.5)
        )
        log(f"   raw move {move_rate:,.0f} msg/s")

        log(f"3. delivery on an almost empty store: {n_deliver} due at one instant, injected clock")
        x1 = real0 + HOUR
        send_due_at(store, n_deliver, args.batch, x1, "empty")
        store.prepare(now=x1)
        drain = WheelDrain(store, x1 + timedelta(seconds=1), n_deliver)
        while not drain.idle:
            drain.step()
        empty_deliver = drain.watch.rate
        log(f"   ours {empty_deliver:,.0f} msg/s ({drain.delivered} delivered)")

        log(f"4. filling {n_pending} pending in the wheel and in the naive table (due 4 h - 30 d)")
        filled = time.perf_counter()
        first_due, span = real0 + 4 * HOUR, timedelta(days=30) - 4 * HOUR
        fill_pending(store, n_pending, first_due, span, args.batch)
        naive.fill(other, n_pending, first_due, span, body(0))
        for table in ("naive.queue", "delaywheel.wheel", "delaywheel.wheel_far_segments"):  # settle after the bulk load
            other.execute(f"VACUUM (ANALYZE) {table}")  # type: ignore[arg-type]
        other.execute("CHECKPOINT")  # write the fill's dirty pages now, not while step 5 is being timed
        notes.append(
            f"pending backdrop: {n_pending:,} messages each in the wheel and the naive table, due 4 h - 30 d "
            f"(ours by send_many, naive by SQL INSERT ... SELECT, {time.perf_counter() - filled:.0f} s for both), then VACUUM (ANALYZE) and "
            "CHECKPOINT"
        )

        log(f"5a. with {n_pending} pending: enqueue ours vs naive vs an empty store (interleaved), {n_enqueue} each")
        x2 = real0 + 2 * HOUR
        with Store(fresh_database(EMPTY_DB)) as empty:
            empty.prepare()
            enqueue_vs_copy(empty, other, args.batch, args.batch, 9, "raw")  # untimed: its partitions and caches
            rates = enqueue_vs_copy(store, other, n_enqueue, args.batch, 2, "naive", empty)
            loaded_enqueue, naive_enqueue, empty_enqueue2 = rates["ours"], rates["naive"], rates["empty"]
            log(
                f"   ours {loaded_enqueue:,.0f} msg/s, naive {naive_enqueue:,.0f} msg/s, empty store {empty_enqueue2:,.0f} msg/s"
            )
            log(
                f"5b. with {n_pending} pending: delivery ours vs naive vs the empty store (interleaved), {n_deliver} due "
                "at one instant each"
            )
            for target in (store, empty):
                send_due_at(target, n_deliver, args.batch, x2, "loaded")
                target.prepare(now=x2)
            naive.enqueue(
                other, ((TOPIC, f"loaded-{i}", None, None, body(i), False, x2, real0) for i in range(n_deliver))
            )
            (ours_watch, empty_watch), naive_watch = drain_all(
                [store, empty], other, x2 + timedelta(seconds=1), n_deliver
            )
        drop_database(EMPTY_DB)
        loaded_deliver, empty_deliver2 = ours_watch.rate, empty_watch.rate
        log(
            f"   ours {loaded_deliver:,.0f} msg/s, naive {naive_watch.rate:,.0f} msg/s, empty store {empty_deliver2:,.0f} msg/s"
        )
        checks.append(
            flat(f"wheel enqueue rate, {n_pending:,} pending vs empty (msg/s)", loaded_enqueue, empty_enqueue2)
        )
        checks.append(
            flat(f"wheel delivery rate, {n_pending:,} pending vs empty (msg/s)", loaded_deliver, empty_deliver2)
        )
        checks.append(
            at_least(f"enqueue, {n_pending:,} pending: ours vs naive (msg/s)", loaded_enqueue, naive_enqueue, 1.0)
        )
        checks.append(
            at_least(f"delivery, {n_pending:,} pending: ours vs naive (msg/s)", loaded_deliver, naive_watch.rate, 1.0)
        )

        log("5c. with the backdrop pending: 20 single cancels by key each, near and far timers")
        cancels = cancel_latency(store, other, 20)
        log("   " + ", ".join(f"{lane} p50 {p50:.1f} ms, max {top:.1f} ms" for lane, (p50, top) in cancels.items()))
        summarized = store.summarize()  # what the delivery loop does every minute
        summarized_cancels = cancel_latency(store, other, 20)
        log(
            f"   after store.summarize() ({summarized} ranges): "
            + ", ".join(f"{lane} p50 {p50:.1f} ms, max {top:.1f} ms" for lane, (p50, top) in summarized_cancels.items())
        )

        log(f"6. full cycle: {n_cycle} messages due within one hour enqueued, delivered, retired / deleted")
        for table in ("delaywheel.wheel", "delaywheel.wheel_far_segments", "naive.queue"):
            other.execute(f"VACUUM {table}")  # type: ignore[arg-type]
        before = sizes(other)
        hour = floor_to(real0, HOUR) + 3 * HOUR  # after step 5's instant, before the backdrop's first due time
        ours_cycle, naive_cycle = cycle(store, other, n_cycle, args.batch, hour)
        retired = store.retire(now=hour + HOUR)
        for table in ("delaywheel.wheel", "delaywheel.wheel_far_segments", "naive.queue"):
            other.execute(f"VACUUM {table}")  # type: ignore[arg-type]
        after = sizes(other)
        checks.append(
            smaller(
                "queue tables' growth over the cycle (bytes)",
                after["ours_queue"] - before["ours_queue"],
                after["naive_queue"] - before["naive_queue"],
            )
        )
        checks.append(
            smaller(
                f"queue tables after the cycle, {n_pending:,} still pending (bytes)",
                after["ours_queue"],
                after["naive_queue"],
            )
        )
        notes += [
            f"with {n_pending:,} pending: enqueue ours {loaded_enqueue:,.0f} vs naive {naive_enqueue:,.0f} msg/s, and "
            f"{empty_enqueue2:,.0f} msg/s into an empty store in a second database (`{EMPTY_DB}`, warmed by one untimed "
            "batch), the three interleaved batch by batch: the flat check compares the first with the last; "
            f"delivery ours {loaded_deliver:,.0f} vs naive {naive_watch.rate:,.0f} msg/s vs {empty_deliver2:,.0f} msg/s "
            f"from the empty store (batches of {store.settings.batch_size}, the three interleaved pass by pass: the flat "
            "check compares the first with the last)",
            f"cycle delivery ({ours_cycle.count:,} ours / {naive_cycle.count:,} naive, incl. step 1/5 messages due "
            f"in that hour): ours {ours_cycle.rate:,.0f} msg/s, naive {naive_cycle.rate:,.0f} msg/s; "
            f"retire dropped {len(retired)} partitions",
            f"queue tables (heap + indexes) before the cycle, after VACUUM: ours {mib(before['ours_queue'])}, naive "
            f"{mib(before['naive_queue'])}; after the cycle (ours retired, naive deleted; plain VACUUM): ours "
            f"{mib(after['ours_queue'])}, naive {mib(after['naive_queue'])}; topic tables after: ours "
            f"{mib(after['ours_topic'])}, naive {mib(after['naive_topic'])}",
            f"indexes: wheel (deliver_at, id), xid, id, key; far blocks: one row per send call and far day (up to "
            f"{SEGMENT_MAX} timers, migrations/012) with a GiST index on its id range and a Bloom filter of its keys in the row; naive queue: primary key and deliver_at only (no key index, so no cancel by key); topic "
            "tables: ours 2 B-trees and a BRIN bloom on key (migrations/009), naive 1",
            f"single cancel by key with {n_pending:,} pending (20 each), right after the bulk deliveries above: near timer "
            f"p50 {cancels['near'][0]:.1f} ms, max {cancels['near'][1]:.1f} ms; far timer p50 {cancels['far'][0]:.1f} ms, "
            f"max {cancels['far'][1]:.1f} ms. After `store.summarize()` (the delivery loop's, every minute; it added "
            f"{summarized:,} BRIN range summaries autovacuum had not made): near p50 {summarized_cancels['near'][0]:.1f} ms, "
            f"max {summarized_cancels['near'][1]:.1f} ms; far p50 {summarized_cancels['far'][0]:.1f} ms, max "
            f"{summarized_cancels['far'][1]:.1f} ms",
            f"delivery on the almost empty store: {empty_deliver:,.0f} msg/s; raw move of the burst rows "
            f"{move_rate:,.0f} msg/s (batches of {batch_move})",
        ]
    command = "python -m bench.wheel_bench" + (f" --scale {args.scale}" if args.scale != 1.0 else "")
    print_section("Timing wheel (issue 3)", checks, notes, started, command)
    return checks


if __name__ == "__main__":
    sys.exit(0 if all(c.passed for c in main()) else 1)
