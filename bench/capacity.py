"""Capacity at 1/100 scale: what a pending timer and a delivered message cost, and what that makes of 1 billion
pending timers and 100,000 msg/s (docs/capacity.md). Per step, in a database of its own: bytes (the tables' growth
after a VACUUM), rows, WAL (this database's, read with pg_waldump) and CPU (this process, the store's backends).

0. Baselines: a plain table filled by binary COPY, and the raw batched move (common.RAW_MOVE) out of a copy of it.
1. `10M x scale` timers sent by send_many in calls of `--batch`: near wheel (due 1 h - 3 d), far (4 - 34 d: far
   segments and key summaries), levels 17-18; and the first VACUUM's time.
2. The steady state on the real clock with those pending: 1,000 and 4,000 msg/s for `--seconds`, half to the wheel
   (1-10 s), half to levels 1-3, delivered on all 19 lanes, read by one consumer; and the line through both rates.
3. The roll: far day blocks moved into the near wheel with the clock one and two days ahead.
4. Delivery (injected clock): the near timers due within a day by wheel passes, every level by level passes.
"""

from __future__ import annotations

import math
import os
import random
import re
import resource
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg

from delaywheel import Message, Store
from delaywheel.deliver import runner
from delaywheel.dev.embedded import find_bindir

from .common import RAW_MOVE, RAW_TABLE, body, chunks, copy_rows, database, log, options, raw_source, report, scaled

DB = "delaywheel_bench_capacity"
TOPIC = "cap_orders"
GROUP = "cap_consumer"
HOUR, DAY = timedelta(hours=1), timedelta(days=1)
BILLION = 1_000_000_000
TARGET_RATE = 100_000
RATE = 1000  # the steady state's slower run, 1/100 of TARGET_RATE (the faster: 4 x)
LANES = 19  # 18 levels + the wheel: one advisory lock each, one pass at a time per lane
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The tables each kind of pending timer lives in, and those a delivered message lands in.
KINDS = {
    "near": ("delaywheel.wheel",),
    "far": ("delaywheel.wheel_far_segments", "delaywheel.far_key_summaries"),
    "level": ("delaywheel.level_segments",),
}
TOPIC_TABLES = ("delaywheel.topic_messages",)
SIZE = """SELECT CASE WHEN c.relkind = 'p' THEN (SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)
    FROM pg_partition_tree(c.oid) t) ELSE pg_total_relation_size(c.oid) END FROM pg_class c WHERE c.oid = %s::regclass"""
_RECORD = re.compile(r"len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*(\d+)")


def _proc_cpu(pid: int) -> float | None:
    """utime + stime of a process in seconds, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Sample:
    at: float
    wal_lsn: str
    client_cpu: float
    backends: dict[int, float]  # the client backends connected to the store's database


@dataclass
class Usage:
    """What one measured step cost."""

    seconds: float
    wal_bytes: int  # the cluster's (others' work on it included)
    client_cpu: float
    server_cpu: float  # the store's backends
    own_wal_bytes: int | None = None  # this database's share of wal_bytes (pg_waldump), where measured

    def per(self, count: int) -> dict[str, float]:
        """Per message: WAL bytes, and CPU µs of this process and of the store's backends."""
        n = max(count, 1)
        return {
            "wal_bytes": self.wal_bytes / n,
            "client_cpu_us": 1e6 * self.client_cpu / n,
            "server_cpu_us": 1e6 * self.server_cpu / n,
            **({"own_wal_bytes": self.own_wal_bytes / n} if self.own_wal_bytes is not None else {}),
        }


