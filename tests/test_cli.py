"""CLI smoke: send, deliver, pull, stats --json, cancel through `main(argv)` against the test database."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from delaywheel import Delivered, Settings, Store
from delaywheel.cli import build_parser, main
from delaywheel.consume.topics import dlq_topic
from delaywheel.locks import LEVEL_LOCK


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_cli_round_trip(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert main(["send", "--topic", "orders", "--body", '{"order": 1}', "--json"]) == 0
    now_id = _json(capsys)["message_id"]  # type: ignore[index]
    assert (
        main(["send", "--topic", "orders", "--body", "raw text", "--raw", "--level", "1", "--key", "k", "--json"]) == 0
    )
    level_id = _json(capsys)["message_id"]  # type: ignore[index]
    assert main(["send", "--topic", "orders", "--body", "2", "--in", "1h", "--key", "later", "--json"]) == 0
    later_id = _json(capsys)["message_id"]  # type: ignore[index]
    assert main(["send", "--topic", "orders", "--body", "{", "--json"]) == 2  # not JSON
    assert main(["send", "--topic", "bad topic", "--body", "1"]) == 2

    assert main(["cancel", "--key", "later", "--json"]) == 0
    assert _json(capsys) == [{"message_id": later_id, "outcome": "cancelled"}]
    assert main(["cancel", "--id", str(now_id)]) == 1  # already delivered
    assert "already_delivered" in capsys.readouterr().out

    assert main(["deliver", "--duration", "5s", "--until-idle", "--level", "1", "--json", "--progress-every", "1"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["delivered"] == 1

    assert main(["pull", "--topic", "orders", "--group", "g", "--ack", "--json"]) == 0
    pulled = _json(capsys)
    assert [m["message_id"] for m in pulled] == [now_id, level_id]  # type: ignore[union-attr]
    assert pulled[1]["body"] == "raw text"  # type: ignore[index]

    assert main(["stats", "--json"]) == 0
    stats = _json(capsys)
    assert stats["levels"][0]["delivered"] == 1  # type: ignore[index]
    assert {(t["topic"], t["consumer_group"], t["lag"]) for t in stats["topics"]} == {("orders", "g", 0)}  # type: ignore[index]
    assert main(["stats"]) == 0
    assert "wheel: pending 0" in capsys.readouterr().out


def test_pull_and_consume_print_a_message_as_the_same_json_object(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], t0: datetime
) -> None:
    """`pull --json` and `consume --json` print one message alike (cli.delivered_json): every field of Delivered
    and its idempotency_id, times in ISO 8601; a dead letter keeps ORIGIN_TOPIC and ORIGIN_MESSAGE_ID."""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    with Store(db_url, Settings(max_reconsume_times=0)) as store:
        original = store.send("orders", {"order": 1}, key="o-1", tags="paid", properties={"region": "eu"}, now=t0)
        store.send("raw", b"\xffbytes", now=t0)
        store.ack(store.pull("orders", "g"), failed={original})  # no retry allowed: straight to %DLQ%g
    for topic, group in (("orders", "g2"), ("raw", "g"), (dlq_topic("g"), "ops")):
        assert main(["pull", "--topic", topic, "--group", group, "--json"]) == 0  # not acked: consume gets it
        (pulled,) = _json(capsys)  # type: ignore[misc]
        assert main(["consume", "--topic", topic, "--group", group, "--json", "--count", "1", "--duration", "30s"]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        assert json.loads(line) == pulled
        assert pulled.keys() == {f.name for f in dataclasses.fields(Delivered)} | {"idempotency_id"}
        assert "T" in pulled["deliver_at"] and "T" in pulled["delivered_at"]
    assert pulled["properties"] == {"region": "eu", "ORIGIN_TOPIC": "orders", "ORIGIN_MESSAGE_ID": str(original)}
    assert (pulled["topic"], pulled["source_topic"], pulled["idempotency_id"]) == ("orders", dlq_topic("g"), original)


def test_cli_bad_input_is_exit_2_with_a_message(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scripts rely on the exit codes (docs/cli.md): bad input is 2 and a message on stderr, never a traceback.
    (Bulk cancel's guard codes are in test_cancel.py.)"""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert main(["cancel", "--where", "key ==== 'x'"]) == 2
    assert capsys.readouterr().err.startswith("delaywheel:")  # a message saying why (the predicate's checks)
    assert main(["deliver", "--level", "99", "--duration", "1s"]) == 2
    assert "level 99 is not configured" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["send", "--topic", "orders", "--body", "1", "--in", "99999999999d"])
    assert exited.value.code == 2
    assert "too large" in capsys.readouterr().err


