"""Cancels beside deliveries (issue 19, item 4), measured in one run on one server.

1. cancel(key=…) latency with the near wheel full (its partitions over the next ~4 days) and `10M x scale`
   timers pending (due 1 min - 30 days ahead, sent by send_many: near ones in the wheel, the rest in far segments;
   or, `--near-only`, every one of them in the near wheel, as order timeouts are):
   the library's cancel (no lane lock; one statement, a procedure: migrations/027) against the previous way (the
   lanes' locks, the lookup planned per call), interleaved key by key; the library's cancel again, interleaved with
   its two-step way (find; mark and settle), whose steps are timed apart, and a durable single-row INSERT after each
   of those, the baseline (beside busy loops every durable commit waits for a scheduler tick); with `--pause-ms`, a
   pause after every call, as cancels come one at a time (an idle CPU wakes for each); EXPLAIN (ANALYZE, SUMMARY) of
   the lookup, planned per call and as a generic prepared plan; with `--parts`, where the lookup's time goes, an
   alternative measured (a day-partitioned key table for the near wheel), the far-key summaries read from their index
   (migrations/024) against the heap pages they were read from before, interleaved, the segments read by position
   (migrations/032) against unnested as before, interleaved, what taking the lookup's relation locks costs, and what a
   durable commit costs here.
2. Delivery lateness on the real clock: timers at `--rate` msg/s (delays 1-10 s) delivered by the library's loop
   (runner.run, wheel lane) in a process of its own, `--seconds` long, without cancels and then with `--cancels`
   cancels/s by key of timers due within the next second or just due (racing the passes), from several processes with
   a connection each (threads of one interpreter reached only 141-332 cancels/s). Reported: lateness p50/p99/max of
   the delivered timers, passes, busy passes and passes that waited for their lane (a cancel's momentary hold), cancel
   latency, exactly-once checks (no message delivered twice; none both delivered and answered cancelled; every
   already_delivered answer true), and where the CPU went: the machine's busy share and runnable tasks, and the cores
   used by the producer, the deliverer, the cancel processes and each one's backend. Where the slowdown comes from,
   by further runs: `--nice N`, the cancels at a lower CPU priority; `--floor`, the same processes at the same pace
   making, instead of each cancel, one durable single-row INSERT into a table of their own (the least any cancel that
   answers truly must write: what no cancel mechanism can go below here); `--floor-not-durable`, the same INSERTs
   committed without waiting for their WAL flush (what the other sessions' flushes, not their CPU, cost the
   deliverer's own commits); `--pin`, every run with the deliverer on a core of its own. With `--repeat N`, N rounds
   of every arm (ABBA order, each run after a CHECKPOINT), each arm's lateness pooled over its runs: one run's p99 is
   noise at this size (the same arm's moved 1.1-3.0 ms run to run).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import heapq
import importlib
import io
import multiprocessing
import os
import queue
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Literal, get_args

import psycopg
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.deliver import levels as lane_locks  # LANE_WAIT: how long a pass waits for its lane
from delaywheel.deliver import runner
from delaywheel.ops import cancel as cancel_module
from delaywheel.ops.cancel import FIND_PLAN, CancelResult, find, key_params, mark_and_settle
from delaywheel.pending import WHEEL_PENDING

from .common import body, chunks, drop_database, fresh_database, log, pct, wheel_partitions

DB = "delaywheel_bench_cancel"
_OLD: types.ModuleType
TOPIC = "bench.cancel"
StandIn = Literal["", "floor", "floor, not durable"]  # what the cancel processes do instead of cancels ("": cancel)


def fill(store: Store, count: int, batch: int, near_only: bool = False) -> None:
    """`count` timers due from a minute ahead to 30 days ahead, or (`near_only`, the order-timeout profile) all in
    the near wheel: up to `near_until`, which a first wheel pass (the roll) sets 3-4 days ahead."""
    rng = random.Random(7)
    first = store.clock() + timedelta(minutes=1)
    span = timedelta(days=30)
    if near_only:
        store.advance_wheel()
        (near_until,) = store.conn.execute("SELECT near_until FROM delaywheel.wheel_state").fetchone()  # type: ignore[misc]
        span = near_until - first - timedelta(minutes=1)
    for start, size in chunks(count, batch):
        store.send_many(
            [
                Message("bench.backdrop", body(0), deliver_at=first + rng.random() * span, key=f"backdrop-{start + j}")
                for j in range(size)
            ]
        )


def fill_at_rest(store: Store, other: psycopg.Connection, count: int, batch: int, near_only: bool = False) -> None:
    """`fill`, then the store as autovacuum leaves it at rest (hint bits set, pages all-visible), rather than racing
    it: a run right after the fill measured autovacuum's work beside the cancels (find 4 ms, against 2); and the pages
    that wrote flushed, rather than by the checkpointer during the run. `other`: an autocommit connection."""
    fill(store, count, batch, near_only)
    other.execute("VACUUM (ANALYZE)")
    other.execute("CHECKPOINT")


# Random keys of timers not cancelled yet (a cancelled message stays in its queue until its partition is retired).
_UNCANCELLED = " AND {} NOT IN (SELECT key FROM delaywheel.cancellations WHERE key IS NOT NULL)"
SAMPLES = {
    "near": "SELECT key FROM delaywheel.wheel w WHERE key LIKE 'backdrop-%%'"
    + _UNCANCELLED.format("key")
    + " ORDER BY random() LIMIT %s",
    "far": "SELECT k FROM delaywheel.wheel_far_segments, unnest(keys) u(k) WHERE k LIKE 'backdrop-%%'"
    + _UNCANCELLED.format("k")
    + " ORDER BY random() LIMIT %s",
}


def _before() -> types.ModuleType:
    """The cancel module as it was before issue 19's change (commit 990e562: the lanes' locks, the lookup planned
    per call), loaded beside the current one, for an interleaved comparison on the same store. That commit's package
    (the flat layout, before the subpackages) is extracted to a temporary directory and imported as
    `delaywheel_before`, without its __init__ (it would import that whole store): its modules import each other
    relatively, so the old cancel runs on the old helpers it was measured with."""
    name = "delaywheel_before"
    if name not in sys.modules:
        root = Path(tempfile.mkdtemp(prefix="cancel-bench-before-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        archive = subprocess.run(
            ["git", "archive", BEFORE, "plugins/delaywheel"],
            check=True,
            capture_output=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        package = types.ModuleType(name)
        package.__path__ = [str(root / "plugins" / "delaywheel")]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.cancel")


BEFORE = "990e562"


def old_cancel(store: Store, key: str) -> list:  # type: ignore[type-arg]
    return _OLD.cancel(store.conn, store._cache, key=key, reason="bench")


# The baseline a cancel's latency is read against: a durable single-row INSERT (autocommit) on the same server,
# interleaved with the cancels. Beside busy loops every durable commit waits for a scheduler tick, and this shows it.
BASELINE_TABLE = "CREATE TABLE bench_insert (id bigserial PRIMARY KEY, key text NOT NULL)"
BASELINE_INSERT = "INSERT INTO bench_insert (key) VALUES (%s)"


def latency(store: Store, other: psycopg.Connection, per_lane: int, pause_s: float = 0.0) -> list[str]:
    """cancel(key=…) latency by lane. `pause_s`: a pause after each call, as a payment handler's cancels come one at a
    time rather than back to back (an idle CPU then wakes for each, and its caches are cold)."""
    lines = []
    other.execute(BASELINE_TABLE)
    for lane, sample in SAMPLES.items():
        keys = [k for (k,) in other.execute(sample, (2 * per_lane,))]  # type: ignore[arg-type]
        if not keys:  # the near-only profile has no far timers
            continue
        new, old, steps = [], [], {"find": [], "mark and settle": []}  # type: ignore[var-annotation]
        for i, key in enumerate(keys):
            started = time.perf_counter()
            if i % 2:
                outcome = [r.outcome for r in store.cancel(key=key)]
                new.append(1000 * (time.perf_counter() - started))
            else:
                outcome = [r.outcome for r in old_cancel(store, key)]
                old.append(1000 * (time.perf_counter() - started))
            if outcome != ["cancelled"]:
                raise RuntimeError(f"cancel {key}: {outcome}")
            time.sleep(pause_s)
        # The library's cancel (one statement) against its two-step way (find; then mark and settle: what it does when
        # a cancellations partition is missing, and what it did before), key by key; not beside the code before (with
        # far timers pending the old cancel, planning over every partition, slowed the call after it by 0.4-1.3 ms).
        one_call: list[float] = []
        two_steps: list[float] = []
        inserts: list[float] = []
        for i, key in enumerate([k for (k,) in other.execute(sample, (2 * per_lane,))]):  # type: ignore[arg-type]
            t = [time.perf_counter()]
            if i % 2:
                outcome = [r.outcome for r in store.cancel(key=key)]
                one_call.append(1000 * (time.perf_counter() - t[0]))
            else:
                params = key_params(key)
                found = find(store.conn, "key", params)
                t.append(time.perf_counter())
                outcome = [r.outcome for r in mark_and_settle(store.conn, store._cache, "key", params, found, "bench")]
                t.append(time.perf_counter())
                for name, a, b in zip(steps, t, t[1:], strict=False):
                    steps[name].append(1000 * (b - a))
                two_steps.append(1000 * (t[-1] - t[0]))
            if outcome != ["cancelled"]:
                raise RuntimeError(f"cancel {key}: {outcome}")
            time.sleep(pause_s)
            started = time.perf_counter()
            other.execute(BASELINE_INSERT, (key,))
            inserts.append(1000 * (time.perf_counter() - started))
            time.sleep(pause_s)
        lines.append(
            f"- {lane} timer, cancel(key=…), {len(new)} calls: p50 {statistics.median(new):.2f} ms, "
            f"p99 {pct(new, 0.99):.2f} ms; the code before (990e562: lanes' locks), {len(old)} calls "
            f"interleaved: p50 {statistics.median(old):.2f} ms, p99 {pct(old, 0.99):.2f} ms; not beside it, "
            f"{len(one_call)} calls: p50 {statistics.median(one_call):.2f} ms, p99 {pct(one_call, 0.99):.2f} ms; "
            f"interleaved with those, its two-step way (find; mark and settle), {len(two_steps)} calls: p50 "
            f"{statistics.median(two_steps):.2f} ms, p99 {pct(two_steps, 0.99):.2f} ms, steps p50: "
            + ", ".join(f"{n} {statistics.median(v):.2f} ms" for n, v in steps.items())
            + f"; a durable single-row INSERT after each of those, {len(inserts)} calls: p50"
            f" {statistics.median(inserts):.2f} ms, p99 {pct(inserts, 0.99):.2f} ms (the cancel's p50 x"
            f"{statistics.median(one_call) / statistics.median(inserts):.2f} it)"
            + (f"; {1000 * pause_s:.0f} ms pause after every call" if pause_s else "")
        )
    other.execute("DROP TABLE bench_insert")
    return lines


def explain(store: Store, other: psycopg.Connection, verbose: bool = False) -> list[str]:
    (key,) = other.execute(SAMPLES["near"], (1,)).fetchone()  # type: ignore[misc]
    params = key_params(key)
    query = cancel_module._FIND_ONE["key"]  # the library's lookup, its parameters numbered for PREPARE
    for i, name in enumerate(params, 1):
        query = query.replace(f"%({name})s", f"${i}")
    execute = sql.SQL("EXECUTE look({})").format(sql.SQL(", ").join(sql.Literal(v) for v in params.values()))
    plan_settings = sql.SQL("SELECT {}, set_config('plan_cache_mode', %s, true)").format(sql.SQL(FIND_PLAN))
    lines = []
    with psycopg.connect(store.url, autocommit=True) as conn:
        conn.execute("PREPARE look(text, int8, int8, int[]) AS " + query)
        for mode in ("force_custom_plan", "force_generic_plan"):
            timings = []
            for _ in range(7):
                with conn.transaction():
                    conn.execute(plan_settings, (mode,))
                    plan = conn.execute(
                        sql.SQL("EXPLAIN (ANALYZE, SUMMARY, FORMAT JSON) {}").format(execute)
                    ).fetchone()[0][0]  # type: ignore[index]
                timings.append((plan.get("Planning Time", 0.0), plan["Execution Time"]))
            plan_ms = statistics.median(p for p, _ in timings)
            exec_ms = statistics.median(e for _, e in timings)
            lines.append(
                f"- EXPLAIN (ANALYZE, SUMMARY) of the lookup by key, {mode} (median of 7): planning "
                f"{plan_ms:.2f} ms, execution {exec_ms:.2f} ms"
            )
            if mode == "force_generic_plan" and verbose:
                with conn.transaction():
                    conn.execute(plan_settings, (mode,))
                    text = conn.execute(sql.SQL("EXPLAIN (ANALYZE, COSTS OFF) {}").format(execute)).fetchall()
                log("\n".join(r[0] for r in text))
        partitions = wheel_partitions(conn)
        far = conn.execute("SELECT count(*) FROM delaywheel.wheel_far_segments").fetchone()[0]  # type: ignore[index]
        lines.append(f"- near wheel: {partitions} partitions; far blocks: {far:,} segments")
    return lines


# --- Where a cancel's lookup goes (--parts) -----------------------------------------------------------------------
# The lookup's parts, each as its own prepared statement with the lookup's generic plan, timed key by key beside the
# whole lookup and an empty round trip; and one alternative for the near wheel, measured rather than argued: its keys
# in one table partitioned by due *day* (a few B-trees to probe instead of one per hour), filled by a statement
# trigger on `wheel` (so every writer of the wheel keeps it: COPY, send_one, the roll), at the price of a second row
# per keyed near message, which the near-timer sends below pay.
_NEAR_ROWS = sql.SQL("SELECT q.id, q.deliver_at, q.xid FROM {} q, delaywheel.wheel_state s WHERE q.key = %(v)s AND {}")
_UNUSED = sql.SQL(" AND %(h1)s::int8 IS NOT NULL AND %(h2)s::int8 IS NOT NULL AND %(slots)s::int[] IS NOT NULL")
_PARTS = {
    "round trip (no table)": sql.SQL("SELECT %(v)s, %(h1)s::int8, %(h2)s::int8, %(slots)s::int[]"),
    "near rows: hourly key indexes": _NEAR_ROWS.format(sql.Identifier("delaywheel", "wheel"), WHEEL_PENDING) + _UNUSED,
    "near rows: one key table by day (alternative)": _NEAR_ROWS.format(
        sql.Identifier("public", "wheel_keys"), WHEEL_PENDING
    )
    + _UNUSED,
    "far candidates: summaries and unfiltered segments": cancel_module._KEY_CANDIDATES
    + sql.SQL(" SELECT ranges FROM candidates WHERE %(v)s IS NOT NULL"),
    "whole lookup (the library's find)": sql.SQL(cancel_module._FIND_ONE["key"]),
}
_KEY_TABLE = """
CREATE TABLE public.wheel_keys (key text NOT NULL, id bigint NOT NULL, deliver_at timestamptz NOT NULL, xid xid8 NOT NULL)
    PARTITION BY RANGE (deliver_at);
