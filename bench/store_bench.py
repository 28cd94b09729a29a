"""Store benchmark (issue 2): delay levels against raw PostgreSQL, measured in one run on one server.

1. send_many vs a raw binary COPY of the same rows and columns into a plain table, interleaved batch by batch
   so both see the same load on a shared machine.
2. Delivery of a level with a large due backlog vs a raw batched move (DELETE ... RETURNING into INSERT) of
   the same rows, interleaved pass by pass, the same batch size.
3. Single `send` latency p50/p99, next to a single-row INSERT into a plain table.
4. Flat cost: send and delivery rates with 10M pending level-18 messages in the same partition and indexes,
   against an empty store in a second database (`delaywheel_bench_empty`); rounds alternate between the two so
   both see the same load on a shared machine (best of five rounds each), the empty one settled first by an
   untimed round and VACUUM (ANALYZE), as the loaded one is after its fill.

The clock is injected (`now=`), so backlogs are due without waiting.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta

import psycopg

from delaywheel import Message, Store
from delaywheel.produce.producer import SEGMENT_MAX

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
    parse_args,
    print_section,
    scaled,
)

TOPIC = "bench.orders"
EMPTY_DB = "delaywheel_bench_empty"
T0 = datetime(2031, 1, 1, tzinfo=UTC)  # injected clock origin: an empty hour partition
# The baseline's rows: every field a level message carries, one row per message (what the level queue stored
# before migrations/011), written by binary COPY with psycopg's write_row, as a hand-written loader would.
COLUMNS = (
    "id",
    "level",
    "requested_level",
    "topic",
    "key",
    "tags",
    "properties",
    "body",
    "is_json",
    "reconsume_times",
    "deliver_at",
    "enqueued_at",
)
TYPES = ["int8", "int2", "int4", "text", "text", "text", "jsonb", "bytea", "bool", "int4", "timestamptz", "timestamptz"]
RAW_TABLE = """CREATE TABLE {name} (id bigint, level smallint, requested_level int, topic text, key text,
    tags text, properties jsonb, body bytea, is_json boolean, reconsume_times int, deliver_at timestamptz,
    enqueued_at timestamptz)"""
RAW_MOVE = """WITH m AS (DELETE FROM raw_src WHERE id IN (SELECT id FROM raw_src ORDER BY id LIMIT %s) RETURNING *)
    INSERT INTO raw_dst SELECT * FROM m"""


def _messages(start: int, levels: list[int], prefix: str) -> list[Message]:
    return [
        Message(TOPIC, body(start + j), delay_level=lv, key=f"{prefix}-{start + j}", tags="created")
        for j, lv in enumerate(levels)
    ]


def send_vs_copy(store: Store, raw: psycopg.Connection, count: int, batch: int, at: datetime) -> dict[str, float]:
    """Rates for the same rows (levels 2-17 at random, a key, tags and a ~90-byte body): ours, a raw COPY into a
    plain table, and into a plain table with a per-message FIFO index (level, xid, id), the level queue's layout
    before segments (migrations/011)."""
    tables = {"raw": "raw_plain", "raw + FIFO index": "raw_fifo"}
    for table in tables.values():
        raw.execute(RAW_TABLE.format(name=table))
    raw.execute("ALTER TABLE raw_fifo ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id()")
    raw.execute("CREATE INDEX ON raw_fifo (level, xid, id)")
    rng = random.Random(2)
    watches = {side: Stopwatch() for side in ["ours", *tables]}
    for n, (start, size) in enumerate(chunks(count, batch)):
        levels = [rng.randint(2, 17) for _ in range(size)]
        messages = _messages(start, levels, "order")
        rows = [
            (
                10**12 + start + j,
                lv,
                lv,
                TOPIC,
                f"order-{start + j}",
                "created",
                None,
                body(start + j),
                False,
                0,
                at + store.settings.level_delay(lv),
                at,
            )
            for j, lv in enumerate(levels)
        ]
        sides = list(watches)
        for side in sides[n % len(sides) :] + sides[: n % len(sides)]:  # rotate who goes first
            with watches[side].run(size):
                if side == "ours":
                    store.send_many(messages, now=at)
                else:
                    with raw.transaction():
                        copy_rows(raw, tables[side], COLUMNS, TYPES, rows)
    return {side: watch.rate for side, watch in watches.items()}


def send_level(store: Store, count: int, batch: int, level: int, at: datetime, prefix: str) -> float:
    watch = Stopwatch()
    for start, size in chunks(count, batch):
        messages = _messages(start, [level] * size, prefix)
        with watch.run(size):
            store.send_many(messages, now=at)
    return watch.rate


class Drain:
    """Delivers one level pass by pass until `expected` messages went out. A pass that finds nothing while
    messages remain means another transaction in the cluster holds the commit horizon: wait, untimed."""

    def __init__(self, store: Store, level: int, now: datetime, expected: int) -> None:
        self.store, self.level, self.now, self.expected = store, level, now, expected
        self.delivered = 0
        self.horizon_waits = 0
        self.watch = Stopwatch()

    @property
    def done(self) -> bool:
        return self.delivered >= self.expected

    def step(self) -> None:
        with self.watch.run():
            result = self.store.deliver_level(self.level, now=self.now)
        self.delivered += result.delivered
        self.watch.count += result.delivered
        if not result.more and not self.done:
            self.horizon_waits += 1
            if self.horizon_waits > 3000:
                raise RuntimeError(f"level {self.level}: stuck at {self.delivered}/{self.expected}")
            time.sleep(0.02)

    def run(self) -> float:
        while not self.done:
            self.step()
        if self.delivered != self.expected:
            raise RuntimeError(f"level {self.level}: delivered {self.delivered}, expected {self.expected}")
        return self.watch.rate


def deliver_vs_move(
    store: Store, raw: psycopg.Connection, count: int, batch: int, at: datetime
) -> tuple[float, float, int]:
    """Rates (ours, raw move) for a due backlog of `count` level-1 messages and the same rows in a plain table."""
    send_level(store, count, batch, 1, at, "backlog")
    raw.execute(RAW_TABLE.format(name="raw_src"))
    raw.execute(
        f"INSERT INTO raw_src SELECT {', '.join(COLUMNS)} FROM delaywheel.level_queue"
        " WHERE level = 1 AND enqueued_at = %s",
        (at,),
    )
    raw.execute("ALTER TABLE raw_src ADD PRIMARY KEY (id)")
    raw.execute(RAW_TABLE.format(name="raw_dst"))
    raw.execute("ANALYZE raw_src")
    ours = Drain(store, 1, at + timedelta(minutes=1), count)
    base = Stopwatch()
    left = count
    while not ours.done or left:
        if not ours.done:
            ours.step()
        if left:
            with base.run():
                moved = raw.execute(RAW_MOVE, (store.settings.batch_size,)).rowcount
            base.count += moved
            left -= moved
    return ours.watch.rate, base.rate, ours.horizon_waits


def send_latency(store: Store, raw: psycopg.Connection, count: int) -> tuple[list[float], list[float]]:
    """Milliseconds per single `send` (real clock, one transaction each) and per single-row INSERT."""
    store.prepare()
    raw.execute(RAW_TABLE.format(name="raw_single"))
    insert = f"INSERT INTO raw_single ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * 12)})"
    ours, base = [], []
    for i in range(count):
        started = time.perf_counter()
        store.send(TOPIC, body(i), delay_level=3, key=f"single-{i}", tags="created")
        ours.append(1000 * (time.perf_counter() - started))
        now = datetime.now(UTC)
        started = time.perf_counter()
        raw.execute(
            insert,
            (
                i,
                3,
                3,
                TOPIC,
                f"single-{i}",
                "created",
                None,
                body(i),
                False,
                0,  # type: ignore[arg-type]
                now + timedelta(seconds=10),
                now,
            ),
        )
        base.append(1000 * (time.perf_counter() - started))
    return ours, base


def flat_rounds(
    stores: dict[str, Store], count: int, batch: int, at: datetime, rounds: int = 5
) -> dict[str, tuple[float, float]]:
    """Best-of-`rounds` (send rate, delivery rate) of `count` level-1 messages per store, alternating stores."""
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
    for r in range(rounds):
        now = at + timedelta(minutes=r)
        for name, store in list(stores.items()) if r % 2 else list(reversed(stores.items())):
            send = send_level(store, count, batch, 1, now, f"flat{r}")
            rates[name].append((send, Drain(store, 1, now + timedelta(seconds=5), count).run()))
    return {name: (max(s for s, _ in v), max(d for _, d in v)) for name, v in rates.items()}


def fill_pending(store: Store, count: int, at: datetime) -> None:
    """`count` pending level-18 messages enqueued at `at` (same hour partition as the measurements), in segments
    of SEGMENT_MAX as send_many writes them, each segment's ids from its own block."""
    store.prepare(now=at)
    segments = -(-count // SEGMENT_MAX)
    for start in range(0, segments, 1000):
        with store.conn.transaction():
            store.conn.execute(
                "INSERT INTO delaywheel.level_segments (id_first, id_last, level, requested_level, reconsume_times,"
                " deliver_at, enqueued_at, n, ids, topics, keys, tags, properties, bodies, is_json)"
                " SELECT b, b + %(m)s - 1, 18, 18, 0, %(due)s, %(at)s, %(m)s,"
                " ARRAY(SELECT b + i FROM generate_series(0, %(m)s - 1) i), array_fill('bench.backdrop'::text, ARRAY[%(m)s]),"
                " ARRAY(SELECT 'backdrop-' || (s * %(m)s + i) FROM generate_series(0, %(m)s - 1) i),"
                " array_fill('created'::text, ARRAY[%(m)s]), array_fill(NULL::jsonb, ARRAY[%(m)s]),"
                " array_fill(%(body)s::bytea, ARRAY[%(m)s]), array_fill(false, ARRAY[%(m)s])"
                " FROM (SELECT s, nextval('delaywheel.message_id_seq') AS b"
                "       FROM generate_series(%(a)s::bigint, %(b)s::bigint) s) blocks",
                {
                    "body": body(0),
                    "due": at + store.settings.level_delay(18),
                    "at": at,
                    "m": SEGMENT_MAX,
                    "a": start,
                    "b": min(segments, start + 1000) - 1,
                },
            )
    store.conn.execute("VACUUM (ANALYZE) delaywheel.level_segments")  # settle, as a store holding 10M would be
    store.conn.execute("CHECKPOINT")  # write the fill's dirty pages now, not while the flat rounds are timed


def settle(store: Store, count: int, batch: int, at: datetime) -> None:
    """Bring the empty store to where the loaded one is before the flat rounds: its partitions created, messages
    delivered through them once, and its tables analyzed (the loaded store's were, after its fill). A fresh
    store's first pass, creating partitions and planning without statistics, ran 20 % slower than later ones."""
    send_level(store, count, batch, 1, at, "settle")
    Drain(store, 1, at + timedelta(seconds=5), count).run()
    for table in ("delaywheel.level_segments", "delaywheel.topic_messages"):
        store.conn.execute(f"VACUUM (ANALYZE) {table}")  # type: ignore[arg-type]


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> list[Check]:
    args = parse_args(__doc__ or "")
    started = datetime.now(UTC)
    url = fresh_database()
    n_send, n_backlog = scaled(500_000, args.scale), scaled(1_000_000, args.scale)
    n_flat, n_pending, n_single = (
        scaled(100_000, args.scale),
        scaled(10_000_000, args.scale),
        scaled(3000, args.scale, 500),
    )
    checks: list[Check] = []
    notes: list[str] = []
    with Store(url) as store, psycopg.connect(url, autocommit=True) as raw:
        log(f"send_many vs raw COPY: {n_send} messages in batches of {args.batch}")
        rates = send_vs_copy(store, raw, n_send, args.batch, T0 + timedelta(minutes=5))
        ours, base, indexed = rates["ours"], rates["raw"], rates["raw + FIFO index"]
        checks.append(at_least("send_many vs raw COPY (msg/s)", ours, base, 0.6))
        log("   " + ", ".join(f"{side} {rate:,.0f} msg/s" for side, rate in rates.items()))
        notes.append(
            f"send_many batches of {args.batch:,} (levels 2-17 at random: segments of up to {SEGMENT_MAX} "
            f"per level); per message: ours {1e6 / ours:.2f} µs, raw COPY {1e6 / base:.2f} µs, raw COPY into "
            f"a table with a per-message FIFO index (the level queue before migrations/011) {1e6 / indexed:.2f} µs "
            f"({indexed:,.0f} msg/s, same run, interleaved)"
        )
        log(f"delivery vs raw move: backlog of {n_backlog} due level-1 messages")
        ours, base, waits = deliver_vs_move(store, raw, n_backlog, args.batch, T0 + timedelta(minutes=10))
        checks.append(at_least("level delivery vs raw batched move (msg/s)", ours, base, 0.5))
        log(f"   ours {ours:,.0f} msg/s, raw move {base:,.0f} msg/s")
        notes.append(
            f"delivery: batch {store.settings.batch_size} per pass for both; backlog {n_backlog:,}; "
            f"passes that waited on another transaction's commit horizon: {waits}"
        )
        log(f"flat cost: filling {n_pending} pending level-18 messages")
        filled = time.perf_counter()
        fill_pending(store, n_pending, T0 + timedelta(minutes=20))
        notes.append(
            f"pending backdrop: {n_pending:,} level-18 messages in the same hour partition and indexes "
            f"(SQL INSERT ... SELECT, {time.perf_counter() - filled:.0f} s), then VACUUM (ANALYZE) and CHECKPOINT; the empty "
            f"store settled first by one untimed round of {n_flat:,} and VACUUM (ANALYZE)"
        )
        log(f"flat cost: {n_flat} level-1 sends + deliveries, loaded and empty store alternating, best of 5")
        with Store(fresh_database(EMPTY_DB)) as empty:
            settle(empty, n_flat, args.batch, T0 + timedelta(minutes=25))
            flat_rates = flat_rounds({"loaded": store, "empty": empty}, n_flat, args.batch, T0 + timedelta(minutes=30))
        drop_database(EMPTY_DB)
        (loaded_send, loaded_deliver), (empty_send, empty_deliver) = flat_rates["loaded"], flat_rates["empty"]
        log(f"   empty store: send {empty_send:,.0f} msg/s, deliver {empty_deliver:,.0f} msg/s")
        checks.append(flat(f"send_many rate, {n_pending:,} pending vs empty (msg/s)", loaded_send, empty_send))
        checks.append(flat(f"delivery rate, {n_pending:,} pending vs empty (msg/s)", loaded_deliver, empty_deliver))
        log(f"   loaded store: send {loaded_send:,.0f} msg/s, deliver {loaded_deliver:,.0f} msg/s")
        log(f"single send latency: {n_single} sends")
        lat, lat_raw = send_latency(store, raw, n_single)
        notes.append(
            f"single `send` latency over {n_single:,} sends: p50 {percentile(lat, 50):.2f} ms, "
            f"p99 {percentile(lat, 99):.2f} ms (single-row INSERT into a plain table: p50 "
            f"{percentile(lat_raw, 50):.2f} ms, p99 {percentile(lat_raw, 99):.2f} ms)"
        )
    command = "python -m bench.store_bench" + (f" --scale {args.scale}" if args.scale != 1.0 else "")
    print_section("Store (issue 2)", checks, notes, started, command)
    return checks


if __name__ == "__main__":
    sys.exit(0 if all(c.passed for c in main()) else 1)
