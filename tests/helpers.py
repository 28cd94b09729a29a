"""The tests' shared plain helpers, in one module: test modules import these from here and never from one another;
shared fixtures live in the conftest.py files (tests/, tests/airflow/, tests/spark/).

Nothing here imports Airflow or PySpark at import time: the store's tier (`make check`) imports this module too."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from hypothesis import strategies as st
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from delaywheel import Message, Settings, Store
from delaywheel.deliver import runner
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url

ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")


# --- servers and databases -------------------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing holds, for the servers a test starts (clusters, Airflow, pgbouncer, Redis,
    Spark). Below the kernel's ephemeral range (32768-60999): a port picked by binding to 0 comes from that range,
    where any client's connection may take it before the server given it binds (a CI run lost a port so). The start
    is random so that test runs side by side pick apart."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(embedded._free_port(ports[-1] + 1 if ports else 20000 + random.randrange(9000)))
    return ports


@contextlib.contextmanager
def fresh_database(server_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database cloned from the session's template; dropped afterwards."""
    name = f"dwtest_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    yield make_conninfo(server_url, dbname=name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def dbname(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])


# --- the store: clocks, rows, round trips, threads -------------------------------------------------------------------


def at(t: datetime, seconds: float) -> datetime:
    return t + timedelta(seconds=seconds)