CREATE INDEX ON public.wheel_keys (key);
DO $$ DECLARE d timestamptz; BEGIN
  FOR d IN SELECT generate_series(date_trunc('day', now(), 'UTC'), (SELECT max(deliver_at) FROM delaywheel.wheel),
                                  interval '1 day') LOOP  -- the near wheel's days, as a store would keep them
    EXECUTE format('CREATE TABLE public.%I PARTITION OF public.wheel_keys FOR VALUES FROM (%L) TO (%L)',
                   'wheel_keys_' || to_char(d AT TIME ZONE 'UTC', 'YYYYMMDD'), d, d + interval '1 day');
  END LOOP; END $$;
INSERT INTO public.wheel_keys SELECT key, id, deliver_at, xid FROM delaywheel.wheel WHERE key IS NOT NULL;
ANALYZE public.wheel_keys;
CREATE FUNCTION public.wheel_keys_add() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
    INSERT INTO public.wheel_keys SELECT a.key, a.id, a.deliver_at, a.xid FROM added a WHERE a.key IS NOT NULL;
    RETURN NULL;
END $f$;
"""
_TRIGGER = {
    True: "CREATE TRIGGER wheel_keys_add AFTER INSERT ON delaywheel.wheel REFERENCING NEW TABLE AS added"
    " FOR EACH STATEMENT EXECUTE FUNCTION public.wheel_keys_add()",
    False: "DROP TRIGGER IF EXISTS wheel_keys_add ON delaywheel.wheel",
}


def find_settings(conn: psycopg.Connection) -> None:
    """The find's planner settings (cancel.FIND_PLAN) and a generic plan, for the session rather than a transaction:
    parts timed as statements of their own run as the find runs them."""
    conn.execute(
        sql.SQL("SELECT {}, set_config('plan_cache_mode', 'force_generic_plan', false)").format(
            sql.SQL(FIND_PLAN.replace("true)", "false)"))
        )
    )


def parts(store: Store, other: psycopg.Connection, calls: int, sends: int) -> list[str]:
    """The lookup's parts (p50 of `calls` keys, interleaved), and near-timer send_many with and without the
    alternative's trigger (`sends` calls of 20,000 each, alternating)."""
    other.execute(_KEY_TABLE)
    keys = [k for (k,) in other.execute(SAMPLES["near"], (calls + 20,))]  # type: ignore[arg-type]
    times: dict[str, list[float]] = {name: [] for name in _PARTS}
    with psycopg.connect(store.url, autocommit=True) as conn:
        find_settings(conn)
        order = list(_PARTS.items())
        for i, key in enumerate(keys):
            params = key_params(key)
            # rotated key by key: the first statement after a pause runs slower (a backend woken, caches cold)
            for name, query in order[i % len(order) :] + order[: i % len(order)]:
                started = time.perf_counter()
                conn.execute(query, params, prepare=True).fetchall()
                if i >= 20:  # the first executions prepare and plan
                    times[name].append(1000 * (time.perf_counter() - started))
    lines = [
        f"- lookup by key of a near timer, its parts as prepared statements (generic plan), p50 of {calls} keys: "
        + "; ".join(f"{name} {statistics.median(v):.2f} ms" for name, v in times.items())
    ]
    first = store.clock() + timedelta(minutes=1)
    sent: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * sends + 2):
        with_table = bool(i % 2)
        other.execute(_TRIGGER[with_table])
        batch = [
            Message("bench.near", body(0), deliver_at=first + timedelta(seconds=(j * 7) % (40 * 3600)), key=f"n{i}-{j}")
            for j in range(20_000)
        ]
        started = time.perf_counter()
        store.send_many(batch)
        if i >= 2:
            sent[with_table].append(time.perf_counter() - started)
    other.execute(_TRIGGER[False])
    without, with_ = (1e6 * statistics.median(sent[k]) / 20_000 for k in (False, True))
    lines.append(
        f"- send_many of 20,000 near timers with keys, {sends} calls each, alternating: {without:.2f} us a message "
        f"today, {with_:.2f} us with the key table's trigger ({with_ / without:.2f} x)"
    )
    return lines


