"""The Spark jobs with several stores (docs/stores.md): bulk enqueue sends each row to its topic's store, exactly once
and nowhere else, quarantines a bad row in the store its topic goes to (the first store when the topic itself is
bad), and a re-run adds nothing anywhere; catch-up works on one store's backlog (`--store`) or, with no store named,
on every store's, each overdue message delivered once in its own store. Two fresh databases on the shared cluster
stand for two stores: the jobs only need the URLs to differ."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import bulk_enqueue
import pyarrow as pa
import pytest
import redeliver

from delaywheel import Store
from delaywheel.batch import bulk
from delaywheel.batch.input_rows import ColumnMap
from delaywheel.config import ConfigError
from delaywheel.dev.local_airflow import as_url
from delaywheel.routing import Router, home
from tests.helpers import fresh_database

TOPICS = 40
ROWS = 3000
MESSAGES = (
    "SELECT key, topic, deliver_at FROM delaywheel.level_queue UNION ALL"
    " SELECT key, topic, deliver_at FROM delaywheel.wheel UNION ALL"
    " SELECT key, topic, deliver_at FROM delaywheel.wheel_far UNION ALL"
    " SELECT key, topic, deliver_at FROM delaywheel.topic_messages"
)


def hashed(topic: str) -> str:
    """The store the hash alone gives `topic`, of a and b."""
    return home(topic, ["a", "b"])


PINNED, MOVING = [t for t in (f"moved{n}" for n in range(200)) if hashed(t) == "a"][
    :2
]  # routed to b by the table: `PINNED=b`, `MOVING=a>b`
ROUTES = f"{PINNED}=b,{MOVING}=a>b"


@pytest.fixture
def two_stores(server_url: str, template_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Stores a and b (two fresh databases), configured as DELAYWHEEL_STORES with the routing table ROUTES."""
    with fresh_database(server_url, template_db) as a, fresh_database(server_url, template_db) as b:
        urls = {"a": as_url(a), "b": as_url(b)}
        monkeypatch.setenv("DELAYWHEEL_STORES", ",".join(f"{n}={u}" for n, u in urls.items()))
        monkeypatch.setenv("DELAYWHEEL_ROUTES", ROUTES)
        yield urls


@pytest.fixture(autouse=True)
def input_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DELAYWHEEL_INPUT_ROOTS", str(tmp_path))
    return tmp_path


def _input(path: Path, t0: datetime) -> tuple[dict[str, str], dict[int, tuple[str, str]]]:
    """ROWS rows over TOPICS topics plus the routed ones, levels 1-6 and the wheel, and four bad rows; returns
    (key -> topic of every good row, row number -> (store, reason) of every bad row)."""
    router = Router(["a", "b"], [(PINNED, ("b",)), (MOVING, ("a", "b"))])
    topics = [f"topic{n}" for n in range(TOPICS)] + [PINNED, MOVING]
    rows: list[dict[str, str]] = []
    good: dict[str, str] = {}
    for i in range(ROWS):
        topic = topics[i % len(topics)]
        wheel = i % 7 == 0
        rows.append(
            {
                "topic": topic,
                "key": f"k{i}",
                "body": json.dumps({"i": i}),
                "delay_level": "" if wheel else str(1 + i % 6),  # 1 s .. 2 min
                "deliver_at": (t0 + timedelta(seconds=30 + i % 300)).isoformat() if wheel else "",
            }
        )
        good[f"k{i}"] = topic
    b_topic = next(t for t in topics if router.store_for(t) == "b")
    a_topic = next(t for t in topics if router.store_for(t) == "a")
    bad = {
        "bad topic!": ("a", "bad_topic", {}),  # no store: the first one's quarantine
        "": ("a", "bad_topic", {}),  # no topic at all (an empty CSV field reads as null)
        b_topic: ("b", "bad_level", {"delay_level": "soon"}),  # the quarantine of the store its topic goes to
        a_topic: ("a", "bad_body", {"body": "{oops"}),
    }
    rejected = {}
    for n, (topic, (_, _, values)) in enumerate(bad.items()):
        rows.insert(100 + 500 * n, {**rows[1], "topic": topic, "key": f"bad{n}", **values})  # rows[1]: level 2
    for number, row in enumerate(rows, start=1):
        if row["key"].startswith("bad"):
            rejected[number] = next((s, r) for t, (s, r, _) in bad.items() if t == row["topic"])
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return good, rejected