class Meter:
    """Samples the WAL position, this process's CPU and the store's backends' from /proc (the benchmark runs on the
    server's machine: the embedded cluster or a local one)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        data_dir, self.database_oid = conn.execute(  # type: ignore[misc]
            "SELECT current_setting('data_directory'), oid FROM pg_database WHERE datname = current_database()"
        ).fetchone()
        self.wal_dir = Path(data_dir) / "pg_wal"

    def own_wal(self, a: Sample, b: Sample) -> int | None:
        """The WAL bytes between two samples that belong to this database: records of its relations, and every
        record of a transaction that wrote one (its commit). Read with pg_waldump, so other databases' work on the
        cluster (Airflow's, other tests') is left out; None if pg_waldump cannot read the WAL."""
        waldump = find_bindir() / "pg_waldump"
        if not waldump.exists():
            return None
        ours = f"rel 1663/{self.database_oid}/"  # the default tablespace: the store creates no other
        mine, others, xids = 0, dict[int, int](), set()  # streamed: a big step's WAL is millions of records
        with subprocess.Popen(
            [str(waldump), "--path", str(self.wal_dir), "--start", a.wal_lsn, "--end", b.wal_lsn],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as dump:
            for line in dump.stdout or ():
                if match := _RECORD.search(line):
                    total, tx = int(match.group(1)), int(match.group(2))
                    if ours in line:
                        mine += total
                        xids.add(tx)
                    elif tx:
                        others[tx] = others.get(tx, 0) + total
            error = dump.stderr.read() if dump.stderr else ""
        if dump.returncode != 0:
            log(f"pg_waldump: {error.strip()[:300]}")
            return None
        return mine + sum(others.get(tx, 0) for tx in xids if tx)  # with their commits

    def sample(self) -> Sample:
        (lsn,) = self.conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
        pids = self.conn.execute(  # autovacuum's workers are left out: VACUUM is timed on its own
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
        ).fetchall()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        backends = {p: c for (p,) in pids if (c := _proc_cpu(p)) is not None}
        return Sample(time.perf_counter(), lsn, usage.ru_utime + usage.ru_stime, backends)

    def usage(self, a: Sample, b: Sample, *, own: bool = False) -> Usage:
        """What was used between two samples; with `own`, also this database's share of the WAL (pg_waldump: for
        steps whose WAL is small beside what the rest of the cluster writes meanwhile). CPU: the processes of the
        second sample (one started in between counts from 0; one that ended in between is lost, so measured steps
        end before their connections close)."""
        diff = "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)"
        (wal_bytes,) = self.conn.execute(diff, (b.wal_lsn, a.wal_lsn)).fetchone()  # type: ignore[misc]
        server_cpu = sum(c - a.backends.get(p, 0.0) for p, c in b.backends.items())
        own_wal = self.own_wal(a, b) if own else None
        return Usage(b.at - a.at, int(wal_bytes), b.client_cpu - a.client_cpu, server_cpu, own_wal)

    @contextmanager
    def retained(self) -> Iterator[None]:
        """Keep the cluster's WAL from now on until the block ends (a physical replication slot), so that pg_waldump
        can still read it: the cluster recycles segments within seconds while other work writes."""
        slot = f"cap_wal_{os.getpid()}"
        self.conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
        try:
            yield
        finally:
            self.conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))

    @contextmanager
    def measure(self) -> Iterator[list[Usage]]:
        """What the block used, this database's WAL included: the one Usage of the list it yields, once it ends."""
        used: list[Usage] = []
        with self.retained():
            start = self.sample()
            yield used
            used.append(self.usage(start, self.sample(), own=True))


def wal(figures: dict[str, float]) -> float:
    """WAL bytes per message: this database's where pg_waldump could tell, else the cluster's."""
    return figures.get("own_wal_bytes", figures["wal_bytes"])


def sizes(conn: psycopg.Connection, tables: tuple[str, ...]) -> int:
    """Heap + indexes + TOAST + maps, summed over partitions and tables."""
    return sum(int(conn.execute(SIZE, (t,)).fetchone()[0]) for t in tables)  # type: ignore[index]


def rows(conn: psycopg.Connection, tables: tuple[str, ...]) -> int:
    return sum(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)  # type: ignore[index,arg-type]