# --- The far-key summaries from their index (--parts) -----------------------------------------------------------------
# migrations/024 reads the summaries a lookup tests from a B-tree that carries their filters (an index-only scan).
# Before, each was a heap page of its own: the same rows through a bitmap heap scan, which a connection with
# index-only scans off reads the same way. Both connections on the same store, key by key, alternating which goes first.
def summary_reads(store: Store, other: psycopg.Connection, calls: int) -> list[str]:
    """The far candidates and the whole find, read as before migrations/024 and now, p50 of `calls` keys a lane."""
    candidates = cancel_module._KEY_CANDIDATES + sql.SQL(" SELECT ranges FROM candidates WHERE %(v)s IS NOT NULL")
    queries = {"far candidates": candidates, "whole lookup": sql.SQL(cancel_module._FIND_ONE["key"])}
    conns = {}
    for name, index_only in (("heap pages (before)", "off"), ("index-only (now)", "on")):
        conn = psycopg.connect(store.url, autocommit=True)
        find_settings(conn)
        conn.execute(sql.SQL("SET enable_indexonlyscan = {}").format(sql.SQL(index_only)))
        conns[name] = conn
    figures = []
    try:
        for lane in ("near", "far"):
            keys = [k for (k,) in other.execute(SAMPLES[lane], (calls + 20,))]  # type: ignore[arg-type]
            for what, query in queries.items():
                times: dict[str, list[float]] = {name: [] for name in conns}
                for i, key in enumerate(keys):
                    order = list(conns.items())
                    for name, conn in order if i % 2 else order[::-1]:
                        started = time.perf_counter()
                        conn.execute(query, key_params(key), prepare=True).fetchall()
                        if i >= 20:  # the first executions prepare and plan
                            times[name].append(1000 * (time.perf_counter() - started))
                before, now = (statistics.median(v) for v in times.values())
                figures.append(f"{what}, {lane} timer: {before:.2f} / {now:.2f} ms ({now / before:.2f} x)")
    finally:
        for conn in conns.values():
            conn.close()
    return [
        f"- far-key summaries read as heap pages (before migrations/024) / from their index (now), p50 of {calls} keys"
        " each, interleaved: " + "; ".join(figures)
    ]