def _messages(url: str) -> list[tuple[str, str, datetime]]:
    with Store(url) as store:
        return [(r[0], r[1], r[2]) for r in store.conn.execute(MESSAGES).fetchall()]


def _quarantine(url: str) -> dict[int, str]:
    with Store(url) as store:
        return dict(store.conn.execute("SELECT row_number, reason FROM delaywheel.quarantine").fetchall())


def _delivered(url: str) -> list[int]:
    with Store(url) as store:
        return [r[0] for r in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages").fetchall()]


def test_bulk_enqueue_routes_each_row_to_its_topic_store_once_then_catch_up_per_store(
    spark: object, two_stores: dict[str, str], t0: datetime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "orders.csv"
    good, rejected = _input(path, t0)
    router = Router(["a", "b"], [(PINNED, ("b",)), (MOVING, ("a", "b"))])
    argv = ["--input", str(path), "--now", t0.isoformat(), "--partitions", "3", "--chunk", "400"]

    first = bulk_enqueue.main(argv)

    assert (first.rows, first.enqueued, first.skipped, first.rejected) == (ROWS + 4, ROWS, 0, 4)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    landed = {name: _messages(url) for name, url in two_stores.items()}
    for name in ("a", "b"):
        keys = [key for key, _, _ in landed[name]]
        assert len(keys) == len(set(keys))  # once in its store
        assert {k: t for k, t, _ in landed[name]} == {k: t for k, t in good.items() if router.store_for(t) == name}
        assert printed["stores"][name]["enqueued"] == len(keys)
    assert 0.3 < len(landed["a"]) / ROWS < 0.7  # both stores take a share of the topics
    assert {t for _, t, _ in landed["b"]} >= {PINNED, MOVING}  # the routing table wins over the hash
    for name, url in two_stores.items():
        assert _quarantine(url) == {n: reason for n, (store, reason) in rejected.items() if store == name}

    again = bulk_enqueue.main(argv)

    assert (again.enqueued, again.skipped, again.rejected) == (0, ROWS, 4)
    for name, url in two_stores.items():
        assert sorted(_messages(url)) == sorted(landed[name])
        assert _quarantine(url) == {n: reason for n, (store, reason) in rejected.items() if store == name}

    # catch-up works on each store's own backlog: a's alone, then every store's (a has nothing left)
    outage_end = t0 + timedelta(minutes=1)
    due = {name: sum(1 for _, _, at in landed[name] if at <= outage_end) for name in two_stores}
    assert 0 < due["a"] < len(landed["a"]) and 0 < due["b"] < len(landed["b"])
    catch_up = ["--now", outage_end.isoformat(), "--mode", "catch-up", "--batch", "200"]

    only_a = redeliver.main(["--store", "a", *catch_up])

    assert only_a["delivered"] == due["a"] and "stores" not in only_a
    assert _delivered(two_stores["b"]) == []
    every = redeliver.main(catch_up)

    assert every["stores"]["a"]["delivered"] == 0
    assert every["stores"]["b"]["delivered"] == every["delivered"] == due["b"]
    for name, url in two_stores.items():
        ids = _delivered(url)
        assert len(ids) == len(set(ids)) == due[name]  # exactly once, in its own store


def test_split_sends_a_row_with_a_refused_topic_to_the_first_store() -> None:
    """A fixed topic sends every row to its store; a topic column that is not text, or a null or malformed topic,
    has no store: the first store's quarantine gets the row (it is refused there, with the reason)."""
    a_topic, b_topic = (next(f"topic{n}" for n in range(TOPICS) if hashed(f"topic{n}") == s) for s in "ab")
    rows = pa.record_batch({"topic": [a_topic, None, b_topic, "bad topic!", b_topic], "key": list("vwxyz")})

    split = bulk.StoreSplit(["b", "a"], [], ColumnMap({"topic": "topic", "key": "key"}))
    assert {name: part.column("key").to_pylist() for name, part in split.split(rows)} == {
        "a": ["v"],
        "b": ["w", "x", "y", "z"],  # b: the first configured store
    }
    fixed = bulk.StoreSplit(["a", "b"], [(a_topic, ("a", "b"))], ColumnMap({"key": "key"}, a_topic))
    assert [(name, part.num_rows) for name, part in fixed.split(rows)] == [("b", 5)]  # moving a>b: sent to b
    numbers = pa.record_batch({"topic": [1, 2], "key": ["p", "q"]})
    assert [(name, part.num_rows) for name, part in split.split(numbers)] == [("b", 2)]


def test_store_choices_refused_before_spark_starts(
    two_stores: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever would send rows or messages to a store their topic's consumers do not read, or leave the store to a
    guess, stops with the reason."""
    (tmp_path / "x.csv").write_text("topic,key\norders,1\n")
    b_topic = next(f"topic{n}" for n in range(TOPICS) if hashed(f"topic{n}") == "b")
    replay = "--mode replay --from 2030-01-01 --until 2030-01-02"
    refused = [
        (bulk_enqueue.main, f"--store a --input {tmp_path / 'x.csv'}", "bulk enqueue sends each row to its topic's"),
        (bulk_enqueue.main, f"--db-url {two_stores['a']} --input {tmp_path / 'x.csv'}", "give neither --db-url"),
        (redeliver.main, replay, "several stores are configured (a, b): name one with --store NAME"),
        (redeliver.main, "--store c --mode catch-up", "--store 'c': not a configured store"),
        (redeliver.main, f"--store a {replay} --target-topic {b_topic}", f"topic '{b_topic}' lives in store b, not"),
        (  # a moving topic's new timers go to its new store
            redeliver.main,
            f"--store a --mode reconcile --table t --key-column k --topic {MOVING} --delay-seconds 60",
            f"topic '{MOVING}' lives in store b, not 'a': run it with --store b",
        ),
    ]
    for main, argv, message in refused:
        with pytest.raises(SystemExit) as exit:
            main(argv.split())
        assert exit.value.code == 2
        assert message in capsys.readouterr().err, argv


@pytest.mark.airflow
def test_airflow_task_passes_every_store_at_its_connection(
    airflow_db: dict[str, str], two_stores: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Spark task's job gets DELAYWHEEL_STORES with each store's connection URL (`delaywheel_<name>`, where the
    deliver DAGs find it), and `--store` for a job on one store; with no stores, `--db-url` of delaywheel_default."""
    from delaywheel.airflow import spark

    monkeypatch.setenv("AIRFLOW_CONN_DELAYWHEEL_B", two_stores["b"] + "?connect_timeout=7")
    passed = spark._stores()["DELAYWHEEL_STORES"]
    assert passed.startswith(f"a={two_stores['a']},b=postgresql://")  # a: no connection here, its configured URL
    assert passed.split(",b=")[1].endswith("connect_timeout=7")  # b: its connection's
    assert spark.spark_job("r", "redeliver", [], store="b").application_args[:2] == ["--store", "b"]
    assert spark.spark_job("e", "bulk_enqueue", []).application_args[:2] == ["--store", spark.STORE_PARAM]
    monkeypatch.delenv("DELAYWHEEL_STORES")
    assert spark._stores() == {}
    assert spark.spark_job("r", "redeliver", []).application_args[:4] == [
        "--db-url",
        spark.DB_URL,
        "--store",
        spark.STORE_PARAM,  # empty unless the DAG's form has a `store` field
    ]
    with pytest.raises(ConfigError):
        spark.spark_job("r", "redeliver", [], store="b")
