"""The shop's own command line, `python -m delaywheel_shop` (`make demo` runs its `demo`): its numbers bounded while
parsing, its errors one line without a traceback, its continuous parts ready and stopped by SIGTERM, its migrate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import psycopg
import pytest
from delaywheel_shop.cli import build_parser, main
from psycopg.conninfo import make_conninfo


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["sweep", "--batch", str(2**63)], "must be at most 1000000"),
        (["sweep", "--batch", "0"], "must be at least 1"),
        (["demo", "--orders", str(10**9)], "must be at most 10000000"),
        (["customers", "--every", "soon"], "is not a number of seconds"),
    ],
)
def test_numbers_out_of_range_are_refused_while_parsing(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parsed only: nothing runs, even if a bound is lost (a sweep or a demo would run on)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "out of range" not in err, err


def test_errors_are_one_line_without_a_traceback(server_url: str) -> None:
    """As a user runs it (a subprocess): a missing subcommand, a missing database and an unmigrated one give exit 2
    and one line on stderr; an unmigrated database names the shop's migrate."""
    unmigrated = f"dwtest_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {unmigrated}")
    env = {k: v for k, v in os.environ.items() if k != "DELAYWHEEL_TRACEBACK"}
    cases: list[tuple[list[str], dict[str, str], str]] = [
        ([], {}, "required"),
        (
            ["sweep"],
            {"DELAYWHEEL_DATABASE_URL": make_conninfo(server_url, dbname="dwtest_no_such_db")},
            "does not exist",
        ),
        (
            ["customers"],
            {"DELAYWHEEL_DATABASE_URL": make_conninfo(server_url, dbname=unmigrated)},
            "python -m delaywheel_shop migrate",
        ),
    ]
    try:
        for argv, extra, expected in cases:
            done = subprocess.run(
                [sys.executable, "-m", "delaywheel_shop", *argv],
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=60,
            )
            shown = f"{argv} -> rc {done.returncode}, stderr: {done.stderr[-2000:]}"
            assert done.returncode == 2, shown
            assert "Traceback" not in done.stderr, shown
            assert expected in done.stderr, shown
            assert done.stderr.strip().splitlines()[-1].startswith(("python -m delaywheel_shop", "usage")), shown
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {unmigrated} WITH (FORCE)")


def test_shop_parts_say_ready_and_stop_on_sigterm(db_url: str) -> None:
    """`sweep` and `customers` (make demo's continuous parts) print a ready line on stderr and stop on SIGTERM with
    exit 0 and their totals."""
    env = {**os.environ, "DELAYWHEEL_DATABASE_URL": db_url}
    for role, fields in (
        ("sweep", {"stopped_by", "notified_wakes", "repulls", "safety_wakes"}),  # and how its consumer waited
        ("customers", {"payments"}),
    ):
        part = subprocess.Popen(
            [sys.executable, "-m", "delaywheel_shop", role, "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert part.stderr is not None
            assert part.stderr.readline() == f"delaywheel_shop {role}: ready\n"
            part.send_signal(signal.SIGTERM)
            out, err = part.communicate(timeout=30)
        finally:
            if part.poll() is None:
                part.kill()
        assert part.returncode == 0, err
        assert fields <= set(json.loads(out))


def test_shop_migrate_applies_the_shops_own_line(
    server_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delaywheel migrate` creates the store's schema and nothing of the shop; the shop's `migrate` brings the store
    up to date, then applies the shop's own line."""
    from delaywheel.cli import main as delaywheel

    name = f"dwtest_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", make_conninfo(server_url, dbname=name))
    try:
        assert delaywheel(["migrate"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("applied: ") and "shop" not in out
        assert main(["migrate"]) == 0
        assert capsys.readouterr().out == "applied: 001_shop.sql, 002_shop_functions.sql\n"
        assert main(["migrate"]) == 0
        assert capsys.readouterr().out == "schema up to date\n"
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