# --- A segment's messages read by position (--parts) ----------------------------------------------------------------
# Before migrations/032 the find unnested every segment that may hold the key (its filter let the key through, or its
# keys held it: `@>`) and tested each row; now it reads the key's positions in the segment and those elements alone
# (pending.segment_elements). The find as it was is the same builder without the positions.
def _find_unnested() -> str:
    """The find by key as before migrations/032: the segments' filter, then their keys, then every row unnested."""
    first, _, rows, _ = cancel_module._LOOKUP["key"]
    segments = sql.SQL("int8range(s.id_first, s.id_last, '[]') && (SELECT ranges FROM candidates) AND {}").format(
        cancel_module._MAY_HOLD_KEY
    )
    return cancel_module._find_one(first, segments, rows)


def segment_reads(store: Store, other: psycopg.Connection, calls: int) -> list[str]:
    """The find by key with segments unnested (before migrations/032) and read by position (now), interleaved key by
    key on one connection, p50 of `calls` keys a lane; the two answer the same (checked key by key)."""
    queries = {"unnested (before)": _find_unnested(), "by position (now)": cancel_module._FIND_ONE["key"]}
    figures = []
    with psycopg.connect(store.url, autocommit=True) as conn:
        find_settings(conn)
        for lane in ("near", "far"):
            keys = [k for (k,) in other.execute(SAMPLES[lane], (calls + 20,))]  # type: ignore[arg-type]
            times: dict[str, list[float]] = {name: [] for name in queries}
            for i, key in enumerate(keys):
                order = list(queries.items())
                answers = []
                for name, query in order if i % 2 else order[::-1]:
                    started = time.perf_counter()
                    answers.append(sorted(conn.execute(query, key_params(key), prepare=True).fetchall()))
                    if i >= 20:  # the first executions prepare and plan
                        times[name].append(1000 * (time.perf_counter() - started))
                if answers[0] != answers[1]:
                    raise AssertionError(f"the two finds differ for key {key!r}: {answers}")
            before, now = (statistics.median(v) for v in times.values())
            figures.append(f"{lane} timer: {before:.2f} / {now:.2f} ms ({now / before:.2f} x)")
    return [
        f"- the find by key with its segments unnested (before migrations/032) / read by position (now), p50 of {calls}"
        " keys each, interleaved: " + "; ".join(figures)
    ]


# --- The lookup's relation locks (--parts) ----------------------------------------------------------------------------
# The lookup opens every near partition and far day with the index it probes: a few hundred relations, each
# locked (ACCESS SHARE) for the statement's transaction. A backend keeps 16 such locks in its fast-path slots; the
# rest go through the shared lock table. Timed as the lookup run again in the transaction that already holds them.
def relation_locks(store: Store, other: psycopg.Connection, calls: int) -> list[str]:
    """The lookup by key of a near timer, p50 of `calls` keys: run fresh, and run again with its locks held."""
    query = sql.SQL(cancel_module._FIND_ONE["key"])
    keys = [k for (k,) in other.execute(SAMPLES["near"], (calls + 20,))]  # type: ignore[arg-type]
    times: dict[str, list[float]] = {"fresh": [], "locks held": []}
    with psycopg.connect(store.url, autocommit=True) as conn:
        find_settings(conn)
        for i, key in enumerate(keys):
            params = key_params(key)
            started = time.perf_counter()
            conn.execute(query, params, prepare=True).fetchall()
            fresh = time.perf_counter() - started
            with conn.transaction():
                conn.execute(query, params, prepare=True).fetchall()
                started = time.perf_counter()
                conn.execute(query, params, prepare=True).fetchall()
                held = time.perf_counter() - started
                (locks,) = conn.execute(  # type: ignore[misc]
                    "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
                    " AND relation <> 'pg_locks'::regclass"
                ).fetchone()
            if i >= 20:  # the first executions prepare and plan
                times["fresh"].append(1000 * fresh)
                times["locks held"].append(1000 * held)
    fresh_ms, held_ms = (statistics.median(v) for v in times.values())
    return [
        f"- lookup by key of a near timer, {calls} keys: {locks} relations locked; p50 {fresh_ms:.2f} ms fresh, "
        f"{held_ms:.2f} ms with those locks already held ({fresh_ms - held_ms:.2f} ms taking them)"
    ]