def exit_code(argv: list[str]) -> int:
    """`main(argv)`'s exit code, whether argparse refused the arguments (SystemExit) or the command returned it."""
    try:
        return main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


@pytest.mark.parametrize("level", ["0", "99", "-1", str(2**63)])
def test_deliver_refuses_a_level_before_it_says_ready(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], level: str
) -> None:
    """A level that is not configured is refused with exit 2 and one plain line, before the loop starts: no ready
    line (a supervisor waiting for it would take the process for a working deliverer)."""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert exit_code(["deliver", "--level", "1", "--level", level, "--duration", "1s"]) == 2
    err = capsys.readouterr().err
    assert "ready" not in err and "Traceback" not in err, err
    assert f"--level {level}" in err.replace("argument --level: ", "--level ").replace("'", ""), err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["pull", "--topic", "t", "--group", "g", "--max", str(2**63)], "must be at most 1000000"),
        (["pull", "--topic", "t", "--group", "g", "--max", str(2**31 - 1)], "must be at most 1000000"),
        (["consume", "--topic", "t", "--group", "g", "--max", str(2**63)], "must be at most 1000000"),
        (["consume", "--topic", "t", "--group", "g", "--count", str(2**63)], f"must be at most {2**63 - 1}"),
        (["consume", "--topic", "t", "--group", "g", "--count", "0"], "must be at least 1"),
        (["send", "--topic", "t", "--body", "1", "--level", str(2**31)], f"must be at most {2**31 - 1}"),
        (["send", "--topic", "t", "--body", "1", "--level", "-1"], "must be at least 0"),
        (["send", "--topic", "t", "--body", "1", "--level", "x"], "is not a whole number"),
        (["cancel", "--id", str(2**63)], f"must be at most {2**63 - 1}"),
        (["cancel", "--id", "0"], "must be at least 1"),
    ],
)
def test_numbers_out_of_range_are_refused_while_parsing(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every numeric flag is bounded where the arguments are parsed: exit 2 and a plain message naming the bound,
    never the database's ("bigint out of range", as `pull --max 2**63` said). Parsed only: nothing runs, even if a
    bound is lost (a consumer would run on)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "out of range" not in err, err


def test_cli_never_shows_a_traceback_for_bad_input(db_url: str, server_url: str, tmp_path: Path) -> None:
    """The CLI as a user runs it (a subprocess): bad files, bad JSON, bad durations and times, a missing database,
    an unmigrated one, an unreachable server and a bad setting each give exit 2 and one line on stderr."""
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    unmigrated = f"dwtest_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {unmigrated}")
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    env.pop("DELAYWHEEL_TRACEBACK", None)
    cases: list[tuple[list[str], dict[str, str], str]] = [
        (["cancel", "--keys-from", "/nonexistent/keys.txt"], {}, "No such file or directory"),
        (["cancel", "--keys-from", str(tmp_path)], {}, "Is a directory"),
        (["cancel", "--keys-from", str(binary)], {}, "--keys-from"),
        (["send", "--topic", "t", "--body", "1", "--property", "foo"], {}, "'foo' is not K=V"),
        (["send", "--topic", "t", "--body", "{"], {}, "--body is not JSON"),
        (["send", "--topic", "t", "--body", "[" * 50_000 + "]" * 50_000], {}, "--body"),
        (["send", "--topic", "t", "--body", "1", "--in", "5 fortnights"], {}, "--in"),
        (["send", "--topic", "t", "--body", "1", "--at", "2026-13-01T00:00:00+00:00"], {}, "not an ISO 8601 time"),
        (["send", "--topic", "t", "--body", "1", "--at", "2026-12-01T00:00:00"], {}, "no time zone"),
        (["send", "--topic", "t", "--body", "1", "--level", "x"], {}, "is not a whole number"),
        (["deliver", "--duration", "soon"], {}, "--duration"),
        (["deliver", "--progress-every", "-1"], {}, "--progress-every"),
        (["pull", "--topic", "t", "--group", "g", "--max", "0"], {}, "must be at least 1"),
        (
            ["stats"],
            {"DELAYWHEEL_DATABASE_URL": make_conninfo(server_url, dbname="dwtest_no_such_db")},
            "does not exist",
        ),
        (["stats"], {"DELAYWHEEL_DATABASE_URL": make_conninfo(server_url, dbname=unmigrated)}, "delaywheel migrate"),
        (
            ["send", "--topic", "t", "--body", "1"],
            {"DELAYWHEEL_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/delaywheel?connect_timeout=2"},
            "database error",
        ),
        (["stats"], {"DELAYWHEEL_DATABASE_URL": "not a connection string"}, "database error"),
        (["stats"], {"DELAYWHEEL_BATCH_SIZE": "lots"}, "batch_size"),
    ]
    try:
        for argv, extra, expected in cases:
            done = subprocess.run(
                [sys.executable, "-m", "delaywheel.cli", *argv],
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=60,
            )
            shown = f"{argv[:4]} -> rc {done.returncode}, stderr: {done.stderr[-2000:]}"
            assert done.returncode == 2, shown
            assert "Traceback" not in done.stderr, shown
            assert expected in done.stderr, shown
            assert done.stderr.strip().splitlines()[-1].startswith(("delaywheel", "usage")), shown
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {unmigrated} WITH (FORCE)")


