"""Several stores (issue 21 item 3): topics routed to two stores on two PostgreSQL clusters (the shared one's fresh
database, and a throwaway cluster of this module's own on another loopback port), by the hash and the routing table;
sends, deliveries, consumes and cancels each reach only the topic's store; the rule is stable and moves ~1/N of
topics when a store is added; the settings refuse malformed entries; the CLI's --store and routing by topic."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaywheel import Delivered, InvalidMessage, Message, Settings, Store
from delaywheel.cli import main
from delaywheel.config import ConfigError, load_settings, parse_routes, parse_stores
from delaywheel.dev import embedded
from delaywheel.dev.local_airflow import as_url
from delaywheel.migrate import migrate
from delaywheel.routing import Router, SendManyError, Stores, home, moved_topics
from tests.helpers import free_ports

pytestmark = pytest.mark.timeout(180)

TOPICS = [f"routing.t{i}" for i in range(40)]


@pytest.fixture(scope="module")
def second_cluster() -> Iterator[embedded.Cluster]:
    """A throwaway PostgreSQL cluster on a loopback port of its own (never the shared one), migrated; stopped after."""
    root = Path(tempfile.mkdtemp(prefix="delaywheel-store-b-", dir="/var/tmp"))
    root.chmod(0o755)  # the postgres user (we may be root) must reach it
    cluster = embedded.Cluster(root=root, port=free_ports(1)[0])
    embedded.start(cluster)
    try:
        migrate(cluster.url())
        yield cluster
    finally:
        embedded.stop(cluster)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store_b(second_cluster: embedded.Cluster) -> Iterator[str]:
    """A fresh database on the second cluster for one test (its own migrated database, dropped after)."""
    name = f"dwroute_{random.randrange(16**8):08x}"
    admin = second_cluster.admin_url()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE delaywheel")
    yield second_cluster.admin_url(name)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def two(db_url: str, store_b: str) -> dict[str, str]:
    """Store a: a fresh database on the shared cluster; store b: one on the second cluster (URL form, as configured)."""
    return {"a": as_url(db_url), "b": store_b}


def topic_counts(url: str) -> Counter[str]:
    with Store(url) as s:
        return Counter(
            dict(s.conn.execute("SELECT topic, count(*) FROM delaywheel.topic_messages GROUP BY topic").fetchall())
        )


def homed(store: str, names: tuple[str, ...] = ("a", "b"), among: list[str] = TOPICS) -> list[str]:
    return [t for t in among if home(t, names) == store]


def test_each_topic_lands_in_its_store_only_and_each_store_delivers_its_own(two: dict[str, str], t0: datetime) -> None:
    assert homed("a") and homed("b"), "40 topics over two stores: both get some"
    with Stores(two.items(), Settings(), routes=()) as stores:
        batch = [Message(t, {"i": i}, delay_level=1, key=f"{t}-{i}") for i in range(5) for t in TOPICS]
        ids = stores.send_many(batch, now=t0)
        assert len(ids) == len(batch)
        for t in TOPICS[:4]:
            stores.send(t, "now", now=t0)  # due at once: straight into the topic
        assert stores.deliver_due(now=t0 + timedelta(seconds=2)) == {"a": 5 * len(homed("a")), "b": 5 * len(homed("b"))}

        for name in ("a", "b"):
            counts = topic_counts(two[name])
            assert set(counts) == set(homed(name)), f"store {name} holds exactly its own topics"
            for t in homed(name):
                assert counts[t] == 5 + (t in TOPICS[:4])

        # consume through the routing: each topic from its store, all of it, once
        for t in (homed("a")[0], homed("b")[0]):
            seen: list[Delivered] = []
            totals = stores.consume(t, "g", seen.extend, idle_s=0.5, duration_s=20)
            assert list(totals) == [home(t, ("a", "b"))]
            assert sorted(m.body["i"] for m in seen if isinstance(m.body, dict)) == list(range(5))
            assert {m.topic for m in seen} == {t}
        pulled = stores.pull(homed("b")[1], "g")
        assert pulled.store == "b" and len(pulled.batch) == 5
        assert stores.ack(pulled).acked == 5
        assert len(stores.pull(homed("b")[1], "g").batch) == 0


def test_the_routing_table_moves_a_topics_new_sends_and_readers_follow(two: dict[str, str], t0: datetime) -> None:
    topic = homed("a")[0]
    with Stores(two.items(), Settings(), routes=()) as before:
        old_id = before.send(topic, {"n": "before"}, key="k1")
    with Stores(two.items(), Settings(), routes=[(topic, ("b",))]) as pinned:  # TOPIC=STORE wins over the hash
        assert pinned.for_topic(topic) is pinned.store("b")
        pinned.send(topic, {"n": "pinned"}, key="k2")
        assert pinned.router.sources(topic) == ("b",)
    assert topic_counts(two["a"])[topic] == 1 and topic_counts(two["b"])[topic] == 1

    moving = [(topic, ("a", "b"))]  # TOPIC=OLD>NEW: new sends to b, readers read both
    with Stores(two.items(), Settings(), routes=moving) as stores:
        stores.send(topic, {"n": "moving"}, key="k3", delay_level=1, now=t0)
        assert stores.deliver_due(now=t0 + timedelta(seconds=2)) == {"a": 0, "b": 1}
        assert stores.router.sources(topic) == ("b", "a")
        seen: list[Delivered] = []
        totals = stores.consume(topic, "g", seen.extend, idle_s=0.5, duration_s=20)  # one loop per store
        assert set(totals) == {"a", "b"} and totals["a"].messages == 1 and totals["b"].messages == 2
        assert sorted(m.body["n"] for m in seen if isinstance(m.body, dict)) == ["before", "moving", "pinned"]
        with pytest.raises(ValueError, match="without a limit"):
            stores.consume(topic, "g", seen.extend, limit=1)
        with pytest.raises(ValueError, match="needs the message's store"):  # ids are per store: a and b both number
            stores.cancel(message_id=old_id, topic=topic)
    with pytest.raises(ConfigError, match="not configured"):
        Stores(two.items(), Settings(), routes=[(topic, ("c",))])


def test_cancels_reach_the_store_that_holds_the_message(two: dict[str, str], t0: datetime) -> None:
    ta, tb = homed("a")[0], homed("b")[0]
    with Stores(two.items(), Settings(), routes=()) as stores:
        id_a = stores.send(ta, 1, key="shared", delay=timedelta(hours=1), now=t0)
        id_b = stores.send(tb, 2, key="shared", delay=timedelta(hours=1), now=t0)
        id_b2 = stores.send(tb, 3, key="by-id", delay=timedelta(hours=1), now=t0)
        with pytest.raises(ValueError, match="needs the message's store"):
            stores.cancel(message_id=id_b2)  # an id alone could name a message in each store
        assert [r.outcome for r in stores.cancel(message_id=id_b2, topic=tb)["b"]] == ["cancelled"]
        by_key = stores.cancel(key="shared")  # a key's messages may sit in any topic: every store is asked
        assert {name: [(r.message_id, r.outcome) for r in found] for name, found in by_key.items()} == {
            "a": [(id_a, "cancelled")],
            "b": [(id_b, "cancelled")],
        }
        assert stores.deliver_due(now=t0 + timedelta(hours=2)) == {"a": 0, "b": 0}


def test_a_batch_failing_in_one_store_says_what_the_others_committed(two: dict[str, str]) -> None:
    ta, tb = homed("a")[0], homed("b")[0]
    refused = Message(ta, 1, properties={"ORIGIN_MESSAGE_ID": "1"})  # a reserved property
    for batch in ([refused, Message(tb, 2)], [Message(tb, 2), refused]):  # whichever store's part holds it
        with Stores(two.items(), Settings(), routes=()) as stores, pytest.raises(InvalidMessage):
            stores.send_many(batch)  # refused before any store writes
    with Stores(two.items(), Settings(), routes=()) as stores, pytest.raises(InvalidMessage, match="Message values"):
        stores.send_many([Message(ta, 1), {"topic": tb}])  # type: ignore[list-item]
    assert topic_counts(two["a"])[ta] == 0 and topic_counts(two["b"])[tb] == 0
    broken = {**two, "b": "postgresql://nobody@127.0.0.1:1/none"}
    with Stores(broken.items(), Settings(), routes=()) as stores, pytest.raises(SendManyError) as failed:
        stores.send_many([Message(ta, 1), Message(tb, 2), Message(ta, 3)])
    assert failed.value.store == "b" and sorted(failed.value.sent) == [0, 2]
    assert topic_counts(two["a"])[ta] == 2


# The rule, without a database


def test_the_rule_is_the_same_in_another_process() -> None:
    here = {t: home(t, ("a", "b", "c")) for t in TOPICS}
    code = (
        "import json, sys; from delaywheel.routing import home; "
        "print(json.dumps({t: home(t, ('c', 'a', 'b')) for t in sys.argv[1:]}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *TOPICS],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert json.loads(out.stdout) == here  # another process, another hash seed, names in another order


def test_adding_a_third_store_moves_about_a_third_of_the_topics_all_to_it() -> None:
    topic_names = [f"orders.{i}" for i in range(3000)]
    moved = moved_topics(topic_names, ("a", "b"), ("a", "b", "c"))
    assert 0.30 < len(moved) / len(topic_names) < 0.37
    assert {new for _, new in moved.values()} == {"c"}
    assert Counter(home(t, ("a", "b", "c")) for t in topic_names).most_common()[-1][1] > 900  # balanced


@settings(max_examples=200, deadline=None)
@given(
    topic=st.from_regex(r"[%|A-Za-z0-9_.-]{1,127}", fullmatch=True),
    names=st.sets(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=6),
    extra=st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
)
def test_a_topic_moves_only_to_an_added_store_or_from_a_removed_one(topic: str, names: set[str], extra: str) -> None:
    before = home(topic, sorted(names))
    assert home(topic, sorted(names, reverse=True)) == before  # the order of the names does not matter
    after = home(topic, names | {extra})
    assert after in (before, extra)
    if len(names) > 1:
        removed = sorted(names)[0]
        assert home(topic, names - {removed}) == before or before == removed


def test_malformed_settings_are_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_stores("a=postgresql://u@h1:5432,h2:5432/db, b = postgres://x/y") == (
        ("a", "postgresql://u@h1:5432,h2:5432/db"),
        ("b", "postgres://x/y"),
    )  # a multi-host URL keeps its commas
    for text, reason in (
        ("a", "not NAME=postgresql"),
        ("A=postgresql://x", "lower-case"),
        ("a=postgresql://x,B=postgresql://y", "lower-case"),
        ("a=host=x dbname=y", "must start"),
        ("a=postgresql://x,a=postgresql://y", "named twice"),
        ("=postgresql://x", "not NAME"),
    ):
        with pytest.raises(ConfigError, match=reason):
            parse_stores(text)
    assert parse_routes("orders=b, audit.x=a>c,") == (("orders", ("b",)), ("audit.x", ("a", "c")))
    for text, reason in (
        ("orders", "not TOPIC=STORE"),
        ("bad topic=a", "not TOPIC=STORE"),
        ("o=B", "store names"),
        ("o=a>a", "twice"),
        ("o=a,o=b", "routed twice"),
        ("o=a>", "store names"),
    ):
        with pytest.raises(ConfigError, match=reason):
            parse_routes(text)
    with pytest.raises(ConfigError, match="not configured"):
        Router(["a"], [("o", ("b",))])
    with pytest.raises(InvalidMessage):
        Router(["a"]).store_for("bad topic")

    table = tmp_path / "routes.txt"
    table.write_text("# moves\norders=a>b\naudit=a  # pinned\n")
    monkeypatch.setenv("DELAYWHEEL_STORES", "a=postgresql://x/a,b=postgresql://y/b")
    monkeypatch.setenv("DELAYWHEEL_ROUTES", f"@{table}")
    loaded = load_settings()
    assert loaded.stores == (("a", "postgresql://x/a"), ("b", "postgresql://y/b"))
    assert loaded.routes == (("orders", ("a", "b")), ("audit", ("a",)))
    monkeypatch.setenv("DELAYWHEEL_ROUTES", f"@{tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings()


# The command line


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_the_cli_runs_on_a_named_store_or_routes_by_topic(
    two: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DELAYWHEEL_DATABASE_URL", raising=False)
    monkeypatch.setenv("DELAYWHEEL_STORES", ",".join(f"{n}={u}" for n, u in two.items()))
    ta = homed("a")[0]

    assert main(["--store", "b", "send", "--topic", ta, "--body", '"forced"', "--json"]) == 0
    assert _json(capsys) == {"message_id": _last_id(two["b"], ta), "store": "b"}
    assert main(["send", "--topic", ta, "--body", '"routed"', "--level", "1", "--key", "k", "--json"]) == 0
    sent = _json(capsys)
    assert sent["store"] == "a"  # type: ignore[index]
    assert topic_counts(two["b"])[ta] == 1 and topic_counts(two["a"])[ta] == 0

    assert main(["deliver", "--duration", "5s", "--until-idle"]) == 2  # no topic: which store?
    assert "--store NAME or all with --all-stores" in capsys.readouterr().err
    assert main(["--store", "c", "stats"]) == 2
    assert "not a configured store (a, b)" in capsys.readouterr().err
    assert main(["cancel", "--id", str(sent["message_id"])]) == 2  # type: ignore[index]
    assert "needs the message's store" in capsys.readouterr().err
    assert main(["cancel", "--key", "nothing-has-it", "--json"]) == 1  # every store asked, none held it
    assert _json(capsys) == [
        {"message_id": None, "outcome": "not_found", "store": "a"},
        {"message_id": None, "outcome": "not_found", "store": "b"},
    ]

    assert main(["--all-stores", "deliver", "--duration", "10s", "--until-idle", "--json"]) == 0
    delivered = _json(capsys)
    assert delivered["a"]["delivered"] == 1 and delivered["b"]["delivered"] == 0  # type: ignore[index]
    assert main(["pull", "--topic", ta, "--group", "g", "--ack", "--json"]) == 0
    assert [m["body"] for m in _json(capsys)] == ["routed"]  # type: ignore[union-attr]
    assert main(["--store", "b", "pull", "--topic", ta, "--group", "g", "--json"]) == 0
    assert [m["body"] for m in _json(capsys)] == ["forced"]  # type: ignore[union-attr]
    assert main(["--all-stores", "stats", "--json"]) == 0
    figures = _json(capsys)
    assert set(figures) == {"a", "b"}  # type: ignore[arg-type]
    assert {row["topic"] for row in figures["a"]["topics"]} == {ta}  # type: ignore[index]
    assert main(["--all-stores", "send", "--topic", ta, "--body", "1"]) == 2  # a topic command routes
    assert "only migrate, deliver, stats, retire and group retry-policy" in capsys.readouterr().err


def _last_id(url: str, topic: str) -> int:
    with Store(url) as s:
        row = s.conn.execute(
            "SELECT max(message_id) FROM delaywheel.topic_messages WHERE topic = %s", (topic,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_route_command_names_each_topics_store_and_what_a_new_store_would_take(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_STORES", "a=postgresql://x/a,b=postgresql://y/b")
    monkeypatch.setenv("DELAYWHEEL_ROUTES", f"{TOPICS[0]}=a>b")
    taken = moved_topics(TOPICS[1:], ("a", "b"), ("a", "b", "c"))
    assert main(["route", "--adding", "c", "--json", *(f"--topic={t}" for t in TOPICS)]) == 0
    rows = {row["topic"]: row for row in _json(capsys)}  # type: ignore[union-attr]
    assert rows[TOPICS[0]]["store"] == "b" and rows[TOPICS[0]]["sources"] == ["b", "a"]  # routed: never moved
    assert {t for t, row in rows.items() if "moves_to" in row} == set(taken)
    assert all(rows[t]["pin"] == f"{t}={old}" for t, (old, _) in taken.items())
    assert main(["route", "--topic", "%DLQ%billing"]) == 0  # a group's retry/DLQ topics: in every store
    assert capsys.readouterr().out == "%DLQ%billing\ta b\n"
    assert main(["route", "--topic", TOPICS[0]]) == 0
    assert capsys.readouterr().out == f"{TOPICS[0]}\tb a\n"  # moving: b now, a still holds some
    assert main(["route", "--adding", "a", "--topic", "x"]) == 2
    assert "not a new store's name" in capsys.readouterr().err
    monkeypatch.setenv("DELAYWHEEL_ROUTES", "%RETRY%g=a")
    assert main(["route", "--topic", "x"]) == 2
    assert "cannot be routed" in capsys.readouterr().err