def commit_cost(url: str, calls: int = 400) -> list[str]:
    """What a durable commit costs here, against one that does not wait for its WAL flush and a bare round trip:
    a cancel's mark commits, and beside busy loops that part grows while its lookup does not."""
    times: dict[str, list[float]] = {"on": [], "off": [], "SELECT 1": []}
    names = list(times)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.commit_cost (id bigserial PRIMARY KEY, v text)")
        for i in range(3 * (calls + 10)):
            name = names[i % 3]
            if name != "SELECT 1":
                conn.execute("SELECT set_config('synchronous_commit', %s, false)", (name,))
            started = time.perf_counter()
            conn.execute("SELECT 1" if name == "SELECT 1" else "INSERT INTO public.commit_cost (v) VALUES ('x')")
            if i >= 30:
                times[name].append(1000 * (time.perf_counter() - started))
        conn.execute("DROP TABLE public.commit_cost")
    return [
        f"- a one-row INSERT, committed, {calls} calls each, interleaved: synchronous_commit on p50 "
        f"{statistics.median(times['on']):.3f} ms, off {statistics.median(times['off']):.3f} ms; SELECT 1 "
        f"{statistics.median(times['SELECT 1']):.3f} ms"
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process (a PostgreSQL backend of the embedded cluster, say)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """The whole machine's CPU use over a run, sampled from /proc/stat every 0.5 s: busy share of all cores, and
    runnable tasks (/proc/loadavg's fourth field)."""

    def __init__(self) -> None:
        self.busy: list[float] = []
        self.runnable: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _times() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    def _sample(self) -> None:
        total, idle = self._times()
        while not self._stop.wait(0.5):
            t, i = self._times()
            self.busy.append(1 - (i - idle) / max(t - total, 1))
            total, idle = t, i
            self.runnable.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))

    def __enter__(self) -> MachineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# With `--pin`: the deliverer and its backend on the first core, the producer, the cancel processes and their backends
# on the second (the machine has two): the deliverer's CPU is its own, as on a server whose clients run elsewhere.
DELIVERER_CPUS, OTHERS_CPUS = {0}, {1}


def die_with_parent() -> None:
    """End this spawned process when the bench does, however it ends: the deliverer reconnects after losing its
    connection (runner.run), so one left by a bench killed mid-run went on delivering in the next run's database,
    which has the same name (prctl PR_SET_PDEATHSIG, Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def pin(backend: int, cpus: set[int] | None) -> None:
    """Run the calling thread (a process's only one, or the producer's) and its backend on `cpus` (None: anywhere)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
        os.sched_setaffinity(backend, cpus)


@contextlib.contextmanager
def failure_reported(outbox: Queue) -> Iterator[None]:  # type: ignore[type-arg]
    """A worker process's failure put in `outbox` as its text, in place of its report (and raised): the run ends
    with the reason (collect, race) instead of waiting for a report that will not come."""
    try:
        yield
    except BaseException as exc:
        outbox.put(repr(exc))
        raise


def cancel_worker(
    url: str,
    seconds: float,
    per_worker: float,
    window: tuple[float, float],
    seed: int,
    inbox: Queue,
    outbox: Queue,
    before: bool,
    nice: int = 0,
    cpus: set[int] | None = None,
    stand_in: StandIn = "",
) -> None:  # type: ignore[type-arg]
    """One cancelling process with its own connection: cancels by key, at `per_worker` a second, timers due within
    `window` seconds of now, each key once, from the keys the producer hands it; reports its answers, latencies
    and CPU seconds over its run (its own and its backend's). With `nice`, this process and its backend run at that
    niceness (the backend reniced from here: the bench runs as root or as the cluster's user), so they take the CPU
    the deliverer leaves: as cancels from application servers would, whose CPU is not the database's. With `cpus`,
    this process and its backend run on those cores only (pin). `stand_in`, a diagnostic in place of the cancels:
    'floor', one durable single-row INSERT into `FLOOR_TABLE` per key, nothing cancelled; 'floor, not durable', the
    same INSERT committed without waiting for its WAL flush (synchronous_commit off). (An 'unwaited' stand-in,
    cancels that skipped their wait for the passes in flight, patched the pipeline that migrations/027 replaced.)"""
    die_with_parent()
    rng = random.Random(seed)
    # The keys handed over, by due time (a heap), and those within the window, picked at random and each taken out in
    # constant time: this bookkeeping is the bench's, not a cancel's, yet shares the two cores with the deliverer, so
    # it must cost next to nothing (a scan and a linear remove per pick cost 0.8 ms a cancel: DESIGN, "Cancellation").
    coming: list[tuple[float, str]] = []
    near: list[tuple[str, float]] = []
    answers: list[tuple[int | None, str]] = []
    cancel_ms: list[float] = []
    with failure_reported(outbox), Store(url) as own:
        cancel = floor_write if stand_in else _before().cancel if before else cancel_module.cancel
        if stand_in == "floor, not durable":
            own.conn.execute("SET synchronous_commit = off")
        backend = own.conn.info.backend_pid
        pin(backend, cpus)
        for pid in (0, backend) if nice else ():  # this process, and its backend
            os.setpriority(os.PRIO_PROCESS, pid, nice)
        cpu_start, backend_start = time.process_time(), cpu_seconds(backend)
        done, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            with contextlib.suppress(queue.Empty):
                while True:
                    for key, due in inbox.get_nowait():
                        heapq.heappush(coming, (due, key))
            now = time.time()
            while coming and coming[0][0] - now < window[1]:
                due, key = heapq.heappop(coming)
                near.append((key, due))
            near = [(k, due) for k, due in near if due - now > window[0]]  # those past the window are left
            for _ in range(min(len(near), 20)):
                i = rng.randrange(len(near))
                near[i], near[-1] = near[-1], near[i]
                key, due = near.pop()
                t = time.perf_counter()
                results = cancel(own.conn, own._cache, key=key, reason="bench")
                cancel_ms.append(1000 * (time.perf_counter() - t))
                answers.extend((r.message_id, r.outcome) for r in results)
                done += 1
                time.sleep(max(0.0, started + done / per_worker - time.monotonic()))
            if not near:
                time.sleep(0.01)
        outbox.put((answers, cancel_ms, time.process_time() - cpu_start, cpu_seconds(backend) - backend_start))


FLOOR_TABLE = sql.Identifier("bench_floor")
_FLOOR_INSERT = sql.SQL("INSERT INTO {} (key, reason) VALUES (%s, %s)").format(FLOOR_TABLE)