class Background:
    """`fn()` on a thread; `result()` joins it. Where it should wait, a test says so with wait_for_lock on its backend:
    a thread merely not returned yet after a pause may not have got there (a loaded CI run once showed it)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.error:
            raise self.error
        return self.value


def wait_for_lock(conn: psycopg.Connection, pid: int, what: str, seconds: float = 10.0) -> None:
    """Until the backend `pid` waits for a lock (a test's thread blocked where the test means it to be); fails,
    naming `what`, after `seconds`."""
    deadline = time.monotonic() + seconds
    while conn.execute(
        "SELECT wait_event_type IS DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone() != (False,):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} never waited for a lock")
        time.sleep(0.01)


HOT_TABLES = ("level_queue", "wheel", "wheel_far", "topic_messages", "cancellations")


def table_counts(store: Store) -> dict[str, int]:
    """Rows in each hot table (through the partitioned parents): what a rejected send must leave at zero."""
    return {
        table: store.conn.execute(f"SELECT count(*) FROM delaywheel.{table}").fetchone()[0]  # type: ignore[index]
        for table in HOT_TABLES
    }


def deliveries(store: Store, topic: str | None = None) -> list[tuple[int, datetime, datetime, str]]:
    """(message_id, deliver_at, delivered_at, topic) of every delivery, in each topic's delivery order."""
    rows = store.conn.execute(
        "SELECT message_id, deliver_at, delivered_at, topic FROM delaywheel.topic_messages"
        " WHERE %(topic)s::text IS NULL OR topic = %(topic)s ORDER BY topic, xid, queue_offset",
        {"topic": topic},
    ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


@dataclass(frozen=True)
class Handled:
    """One message a test's consumer handled: by which consumer (`name`, e.g. "old0": the first of slot 0), when
    (monotonic seconds)."""

    message_id: int
    key: str | None
    name: str
    at: float


def check_slots_handed_over(seen: list[Handled], store: Store, topic: str, slots: int, max_gap: float) -> None:
    """Long-running consumers of one group in `slots` member slots, an old and a new one in each ("old<k>",
    "new<k>"; `seen` in handling order): every delivered message handled once, each key's in the topic's order; the
    old ones consumed side by side; in each slot the new one handled nothing before its predecessor's last message,
    and began within `max_gap` seconds of it."""
    order = [message_id for message_id, *_ in deliveries(store, topic)]
    assert sorted(h.message_id for h in seen) == sorted(order), "every message handled, none twice"
    position = {message_id: i for i, message_id in enumerate(order)}
    by_key: dict[str | None, list[int]] = {}
    for h in seen:
        by_key.setdefault(h.key, []).append(position[h.message_id])
    assert all(positions == sorted(positions) for key, positions in by_key.items() if key is not None), "key order"
    times = {name: [h.at for h in seen if h.name == name] for name in {h.name for h in seen}}
    olds = [times.get(f"old{k}", []) for k in range(slots)]
    assert all(olds), f"every old consumer handled some: {sorted((n, len(t)) for n, t in times.items())}"
    assert max(min(t) for t in olds) < min(max(t) for t in olds), "the old consumers consumed side by side"
    for k in range(slots):
        new = times.get(f"new{k}", [])
        assert new, f"slot {k}: the successor handled nothing"
        assert max(olds[k]) <= min(new), f"slot {k}: the successor handled a message while its predecessor consumed"
        gap = min(new) - max(olds[k])
        assert gap < max_gap, f"slot {k}: hand-over gap {gap:.2f}s"


def traced(conn: psycopg.Connection, call: Callable[[], T]) -> tuple[T, list[list[str]]]:
    """`call()`'s result, and the protocol messages it sent and received on `conn` (libpq's trace: per message, the
    side, F from the client or B from the server, its length and its type, e.g. Sync): each Sync the client sends is
    a round trip, a wake-up of the client and of its server process."""
    with tempfile.TemporaryFile("w+") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            result = call()
        finally:
            conn.pgconn.untrace()
        f.seek(0)
        lines = [line.split("\t")[:4] for line in f.read().splitlines() if line[:2] in ("F\t", "B\t")]
    return result, lines


def syncs(lines: list[list[str]]) -> int:
    """The round trips in `traced`'s lines: the Syncs the client sent."""
    return sum(1 for line in lines if line[0] == "F" and line[2] == "Sync")


def delivering(db_url: str, stop: threading.Event) -> threading.Thread:
    """A delivery loop for level 1 and the wheel on its own thread and Store, until `stop` is set."""

    def loop() -> None:
        with Store(db_url) as own:
            runner.run(own, [1, None], 120, stop=stop)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def number_paths(value: Any, path: str = "") -> dict[str, str]:
    """Every leaf's JSON type by path (list items merged), to compare two JSON documents' types."""
    if isinstance(value, dict):
        return {p: t for k, v in value.items() for p, t in number_paths(v, f"{path}.{k}").items()}
    if isinstance(value, list):
        return {p: t for v in value for p, t in number_paths(v, f"{path}[]").items()}
    return {path: type(value).__name__}


# --- message batches for property tests (tests/produce): every kind of good, bad and irregular field ----------------

NOW = datetime(2030, 1, 1, 12, 0, 0, 250_000, tzinfo=UTC)
# NOW is an injected clock far from the database's: said here, as this module is imported before tests/conftest.py
# sets DELAYWHEEL_TEST_CLOCK for the rest.
SETTINGS = Settings(max_body_bytes=64, test_clock=True)
YEAR = timedelta(days=365)

topics = st.sampled_from(
    ["orders", "orders.timeout", "%RETRY%g", "%DLQ%g", "", "bad topic", "x" * 128, "orders\n", "orders\x00"]
)
UNSTORABLE = st.sampled_from(["\x00", "a\x00", "\udcff", "\ud800\udc00"])  # NUL, lone surrogates (issue 18)
bodies = st.one_of(
    st.sampled_from([b"x" * 64, b"x" * 65, "é" * 32, "é" * 33]),
    st.binary(max_size=80),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.lists(st.integers(), max_size=4),
    st.text(max_size=10),
    st.just(object()),
    UNSTORABLE,
    st.dictionaries(UNSTORABLE, st.integers(), max_size=1),
    st.sampled_from(["\\u0000", [[[[]]]]]),
)
keys = st.one_of(st.sampled_from(["", "k" * 1024, "k" * 1025, None]), st.text(max_size=4), st.integers(), UNSTORABLE)
tags = st.one_of(st.none(), st.sampled_from(["created", "paid", "t" * 1024, "t" * 1025]), st.integers(), UNSTORABLE)
properties = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from(["1", "2"])),
    st.just({"a": 1}),
    st.just({1: "a"}),
    st.dictionaries(UNSTORABLE, st.just("1"), max_size=1),
    st.dictionaries(st.just("a"), UNSTORABLE, max_size=1),
    st.sampled_from(
        [
            {"ORIGIN_MESSAGE_ID": "1"},
            {"ORIGIN_TOPIC": "t", "a": "1"},
            {"REPLAY_ID": "r"},
            {"a": "v" * 32_758},
            {"a": "v" * 32_759},
            {"a": "é" * 5459},
        ]
    ),
)
levels = st.one_of(st.sampled_from([-1, 0, 18, 19, 2**31 - 1, 2**31, 2**63, 1.0, True, None]), st.integers(-1, 20))
# the edges of each rule, which random draws over a year would rarely hit
EDGES_DELAY = [
    timedelta(microseconds=-1),
    timedelta(0),
    -1,
    0,
    YEAR,
    YEAR + timedelta(microseconds=1),
    YEAR // timedelta(milliseconds=1),
    YEAR // timedelta(milliseconds=1) + 1,
    0.5,
    -0.0,
]
EDGES_AT = [
    NOW - SETTINGS.past_tolerance,
    NOW - SETTINGS.past_tolerance - timedelta(microseconds=1),
    NOW,
    NOW + YEAR,
    NOW + YEAR + timedelta(microseconds=1),
]
delays = st.one_of(
    st.sampled_from(EDGES_DELAY),
    st.timedeltas(-timedelta(seconds=2), YEAR + timedelta(days=1)),
    st.integers(-1, (YEAR // timedelta(milliseconds=1)) + 2000),
    st.floats(-1, 1e5),
    st.just(float("nan")),
)
times = st.one_of(
    st.sampled_from(EDGES_AT),
    st.datetimes(
        NOW.replace(tzinfo=None) - timedelta(days=1),
        NOW.replace(tzinfo=None) + YEAR + timedelta(days=1),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=-5))]),
    ),
    st.datetimes(NOW.replace(tzinfo=None), NOW.replace(tzinfo=None) + timedelta(days=1)),  # naive
)