def test_deliver_stops_cleanly_on_sigterm(db_url: str) -> None:
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    loop = subprocess.Popen(
        [sys.executable, "-m", "delaywheel.cli", "deliver", "--duration", "60s", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3.0)  # connected and waiting by now
        assert loop.poll() is None
        loop.send_signal(signal.SIGTERM)
        out, err = loop.communicate(timeout=20)
    finally:
        if loop.poll() is None:
            loop.kill()
    assert loop.returncode == 0, err
    assert json.loads(out)["stopped_by_signal"] is True
    assert "Traceback" not in err


_IMPORTS_OF = """
import sys
from delaywheel.cli import main
code = main(sys.argv[1:])
print("heavy:", ",".join(m for m in ("pyarrow", "numpy", "pgpq", "pglast") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def test_commands_that_need_no_arrow_do_not_import_it(db_url: str) -> None:
    """Issue 19: a command that writes or reads one message at a time starts without pyarrow, numpy or pgpq (they
    cost the CLI a quarter of a second of CPU to import); send_many's batch path imports them when it runs. Nor
    pglast, PostgreSQL's parser: only a caller's predicate (`cancel --where`, reconcile) needs it."""
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    for argv in (
        ["send", "--topic", "t", "--body", "{}"],
        ["send", "--topic", "t", "--body", "1", "--level", "2"],
        ["send", "--topic", "t", "--body", "x", "--raw", "--in", "90s", "--key", "k"],
        ["send", "--topic", "t", "--body", "1", "--at", "2020-01-01T00:00:00+00:00"],  # refused: too old
        ["cancel", "--key", "k"],
        ["cancel", "--id", "1"],
        ["stats"],
        ["pull", "--topic", "t", "--group", "g"],
    ):
        done = subprocess.run(
            [sys.executable, "-c", _IMPORTS_OF, *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode in (0, 1, 2), done.stderr
        assert "heavy: \n" in done.stderr, (argv, done.stderr)
    with Store(db_url) as store:
        assert store.conn.execute("SELECT count(*) FROM delaywheel.level_queue").fetchone() == (1,)
        assert store.conn.execute("SELECT count(*) FROM delaywheel.wheel").fetchone() == (1,)


# The console script's own call (`main()`, no argv), then how many objects the process froze.
_FROZEN_BY = """
import gc, sys
from delaywheel.cli import main
sys.argv[0] = "delaywheel"
code = main()
print("frozen:", gc.get_freeze_count(), file=sys.stderr)
sys.exit(code)
"""


def test_long_running_commands_freeze_their_start_up_heap_in_their_own_process_only(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 (heap.py): `deliver` and `consume` freeze what start-up made before their loop, so a full collection
    walks only what the loop made since; a program that calls `main(argv)` keeps its heap as it was."""
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    for argv, frozen in (
        (["deliver", "--duration", "1s", "--level", "1"], True),
        (["consume", "--topic", "t", "--group", "g", "--duration", "1s"], True),
        (["stats"], False),  # one answer, then the process ends: nothing to spare
    ):
        done = subprocess.run(
            [sys.executable, "-c", _FROZEN_BY, *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        count = int(done.stderr.rsplit("frozen:", 1)[1])
        assert count > 10_000 if frozen else count == 0, (argv, count)
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    before = gc.get_freeze_count()
    assert main(["consume", "--topic", "t", "--group", "g", "--duration", "1s"]) == 0
    assert gc.get_freeze_count() == before


def test_deliver_says_when_it_is_ready_and_counts_busy_passes(db_url: str) -> None:
    """`delaywheel deliver` prints a line on stderr once it listens and holds its lanes, before any pass; its
    progress lines and its result count the passes that found a lane busy."""
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, 1)", (LEVEL_LOCK,))  # another deliverer holds level 1
        loop = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "delaywheel.cli",
                "deliver",
                "--level",
                "1",
                "--duration",
                "3s",
                "--progress-every",
                "1",
                "--json",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert loop.stderr is not None
            first = loop.stderr.readline()
            assert first.startswith("delaywheel deliver: ready"), first
            assert "level 1" in first
            out, err = loop.communicate(timeout=30)
        finally:
            if loop.poll() is None:
                loop.kill()
    assert loop.returncode == 0, err
    result = json.loads(out)
    assert result["busy_passes"] > 0 and result["busy_passes"] <= result["passes"]
    assert result["waited_passes"] == 0  # each busy pass waited, but never got the lane: it was held throughout
    assert f"{result['busy_passes']} busy" in err.strip().splitlines()[-1]
    assert f"{result['waited_passes']} waited for it" in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "instead"),
    [
        (["demo"], "python -m delaywheel_shop demo"),
        (["demo", "--orders", "1000", "--json"], "python -m delaywheel_shop demo --orders 1000 --json"),
        (["shop", "sweep", "--batch", "5"], "python -m delaywheel_shop sweep --batch 5"),
        (["--store", "a", "shop", "migrate"], "python -m delaywheel_shop --store a migrate"),
        (["shop", "customers", "--help"], "python -m delaywheel_shop customers --help"),
    ],
)
def test_the_example_commands_moved_out_say_where_to(
    argv: list[str], instead: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delaywheel shop …` and `delaywheel demo` are the shop example's own commands now (examples/shop; the library
    imports nothing of it): one line naming the command to run instead, exit 2, nothing run."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    command = argv[2] if argv[0] == "--store" else argv[0]
    assert captured.out == ""
    assert captured.err == f"delaywheel: error: `delaywheel {command}` moved to the example application: {instead}\n"


@pytest.mark.skipif(bool(os.environ.get("DELAYWHEEL_DATABASE_URL")), reason="the tests use a configured server")
def test_without_a_configured_url_the_cli_uses_the_embedded_cluster_and_says_so(server_url: str) -> None:
    """No URL configured: the command runs on the embedded cluster (the library's Store would refuse) and says so on
    stderr. (A read without --ack on the shared cluster's store database changes nothing there.)"""
    from delaywheel.dev import embedded

    env = {
        k: v for k, v in os.environ.items() if k not in ("DELAYWHEEL_DATABASE_URL", "AIRFLOW__DELAYWHEEL__DATABASE_URL")
    }
    env["AIRFLOW_CONFIG"] = "/nonexistent/airflow.cfg"
    done = subprocess.run(
        [sys.executable, "-m", "delaywheel.cli", "pull", "--topic", "t", "--group", "g", "--max", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stderr.splitlines()[0] == (
        "delaywheel: no database URL configured (DELAYWHEEL_DATABASE_URL): using the"
        f" embedded cluster, {embedded.default_cluster().url()}"
    ), done.stderr