def vacuum(conn: psycopg.Connection, tables: tuple[str, ...]) -> float:
    started = time.perf_counter()
    for table in tables:
        conn.execute(f"VACUUM (ANALYZE) {table}")  # type: ignore[arg-type]
    return time.perf_counter() - started


def fill(store: Store, meter: Meter, kind: str, count: int, batch: int, real0: datetime) -> dict[str, float]:
    """`count` pending timers of `kind` sent in calls of `batch`: per timer, bytes, rows, WAL and CPU, and the
    first VACUUM of the kind's tables. Level timers at levels 17-18 (1 h, 2 h: none falls due during the steady
    step); wheel timers due in the kind's range."""
    conn, tables, rng = meter.conn, KINDS[kind], random.Random(f"{kind}-{batch}")
    at, span = (real0 + HOUR, 3 * DAY - HOUR) if kind == "near" else (real0 + 4 * DAY, 30 * DAY)
    conn.execute("CHECKPOINT")  # every step starts from a checkpoint: its full-page images are counted alike
    bytes0, rows0 = sizes(conn, tables), rows(conn, tables)
    with meter.measure() as usage:
        for start, size in chunks(count, batch):
            store.send_many(
                [
                    Message(TOPIC, body(i), rng.randint(17, 18), key=f"{kind}-{i}", tags="created")
                    if kind == "level"
                    else Message(TOPIC, body(i), deliver_at=at + rng.random() * span, key=f"{kind}-{i}", tags="created")
                    for i in range(start, start + size)
                ]
            )
    bytes_unvacuumed = sizes(conn, tables) - bytes0
    first = vacuum(conn, tables)
    return {
        "count": count,
        "batch": batch,
        "send_rate": count / usage[0].seconds,
        "bytes": (sizes(conn, tables) - bytes0) / count,
        "bytes_before_vacuum": bytes_unvacuumed / count,
        "rows": (rows(conn, tables) - rows0) / count,
        "first_vacuum_us": 1e6 * first / count,
        **usage[0].per(count),
    }


def baselines(store: Store, meter: Meter, count: int, real0: datetime) -> dict[str, dict[str, float]]:
    """The plain table by COPY, and the batched move out of a copy of it with a primary key."""
    conn = meter.conn
    conn.execute(RAW_TABLE.format(name="raw_plain"))
    conn.execute("CHECKPOINT")
    with meter.measure() as copied:
        for start, size in chunks(count, 20_000):
            with conn.transaction():
                copy_rows(
                    conn, "raw_plain", ((i, TOPIC, f"raw-{i}", real0 + DAY, real0) for i in range(start, start + size))
                )
    vacuum(conn, ("raw_plain",))
    copy = {"rate": count / copied[0].seconds, "bytes": sizes(conn, ("raw_plain",)) / count, **copied[0].per(count)}
    raw_source(conn, "raw_plain")
    vacuum(conn, ("raw_src",))
    conn.execute("CHECKPOINT")
    with meter.measure() as moved:
        while conn.execute(RAW_MOVE, (store.settings.batch_size,)).rowcount:
            pass
    move = {"rate": count / moved[0].seconds, "bytes": sizes(conn, ("raw_dst",)) / count, **moved[0].per(count)}
    conn.execute("DROP TABLE raw_plain, raw_src, raw_dst")
    return {"copy": copy, "move": move}