def floor_write(conn: psycopg.Connection, cache: object, *, key: str, reason: str) -> list[CancelResult]:
    """The floor's stand-in for a cancel (cancel_worker): one single-row INSERT, committed durably on its own (the
    connection commits each statement), into a table with no index; it answers nothing."""
    conn.execute(_FLOOR_INSERT, (key, reason), prepare=True)
    return []


def deliver_worker(
    url: str,
    seconds: float,
    before: bool,
    topic_summaries: float,
    ready: Event,
    stop: Event,
    outbox: Queue,  # type: ignore[type-arg]
    cpus: set[int] | None = None,
) -> None:
    """The deliverer in a process of its own, as `delaywheel deliver` runs (runner.run on the wheel): sends its
    backend's pid, then its passes, busy passes and passes that waited for their lane, or the error that ended it.
    `before`: the deliverer of 990e562 (try the lock, else busy: here a wait of 1 ms, the nearest the pass's CALL
    allows); `cpus`: see pin."""
    die_with_parent()
    with failure_reported(outbox):
        if before:  # as near to "try, else busy" as the pass's CALL allows (a lock_timeout of 0 waits for ever)
            lane_locks.LANE_WAIT = "1ms"
        runner.SUMMARIZE_TOPICS_EVERY_S = topic_summaries
        with Store(url) as own:
            pin(own.conn.info.backend_pid, cpus)
            outbox.put(own.conn.info.backend_pid)
            totals = runner.run(own, [None], seconds + 12, stop=stop, ready=ready.set)
        outbox.put((totals.passes, totals.busy_passes, totals.waited_passes))


def collect(outbox: Queue, procs: list[BaseProcess], timeout: float) -> list[tuple[object, ...]]:  # type: ignore[type-arg]
    """One report from each cancel process. A process that failed (its error, put in place of its report) or died
    without a report (killed) ends the run at once, named, instead of after `timeout` seconds of waiting."""
    reports: list[tuple[object, ...]] = []
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs):
        try:
            report = outbox.get(timeout=1)
        except queue.Empty:
            dead = [f"pid {p.pid} exit code {p.exitcode}" for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a cancel process died without reporting: {', '.join(dead)}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cancel processes did not report within {timeout:.0f} s") from None
            continue
        if isinstance(report, str):
            raise RuntimeError(f"a cancel process failed: {report}")
        reports.append(report)
    return reports


def race(
    url: str,
    seconds: float,
    rate: int,
    cancels: int,
    workers: int,
    window: tuple[float, float] = (-0.3, 1.0),
    label: str = "run",
    before: bool = False,
    summarize_every: float | None = None,
    nice: int = 0,
    pinned: bool = False,
    stand_in: StandIn = "",
) -> dict[str, object]:
    """One real-clock run; `cancels` = 0 is the baseline. The deliverer is a process of its own (deliver_worker: a
    thread of this process shared the interpreter with the producer and with the queues' feeder threads that hand the
    cancel processes their keys, which exist only in the runs with cancels); the producer is a thread of this
    process; the cancels come from `workers` processes (spawned), each handed its share of the
    keys sent, picking timers due within `window` seconds of now. With `summarize_every`, a thread also brings the
    BRIN summaries up to date that often (store.summarize; the deliverer does it every minute, and for the current
    topic partitions every `runner.SUMMARIZE_TOPICS_EVERY_S`, `--topic-summaries`): a cancel's search of the topics
    by key reads every row delivered since the last summary. `nice`: the cancel processes' and their backends'
    niceness (cancel_worker); `pinned`: the processes on cores of their own (pin, DELIVERER_CPUS); `stand_in`: what the
    cancel processes do instead of cancels (cancel_worker, a diagnostic)."""
    sent: dict[str, tuple[int, float]] = {}  # key -> (id, due as epoch seconds)
    errors: list[BaseException] = []
    topic = f"{TOPIC}.{label}"
    backends: dict[str, int] = {}  # backend pids of the deliverer and the producer
    backend_cpu: dict[str, float] = {}
    producing = threading.Event()
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    inboxes = [spawn.Queue() for _ in range(workers if cancels else 0)]
    outbox = spawn.Queue()

    def produce() -> None:
        rng = random.Random(1)
        try:
            with Store(url) as own:
                backends["producer"] = own.conn.info.backend_pid
                pin(own.conn.info.backend_pid, OTHERS_CPUS if pinned else None)
                producing.set()
                n, tick, started = 0, 0.02, time.monotonic()
                while time.monotonic() - started < seconds:
                    size = int(rate * tick)
                    clock = time.time()
                    delays = [rng.uniform(1, 10) for _ in range(size)]
                    keys = [f"{topic}-{n + j}" for j in range(size)]
                    ids = own.send_many(
                        [
                            Message(topic, body(n + j), key=k, delay=timedelta(seconds=d))
                            for j, (k, d) in enumerate(zip(keys, delays, strict=True))
                        ]
                    )
                    for k, i, d in zip(keys, ids, delays, strict=True):
                        sent[k] = (i, clock + d)
                    for w, inbox in enumerate(inboxes):
                        inbox.put(
                            [
                                (k, clock + d)
                                for j, (k, d) in enumerate(zip(keys, delays, strict=True))
                                if (n + j) % len(inboxes) == w
                            ]
                        )
                    n += size
                    time.sleep(max(0.0, started + (n / rate) - time.monotonic()))
                backend_cpu.update({name: cpu_seconds(pid) - backend_cpu[name] for name, pid in backends.items()})
        except BaseException as exc:
            errors.append(exc)

    def summarize() -> None:
        with Store(url) as own:
            while not stop.wait(summarize_every):
                own.summarize()

    if summarize_every:
        threading.Thread(target=summarize, daemon=True).start()
    if stand_in:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE TABLE {} (key text, reason text, at timestamptz DEFAULT now())").format(FLOOR_TABLE)
            )
    procs = [
        spawn.Process(
            target=cancel_worker,
            args=(
                url,
                seconds,
                cancels / len(inboxes),
                window,
                10 + w,
                inbox,
                outbox,
                before,
                nice,
                OTHERS_CPUS if pinned else None,
                stand_in,
            ),
        )
        for w, inbox in enumerate(inboxes)
    ]
    for p in procs:
        p.start()
    delivering: Queue = spawn.Queue()  # type: ignore[type-arg]
    deliverer = spawn.Process(
        target=deliver_worker,
        args=(
            url,
            seconds,
            before,
            runner.SUMMARIZE_TOPICS_EVERY_S,
            ready,
            stop,
            delivering,
            DELIVERER_CPUS if pinned else None,
        ),
    )
    deliverer.start()
    first = delivering.get(timeout=60)  # its backend's pid, or why it could not start
    if isinstance(first, str):
        raise RuntimeError(f"the deliverer failed: {first}")
    backends["deliverer"] = first
    ready.wait(30)
    producer = threading.Thread(target=produce)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    with MachineLoad() as load:
        producer.start()
        producing.wait(30)
        backend_cpu.update({name: cpu_seconds(pid) for name, pid in backends.items()})
        deliverer_cpu = -cpu_seconds(deliverer.pid)
        try:
            reports = collect(outbox, procs, seconds + 120)
        except RuntimeError:
            stop.set()  # the deliverer ends its run
            raise
        producer.join()
        deliverer_cpu += cpu_seconds(deliverer.pid)
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    for p in procs:
        p.join()
    time.sleep(11)  # the last timers fall due
    stop.set()
    totals = delivering.get(timeout=60)
    deliverer.join()
    if errors:
        raise errors[0]
    if isinstance(totals, str):
        raise RuntimeError(f"the deliverer failed: {totals}")
    answers = [a for r in reports for a in r[0]]
    cancel_ms = [ms for r in reports for ms in r[1]]
    cpu = {
        "this process (producer)": (cpu_after.ru_utime + cpu_after.ru_stime)
        - (cpu_before.ru_utime + cpu_before.ru_stime),
        "deliverer process": deliverer_cpu,
        "cancel processes": sum(r[2] for r in reports),
        "their backends": sum(r[3] for r in reports),
        **{f"{name}'s backend": value for name, value in backend_cpu.items()},
    }
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT message_id, extract(epoch FROM delivered_at - deliver_at) * 1000"
            " FROM delaywheel.topic_messages WHERE topic = %s",
            (topic,),
        ).fetchall()
    delivered = [m for m, _ in rows]
    late = [float(ms) for _, ms in rows]
    said_cancelled = {m for m, o in answers if o in ("cancelled", "already_cancelled")}
    said_delivered = {m for m, o in answers if o == "already_delivered"}
    ids = {i for i, _ in sent.values()}
    return {
        "sent": len(sent),
        "delivered": len(delivered),
        "duplicates": len(delivered) - len(set(delivered)),
        "missing": len(ids - set(delivered) - said_cancelled),
        "early": sum(1 for x in late if x < 0),
        "both": len(said_cancelled & set(delivered)),
        "false_delivered": len(said_delivered - set(delivered)),
        "late": late,
        "p50": pct(late, 0.5),
        "p99": pct(late, 0.99),
        "max": max(late, default=float("nan")),
        "passes": totals[0],
        "busy": totals[1],
        "waited": totals[2],
        "cancels": len(cancel_ms),
        "machine_busy": statistics.mean(load.busy) if load.busy else float("nan"),
        "runnable": statistics.mean(load.runnable) if load.runnable else float("nan"),
        "cpu": {name: value / seconds for name, value in cpu.items()},  # cores used on average
        "cancel_rate": len(cancel_ms) / seconds,
        "cancelled": len({m for m, o in answers if o == "cancelled"}),
        "already_delivered": len(said_delivered),
        "cancel_p50": pct(cancel_ms, 0.5),
        "cancel_p99": pct(cancel_ms, 0.99),
    }