FIELDS = ["topic", "body", "key", "tags", "properties", "when"]


@st.composite
def batches(draw: st.DrawFn) -> list[Message]:
    """Mostly one kind of delay per batch (the fast path's case), sometimes a mix; good fields except for at most one
    chosen field, which draws from everything (bad, irregular and good values): a second bad field would mask the
    first for any rule checked after it."""
    kind = draw(st.sampled_from(["level", "delay", "at", "none", "mixed"]))
    wild = draw(st.sampled_from([None, *FIELDS]))

    def pick(field: str, good: st.SearchStrategy[object], anything: st.SearchStrategy[object]) -> object:
        return draw(anything if field == wild else good)

    out = []
    for _ in range(draw(st.integers(1, 12))):
        k = draw(st.sampled_from(["level", "delay", "at", "none"])) if kind == "mixed" else kind
        when = {
            "level": lambda: {"delay_level": pick("when", st.integers(0, 20), levels)},
            "delay": lambda: {"delay": pick("when", st.timedeltas(timedelta(0), YEAR), delays)},
            "at": lambda: {
                "deliver_at": pick(
                    "when",
                    st.datetimes(
                        NOW.replace(tzinfo=None) - timedelta(seconds=1),
                        NOW.replace(tzinfo=None) + YEAR,
                        timezones=st.just(UTC),
                    ),
                    times,
                )
            },
            "none": lambda: {},
        }[k]()
        out.append(
            Message(
                pick("topic", st.sampled_from(["orders", "orders.timeout"]), topics),  # type: ignore[arg-type]
                pick("body", st.binary(max_size=64), bodies),
                key=pick("key", st.one_of(st.none(), st.text(min_size=1, max_size=4)), keys),  # type: ignore[arg-type]
                tags=pick("tags", st.sampled_from([None, "created"]), tags),  # type: ignore[arg-type]
                properties=pick("properties", st.sampled_from([None, {"a": "1"}]), properties),  # type: ignore[arg-type]
                **when,
            )
        )
    return out


# --- Airflow (imported inside the helpers that need it) --------------------------------------------------------------