def roll(store: Store, meter: Meter, real0: datetime) -> dict[str, float]:
    """Promote the far day blocks entering the near window with the clock one day, then two days ahead."""
    conn = meter.conn

    def one(sql: str) -> Any:
        return conn.execute(sql).fetchone()[0]  # type: ignore[index,arg-type]

    far = "SELECT coalesce(sum(n), 0) FROM delaywheel.wheel_far_segments"
    parts = "SELECT count(*) FROM delaywheel.partitions WHERE parent = 'wheel_far_segments'"
    conn.execute("CHECKPOINT")
    moved, seconds, wal_bytes, blocks = 0, 0.0, 0.0, 0
    for days in (1, 2):
        before, parts_before, start = one(far), one(parts), one("SELECT near_until FROM delaywheel.wheel_roll")
        with meter.measure() as usage:  # prepare does one step of the roll (a slice, or the last step): to its end
            left = before
            while True:  # until the last step moved near_until, or a step moved nothing (nothing to roll)
                store.prepare(now=real0 + days * DAY)
                left, was = one(far), left
                if one("SELECT near_until FROM delaywheel.wheel_roll") != start or left == was:
                    break
        moved, blocks = moved + before - one(far), blocks + parts_before - one(parts)
        seconds += usage[0].seconds
        wal_bytes += wal(usage[0].per(1))  # the step's, this database's where pg_waldump could tell
    return {
        "rows": moved,
        "blocks": blocks,
        "seconds": seconds,
        "us_per_row": 1e6 * seconds / max(moved, 1),
        "wal_bytes_per_row": wal_bytes / max(moved, 1),
    }