def rounds(arms: list[tuple[str, int]], repeat: int) -> list[tuple[int, str, int]]:
    """The race runs: every arm once a round, in reverse order every other round (ABBA), so that a drift over the
    whole bench (the cluster warming, the host's other load) weighs on every arm alike."""
    return [(n, arm, cancels) for n in range(repeat) for arm, cancels in (arms if n % 2 == 0 else arms[::-1])]


def pooled(runs: list[tuple[int, str, dict[str, object]]]) -> list[str]:
    """Each arm over all its rounds: the lateness of all its runs pooled (a 60-s run's p99 is its 600th-slowest
    timer, and it moved from 1.1 to 3.0 ms between runs of the same arm), its runs' p99s, and the ratio to the arm
    without cancels: pooled, and round by round with their median."""
    lines = []
    by_arm: dict[str, list[tuple[int, dict[str, object]]]] = {}
    for n, arm, figures in runs:
        by_arm.setdefault(arm, []).append((n, figures))
    base = {n: f for n, f in by_arm.get("without cancels", [])}
    base_late = [x for f in base.values() for x in f["late"]]  # type: ignore[attr-defined]
    for arm, arm_runs in by_arm.items():
        late = [x for _, f in arm_runs for x in f["late"]]  # type: ignore[attr-defined]
        line = (
            f"- pooled, {arm}, {len(arm_runs)} runs, {len(late)} timers: lateness p50 {pct(late, 0.5):.1f} ms, "
            f"p99 {pct(late, 0.99):.1f} ms, max {max(late, default=float('nan')):.1f} ms; runs' p99 "
            + ", ".join(f"{f['p99']:.1f}" for _, f in arm_runs)
            + f" ms; busy passes {sum(f['busy'] for _, f in arm_runs)}"  # type: ignore[misc]
        )
        if arm != "without cancels" and base_late:
            ratios = [f["p99"] / base[n]["p99"] for n, f in arm_runs if n in base]  # type: ignore[operator]
            line += (
                f"; p99 {pct(late, 0.99) / pct(base_late, 0.99):.2f} x the pooled runs without cancels, round by round "
                + ", ".join(f"{x:.2f}" for x in ratios)
                + f" x (median {statistics.median(ratios):.2f})"
            )
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="pending timers = 10M x scale")
    parser.add_argument("--batch", type=int, default=20_000)
    parser.add_argument(
        "--near-only", action="store_true", help="every pending timer in the near wheel (order timeouts), not 30 days"
    )
    parser.add_argument("--per-lane", type=int, default=100, help="cancels timed per lane (near, far)")
    parser.add_argument(
        "--pause-ms", type=float, default=0.0, help="pause after each timed cancel (one at a time, not back to back)"
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--cancels", type=int, default=700)
    parser.add_argument("--workers", type=int, default=4, help="cancelling processes, a connection each")
    parser.add_argument("--summarize-every", type=float, help="seconds between BRIN summaries during a race run")
    parser.add_argument(
        "--topic-summaries",
        type=float,
        help="seconds between the deliverer's summaries of the current topic partitions (runner.SUMMARIZE_TOPICS_EVERY_S"
        ", 1 s; 3600 as before a70bfeb, when only the every-minute pass over every partition summarized them)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="race rounds: every arm once a round, the order reversed every other round; with more than one, each"
        " arm's lateness pooled over its runs and the ratios round by round",
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--plan", action="store_true", help="print the lookup's generic plan (EXPLAIN ANALYZE)")
    parser.add_argument("--skip-race", action="store_true")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time the lookup's parts, an alternative (a near key table), the far summaries read as before"
        " migrations/024 and now, the segments unnested as before migrations/032 and read by position now, and a"
        " durable commit",
    )
    parser.add_argument("--control", action="store_true", help="a run whose cancels race no pass (same load)")
    parser.add_argument("--before", action="store_true", help="a third race run with the code before (990e562)")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="a race run whose cancel processes and their backends run at this niceness (1-19): the cancels' CPU"
        " given to the deliverer first, as cancels from other machines would leave it",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="a race run whose cancel processes make, instead of each cancel, one durable single-row INSERT at the"
        " same pace: the least any cancel must write, so the least slowdown any cancel mechanism could reach here",
    )
    parser.add_argument(
        "--floor-not-durable",
        action="store_true",
        help="a race run as --floor's whose INSERTs commit without waiting for their WAL flush (synchronous_commit"
        " off): what the other sessions' flushes, not their CPU, cost the deliverer",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="every race run with the deliverer and its backend on the first core, the producer, the cancel processes"
        " and their backends on the second: the deliverer's CPU its own",
    )
    args = parser.parse_args()
    global _OLD
    _OLD = _before()
    started = datetime.now(UTC)
    lines: list[str] = []
    try:
        if not args.skip_latency:  # (each race run makes a database of its own)
            url = fresh_database(DB)
            with Store(url) as store, psycopg.connect(url, autocommit=True) as other:
                store.prepare()
                n = int(10_000_000 * args.scale)
                log(f"1. fill {n:,} pending")
                t = time.perf_counter()
                fill_at_rest(store, other, n, args.batch, args.near_only)
                log(f"   {time.perf_counter() - t:.0f} s")
                lines += explain(store, other, args.plan)
                lines += latency(store, other, args.per_lane, args.pause_ms / 1000)
                lines += (
                    parts(store, other, args.per_lane, 5)
                    + summary_reads(store, other, args.per_lane)
                    + segment_reads(store, other, args.per_lane)
                    + relation_locks(store, other, args.per_lane)
                    + commit_cost(url)
                    if args.parts
                    else []
                )
                due = "all in the near wheel (up to near_until)" if args.near_only else "due 1 min - 30 days ahead"
                lines.insert(0, f"- pending: {n:,} timers (10M x {args.scale}), {due}")
                for line in lines:
                    log(line)
        arms = [("without cancels", 0), ("cancels", args.cancels)]
        arms += [("before", args.cancels)] if args.before else []
        arms += [("control", args.cancels)] if args.control else []
        arms += [("nice", args.cancels)] if args.nice else []
        arms += [("floor", args.cancels)] if args.floor else []
        arms += [("floor, not durable", args.cancels)] if args.floor_not_durable else []
        if args.topic_summaries is not None:
            runner.SUMMARIZE_TOPICS_EVERY_S = args.topic_summaries
        runs: list[tuple[int, str, dict[str, object]]] = []  # (round, arm, figures)
        for round_, arm, cancels in [] if args.skip_race else rounds(arms, args.repeat):
            log(f"2. race: {args.rate} msg/s, {cancels} cancels/s, {args.seconds:.0f} s, {arm}, round {round_ + 1}")
            control, before, nice = arm == "control", arm == "before", args.nice if arm == "nice" else 0
            # each run on a fresh database, so that none inherits the rows of the runs before it (a second
            # run with cancels in one database measured 10.2 ms p99 where the first had 7.8)
            url = fresh_database(DB)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CHECKPOINT")  # no run takes the dirty pages of the one before, or a timed checkpoint
            r = race(
                url,
                args.seconds,
                args.rate,
                cancels,
                args.workers,
                (5.0, 10.0) if control else (-0.3, 1.0),
                f"run{len(lines)}",
                before,
                args.summarize_every,
                nice,
                args.pin,
                arm if arm in get_args(StandIn) else "",  # the stand-ins' arms are named as they are
            )
            runs.append((round_, arm, r))
            baseline = next((f for n, a, f in runs if n == round_ and a == "without cancels"), None)
            line = (
                f"- {'code before (990e562): ' if before else ''}"
                f"{f'BRIN summaries every {args.summarize_every:g} s: ' if args.summarize_every else ''}"
                f"topic summaries every {runner.SUMMARIZE_TOPICS_EVERY_S:g} s: "
                f"{'control (cancels of timers due 5-10 s ahead, racing no pass): ' if control else ''}"
                f"{f'cancel processes and their backends at nice {nice}: ' if nice else ''}"
                f"{'floor, a durable single-row INSERT in place of each cancel: ' if arm == 'floor' else ''}"
                f"{'floor, not durable (synchronous_commit off): ' if arm == 'floor, not durable' else ''}"
                f"{'the deliverer pinned to a core of its own, the rest to the other: ' if args.pin else ''}"
                f"{args.rate} msg/s, {cancels} cancels/s asked ({r['cancel_rate']:.0f}/s done, "
                f"{r['cancels']} calls, p50 {r['cancel_p50']:.2f} ms, p99 {r['cancel_p99']:.2f} ms): "
                f"sent {r['sent']}, delivered {r['delivered']}, cancelled {r['cancelled']}, "
                f"already_delivered answers {r['already_delivered']}; lateness p50 {r['p50']:.1f} ms, "
                f"p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms; passes {r['passes']}, busy {r['busy']}, waited for the lane {r['waited']}; "
                f"duplicates {r['duplicates']}, missing {r['missing']}, early {r['early']}, "
                f"delivered and answered cancelled {r['both']}, already_delivered not delivered "
                f"{r['false_delivered']}; machine busy {100 * r['machine_busy']:.0f} % of 2 cores, "  # type: ignore[operator]
                f"{r['runnable']:.1f} runnable tasks on average; cores used: "
                + ", ".join(f"{name} {cores:.2f}" for name, cores in r["cpu"].items())  # type: ignore[attr-defined]
                + (
                    f"; lateness p99 {r['p99'] / baseline['p99']:.2f} x the run without cancels"  # type: ignore[operator]
                    if cancels and baseline
                    else ""
                )
            )
            log(line)
            lines.append(line)
        if args.repeat > 1:
            summary = pooled(runs)
            for line in summary:
                log(line)
            lines += summary
    finally:
        drop_database(DB)
    print(f"\n### cancel_bench, started {started:%Y-%m-%d %H:%M} UTC\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