USERS = {"admin": ("admin", "admin-pw"), "vera": ("viewer", "viewer-pw")}  # the plugin tests' API server logins


def connection_uri(db_url: str) -> str:
    """The test database as an Airflow connection URI (Airflow reads `AIRFLOW_CONN_<ID>` on every lookup)."""
    p = conninfo_to_dict(db_url)
    return f"postgresql://{p.get('user', 'postgres')}@{p.get('host', '127.0.0.1')}:{p.get('port', 5432)}/{p['dbname']}"


def token(client: Any, user: str) -> str:
    response = client.post("/auth/token", json={"username": user, "password": USERS[user][1]})
    assert response.status_code == 201, response.text
    return str(response.json()["access_token"])


def run_dag(dag: Any, **conf: Any) -> tuple[str, dict[str, str], dict[str, Any]]:
    """dag.test(); returns (run id, task states, XCom return values)."""
    from airflow.models import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    run = dag.test(run_conf=conf or None)
    with create_session() as session:
        states = {
            ti.task_id: ti.state
            for ti in session.scalars(
                select(TaskInstance).where(TaskInstance.dag_id == dag.dag_id, TaskInstance.run_id == run.run_id)
            )
        }
        values = {
            x.task_id: x.value
            for x in session.scalars(
                select(XComModel).where(
                    XComModel.dag_id == dag.dag_id, XComModel.run_id == run.run_id, XComModel.key == "return_value"
                )
            )
        }
    return run.run_id, states, values


def mapped_results(dag_id: str, run_id: str, task_id: str) -> dict[int, tuple[str, Any]]:
    """A mapped task's instances in a DAG run: per map index, (state, XCom return value)."""
    from airflow.models import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        states = {
            ti.map_index: ti.state
            for ti in session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id, TaskInstance.task_id == task_id
                )
            )
        }
        values = {
            x.map_index: x.value
            for x in session.scalars(
                select(XComModel).where(
                    XComModel.dag_id == dag_id,
                    XComModel.run_id == run_id,
                    XComModel.task_id == task_id,
                    XComModel.key == "return_value",
                )
            )
        }
    return {index: (state, values.get(index)) for index, state in states.items()}


def trigger_events(trigger, count: int, within_s: float) -> list:
    """Up to `count` events of one run of the trigger, collected for at most `within_s` seconds."""

    async def go():
        gen, got = trigger.run(), []
        try:
            while len(got) < count:
                got.append(await asyncio.wait_for(gen.__anext__(), within_s))
        except TimeoutError:
            pass
        finally:
            await gen.aclose()
        return got

    return asyncio.run(go())


# --- scripts/airflow.sh runs and their processes ---------------------------------------------------------------------

SCRIPT = ROOT / "scripts" / "airflow.sh"
LANES = {"deliver_level_1", "deliver_level_2", "advance_wheel"}  # DELAYWHEEL_LEVELS="1s 5s": two levels + the wheel