def deliver(store: Store, meter: Meter, real0: datetime) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Deliver the near timers due within a day (wheel passes) and every level (level passes), injected clock."""
    conn = meter.conn
    topic_before = sizes(conn, TOPIC_TABLES)
    figures = {}
    lanes = {
        "wheel": [lambda: store.advance_wheel(now=real0 + DAY)],
        "levels": [
            lambda level=level: store.deliver_level(level, now=real0 + 3 * HOUR)
            for level in range(1, store.settings.max_level + 1)
        ],
    }
    for lane, passes_of in lanes.items():
        conn.execute("CHECKPOINT")
        delivered, passes, before = 0, 0, sizes(conn, TOPIC_TABLES)
        with meter.measure() as usage:
            for one_pass in passes_of:  # each lane's passes until one says there is no more
                more = True
                while more:
                    result = one_pass()
                    delivered, passes, more = delivered + result.delivered, passes + 1, result.more
        figures[lane] = {
            "delivered": delivered,
            "passes": passes,
            "rate": delivered / usage[0].seconds,
            "topic_bytes_before_vacuum": (sizes(conn, TOPIC_TABLES) - before) / max(delivered, 1),
            **usage[0].per(delivered),
        }
    total = sum(int(f["delivered"]) for f in figures.values())
    first = vacuum(conn, TOPIC_TABLES)
    topic = {
        "delivered": total,
        "bytes": (sizes(conn, TOPIC_TABLES) - topic_before) / max(total, 1),
        "first_vacuum_us": 1e6 * first / total,
    }
    return figures, topic


def steady(url: str, meter: Meter, rate: int, seconds: float) -> dict[str, float]:
    """`rate` msg/s on the real clock for `seconds` (after 10 s of warm-up), in calls of rate/10 every 100 ms: half
    with a 1-10 s delay (wheel), half at levels 1-3; delivered by runner.run on every lane, read by one consumer."""
    stop, consumed = threading.Event(), [0]
    count_sql = "SELECT count(*) FROM delaywheel.topic_messages WHERE topic = %s"

    def handle(messages: list[Any]) -> None:
        consumed[0] += len(messages)

    with meter.retained():  # from before the first sample until pg_waldump has read the step's WAL
        with Store(url) as producer, Store(url) as deliverer, Store(url) as reader:
            lanes: list[int | None] = [None, *range(1, producer.settings.max_level + 1)]
            threads = [
                threading.Thread(target=runner.run, args=(deliverer, lanes, seconds + 60), kwargs={"stop": stop}),
                threading.Thread(
                    target=reader.consume, args=(TOPIC, GROUP, handle), kwargs={"stop": stop, "max_messages": 500}
                ),
            ]
            for t in threads:
                t.daemon = True
                t.start()
            rng, per_call, sent = random.Random(5), max(1, rate // 10), 0
            next_at = time.monotonic()
            warm_until, sample = next_at + 10, None
            while time.monotonic() < warm_until + seconds:
                if sample is None and time.monotonic() >= warm_until:
                    delivered0 = meter.conn.execute(count_sql, (TOPIC,)).fetchone()[0]  # type: ignore[index]
                    sample, consumed0, sent0 = meter.sample(), consumed[0], sent
                producer.send_many(
                    [
                        Message(TOPIC, body(i), delay=timedelta(seconds=rng.uniform(1, 10)), key=f"steady-{i}")
                        if (i - sent) % 2
                        else Message(TOPIC, body(i), delay_level=rng.randint(1, 3), key=f"steady-{i}")
                        for i in range(sent, sent + per_call)
                    ]
                )
                sent += per_call
                next_at += 0.1
                time.sleep(max(0.0, next_at - time.monotonic()))
            assert sample is not None
            end_sample = meter.sample()  # before the threads' connections close
            delivered = meter.conn.execute(count_sql, (TOPIC,)).fetchone()[0] - delivered0  # type: ignore[index]
            done = consumed[0] - consumed0
            stop.set()
            for t in threads:
                t.join(timeout=30)
        usage = meter.usage(sample, end_sample, own=True)
    n = sent - sent0
    return {
        "seconds": usage.seconds,
        "sent": n,
        "delivered": delivered,
        "consumed": done,
        "wal_bytes_per_s": usage.wal_bytes / usage.seconds,
        "own_wal_bytes_per_s": (usage.own_wal_bytes or 0) / usage.seconds,
        "own_wal_bytes_per_message": (usage.own_wal_bytes or 0) / max(n, 1),
        "client_cores": usage.client_cpu / usage.seconds,
        "server_cores": usage.server_cpu / usage.seconds,
    }


def marginal(low: dict[str, float], high: dict[str, float]) -> dict[str, float]:
    """The cost of one more message per second, and the cost at no traffic, from two steady runs (a straight line
    through both): per-pass and per-call costs shrink per message as batches grow, so scaling one run up would
    overstate a busy store."""
    r0, r1 = (run["sent"] / run["seconds"] for run in (low, high))
    out = {}
    for name, fixed, key in (
        ("wal_bytes", "fixed_wal_bytes_per_s", "own_wal_bytes_per_s"),
        ("server_cpu_s", "fixed_server_cores", "server_cores"),
        ("client_cpu_s", "fixed_client_cores", "client_cores"),
    ):
        out[name] = slope = (high[key] - low[key]) / (r1 - r0)
        out[fixed] = low[key] - slope * r0
    return out


def extrapolate(f: SimpleNamespace, cores_per_store: int) -> dict[str, Any]:
    """1 billion pending and 100,000 msg/s from the per-message figures (linear: every figure measured here is per
    row or per segment, and partitions keep each step's cost flat)."""
    out: dict[str, Any] = {}
    gib, tib, day, rate = 2**30, 2**40, 86400, TARGET_RATE
    near, wheel, levels = f.pending["near"], f.delivery["wheel"], f.delivery["levels"]
    # Storage of 1B pending timers: each kind alone, and a 30-day horizon's mix (near window 3 of 30 days).
    for kind, p in f.pending.items():
        out[f"storage_1B_{kind}_GiB"] = p["bytes"] * BILLION / gib
    mix = {"near": 0.1, "far": 0.9}
    out["storage_1B_mix_GiB"] = sum(f.pending[k]["bytes"] * share for k, share in mix.items()) * BILLION / gib
    out["storage_1B_baseline_plain_table_GiB"] = f.baseline["copy"]["bytes"] * BILLION / gib
    out["first_vacuum_1B_hours"] = {k: p["first_vacuum_us"] * BILLION / 1e6 / 3600 for k, p in f.pending.items()}
    out["roll_far_rows_per_day_30d_horizon"] = far_per_day = BILLION * mix["far"] / 30
    out["roll_seconds_per_day_30d_horizon"] = f.roll["us_per_row"] * far_per_day / 1e6
    # 100,000 msg/s, every message sent, delivered and consumed. WAL: the steady runs' fixed rate plus the marginal
    # bytes per message fitted between the two rates. CPU: a range. Its low end is big calls (sends of 20,000, passes
    # of 5,000: near-wheel send + wheel delivery); its high end the faster steady run (calls of rate/10, all 19 lanes
    # and a consumer) scaled up as it is, fixed costs included. A fit between the two runs is not used for CPU: on a
    # shared machine the fixed part (wake-ups, polls) varies more than the difference between the runs.
    m = f.steady["marginal"]
    fast = max((r for k, r in f.steady.items() if k != "marginal"), key=lambda r: r["sent"] / r["seconds"])
    fast_rate = fast["sent"] / fast["seconds"]
    wal_per_s = m["fixed_wal_bytes_per_s"] + max(m["wal_bytes"], 0.0) * rate
    out["wal_MB_per_s_steady"] = wal_per_s / 1e6
    out["wal_per_day_TiB_steady"] = wal_per_s * day / tib
    out["wal_per_day_TiB_bulk"] = (wal(near) + wal(wheel)) * rate * day / tib
    out["cores_total_bulk"] = sum(x[k] for x in (near, wheel) for k in ("client_cpu_us", "server_cpu_us")) * rate / 1e6
    out["cores_server_bulk"] = (near["server_cpu_us"] + wheel["server_cpu_us"]) * rate / 1e6
    out["cores_total_steady_linear"] = (fast["server_cores"] + fast["client_cores"]) * rate / fast_rate
    out["cores_server_steady_linear"] = fast["server_cores"] * rate / fast_rate
    out["topic_storage_per_day_GiB"] = f.topic["bytes"] * rate * day / gib
    # Single-lane limits: one pass at a time per lane, each pass one backend, so a lane delivers at most one core's
    # worth: 1 / (server + client CPU per message delivered). The rate measured here is lower when the machine is
    # shared (both are recorded).
    out["lane_ceiling_wheel_msg_s_by_cpu"] = ceiling = 1e6 / (wheel["server_cpu_us"] + wheel["client_cpu_us"])
    out["lane_ceiling_level_msg_s_by_cpu"] = 1e6 / (levels["server_cpu_us"] + levels["client_cpu_us"])
    out["lane_rate_wheel_msg_s_measured"] = wheel["rate"]
    out["lane_rate_level_msg_s_measured"] = levels["rate"]
    headroom = 0.5  # run at half a ceiling: the other half catches up after an outage while traffic goes on
    out["store_ceiling_wheel_traffic_msg_s"] = ceiling * headroom
    out["store_ceiling_level_traffic_msg_s"] = (LANES - 1) * out["lane_ceiling_level_msg_s_by_cpu"] * headroom
    out["store_ceiling_by_cores_msg_s"] = by_cores = cores_per_store * headroom / (fast["server_cores"] / fast_rate)
    out["stores_if_all_timers_in_wheel"] = math.ceil(rate / min(ceiling * headroom, by_cores))
    out["stores_by_cores"] = math.ceil(rate / by_cores)
    out["stores"] = stores = max(out["stores_if_all_timers_in_wheel"], out["stores_by_cores"])
    # Catch-up after an hour without deliverers, traffic going on, every timer in the wheel lane: one store alone,
    # and each of the planned stores (its share of the traffic).
    for label, n in (("one_store", 1), ("planned_stores", stores)):
        spare = ceiling - rate / n
        out[f"catch_up_1h_outage_{label}_hours"] = rate / n * 3600 / spare / 3600 if spare > 0 else math.inf
    out["roll_minutes_per_day_per_store"] = out["roll_seconds_per_day_30d_horizon"] / 60 / stores
    out["cores_per_store_assumed"] = cores_per_store
    out["headroom"] = headroom
    return out


def notes(f: SimpleNamespace) -> list[str]:
    """The figures RESULTS.md and docs/capacity.md quote, with their baselines of the same run."""
    b, e = f.baseline, f.extrapolated
    per = ", ".join(f"{k} {p['bytes']:,.0f} B" for k, p in f.pending.items())
    return [
        f"scale {f.scale} (1.0: 10,000,000 pending); {f.environment}",
        f"bytes per pending timer: {per} (a plain row by COPY: {b['copy']['bytes']:,.0f} B)",
        "WAL per pending timer: "
        + ", ".join(f"{k} {wal(p):,.0f} B" for k, p in f.pending.items())
        + f" (a plain COPY row: {wal(b['copy']):,.0f} B)",
        "per delivered message: "
        + ", ".join(
            f"{lane} {d['topic_bytes_before_vacuum']:,.0f} B in its topic, WAL {wal(d):,.0f} B, {d['rate']:,.0f} msg/s"
            for lane, d in f.delivery.items()
        )
        + f" (the raw batched move: WAL {wal(b['move']):,.0f} B, {b['move']['rate']:,.0f} msg/s)",
        f"roll: {f.roll}; topic: {f.topic}",
        f"WAL a day at 100,000 msg/s {e['wal_per_day_TiB_steady']:.1f} TiB; the wheel lane's ceiling"
        f" {e['lane_ceiling_wheel_msg_s_by_cpu']:,.0f} msg/s; stores needed {e['stores']}",
    ]


def main(argv: list[str], name: str) -> list:
    parser = options(__doc__, "multiply every count (1.0: 10M pending)")
    parser.add_argument("--seconds", type=float, default=45.0, help="steady state: measured seconds of each run")
    parser.add_argument("--cores-per-store", type=int, default=16, help="extrapolation: cores of one store's server")
    args = parser.parse_args(argv)
    counts = {"near": 3_000_000, "far": 5_000_000, "level": 2_000_000, "baseline": 1_000_000}
    n = {kind: scaled(count, args.scale) for kind, count in counts.items()}
    f = SimpleNamespace(  # everything measured, per message where it says so; `extrapolated` is derived from it
        scale=args.scale, pending={}, baseline={}, roll={}, delivery={}, topic={}, steady={}, environment={}
    )
    with database(DB) as url, Store(url) as store, psycopg.connect(url, autocommit=True) as conn:
        meter = Meter(conn)
        store.prepare()
        real0 = store.clock()
        f.environment = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count()}
        idle = meter.sample()
        time.sleep(10)
        f.environment["idle_wal_bytes_per_s"] = meter.usage(idle, meter.sample()).wal_bytes / 10  # others' work
        f.environment["server"] = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        log(f"baselines: {n['baseline']} rows by COPY and a batched move")
        f.baseline = baselines(store, meter, n["baseline"], real0)
        for kind in KINDS:
            log(f"pending {kind}: {n[kind]} timers in calls of {args.batch}")
            f.pending[kind] = fill(store, meter, kind, n[kind], args.batch, real0)
            log(f"   {f.pending[kind]['bytes']:,.0f} B/timer, {f.pending[kind]['send_rate']:,.0f} msg/s")
        for rate in (RATE, 4 * RATE):
            log(f"steady: {rate} msg/s for {args.seconds:.0f} s on the real clock")
            f.steady[str(rate)] = steady(url, meter, rate, args.seconds)
        f.steady["marginal"] = marginal(f.steady[str(RATE)], f.steady[str(4 * RATE)])
        log("roll: the clock one and two days ahead")
        f.roll = roll(store, meter, real0)
        log("delivery: the wheel's next day and every level, injected clock")
        f.delivery, f.topic = deliver(store, meter, real0)
        f.environment["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    f.extrapolated = extrapolate(f, args.cores_per_store)
    return report(name, "Capacity at 1/100 scale, extrapolated to 1 billion", [], notes(f), argv, vars(f))