def script_env(home: Path, db_url: str, metadata_db: str) -> dict[str, str]:
    """The environment of a `scripts/airflow.sh` run of its own: AIRFLOW_HOME, metadata database, store and free
    loopback ports, two delay levels and the wheel (`LANES`), and nothing of the tests' own Airflow."""
    api_port, worker_log_port, trigger_log_port = free_ports(3)
    return {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {
        "DELAYWHEEL_DATABASE_URL": as_url(db_url),
        "DELAYWHEEL_AIRFLOW_HOME": str(home),
        "DELAYWHEEL_AIRFLOW_DB": metadata_db,
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
        "DELAYWHEEL_LEVELS": "1s 5s",
    }


def stat_fields(path: Path) -> list[str]:
    """A /proc/<pid>/stat's fields after "pid (comm) ": state ppid pgrp session ... (comm may hold spaces)."""
    stat = path.read_text()
    return stat[stat.rindex(")") + 2 :].split()


def processes() -> dict[int, tuple[str, int, str]]:
    """pid -> (working directory, session id, command line) of every process this user can see."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            fields = stat_fields(entry / "stat")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        if fields[0] == "Z":
            continue
        found[int(entry.name)] = (cwd, int(fields[3]), cmdline)
    return found


def ours(run_dir: Path, sessions: set[int]) -> dict[int, str]:
    return {
        pid: cmd
        for pid, (cwd, sid, cmd) in processes().items()
        if (cwd == str(run_dir) or sid in sessions) and pid != os.getpid()
    }


# --- Spark (the jobs in spark/; tests/spark/conftest.py puts that folder on sys.path) --------------------------------

SPARK_DIR = ROOT / "spark"  # the jobs' home (plugins/delaywheel/spark links to it)
# The pip package: bin/spark-submit and sbin/spark-daemon.sh, but no start-master.sh or start-worker.sh. Found
# without importing it.
SPARK_HOME = Path(str(importlib.util.find_spec("pyspark").origin)).parent  # type: ignore[union-attr]


@dataclass(frozen=True)
class SparkCluster:
    """A standalone cluster on loopback: its master URL, the master's web UI (and JSON) and the environment its
    daemons run in, which jobs are submitted from too."""

    master: str
    ui: str
    env: dict[str, str]

    def completed_apps(self) -> list[str]:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=10) as page:
            return [app["name"] for app in json.load(page)["completedapps"]]


def bulk_rows(t0: datetime) -> tuple[list[dict[str, str]], dict[int, str]]:
    """Good rows of every lane and one bad row per rule, as CSV-like text; returns (rows, row number -> reason)."""
    rows: list[dict[str, str]] = []
    bad: dict[int, str] = {}

    def add(reason: str | None = None, **values: str) -> None:
        rows.append(
            {
                "topic": "orders",
                "key": f"k{len(rows)}",
                "body": json.dumps({"n": len(rows)}),
                "delay_level": "",
                "deliver_at": "",
            }
            | values
        )
        if reason:
            bad[len(rows)] = reason

    for i in range(60):
        add(delay_level=str(i % 19))  # levels 0 (direct) .. 18
    for i in range(20):
        add(deliver_at=(t0 + timedelta(minutes=5 + i)).isoformat())  # the wheel
    add("bad_topic", topic="bad topic!", delay_level="3")
    add("bad_level", delay_level="soon")
    add("bad_level", delay_level="-2")
    add("too_far", deliver_at=(t0 + timedelta(days=400)).isoformat())
    add("naive_deliver_at", deliver_at="2030-01-01T00:10:00")
    add("bad_deliver_at", deliver_at="tomorrow")
    add("bad_body", body="{oops", delay_level="2")
    add("conflicting_delay", delay_level="2", deliver_at=(t0 + timedelta(minutes=1)).isoformat())
    add("bad_key", key="x" * 2000, delay_level="1")
    return rows, bad


def quarantine_rows(store: Store) -> dict[int, tuple[str, str]]:
    rows = store.conn.execute("SELECT row_number, reason, source_file FROM delaywheel.quarantine").fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def written(store: Store) -> int:
    """Messages written anywhere: the lanes plus direct deliveries."""
    return sum(
        store.conn.execute(f"SELECT count(*) FROM delaywheel.{t}").fetchone()[0]  # type: ignore[index]
        for t in ("level_queue", "wheel", "wheel_far", "topic_messages")
    )


BACKLOG_TOPIC = "orders"


def send_backlog(store: Store, t0: datetime, count: int) -> None:
    """Levels 1-18 and wheel times up to 2 hours out, all enqueued at t0 (the clock is injected)."""
    rng = random.Random(5)
    messages = []
    for i in range(count):
        if i % 4 == 0:
            due = t0 + timedelta(seconds=rng.randint(1, 7200), milliseconds=rng.randint(0, 999))
            messages.append(Message(BACKLOG_TOPIC, {"i": i}, deliver_at=due, key=f"m{i}"))
        else:
            messages.append(Message(BACKLOG_TOPIC, {"i": i}, delay_level=rng.randint(1, 18), key=f"m{i}"))
    for start in range(0, count, 1000):
        store.send_many(messages[start : start + 1000], now=t0)
