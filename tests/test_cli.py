"""CLI smoke: send, deliver, pull, stats --json, cancel through `main(argv)` against the test database."""

from __future__ import annotations

import json

import pytest

from delaywheel import Store
from delaywheel.cli import main


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_cli_round_trip(store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert main(["send", "--topic", "orders", "--body", '{"order": 1}', "--json"]) == 0
    now_id = _json(capsys)["message_id"]  # type: ignore[index]
    assert main(["send", "--topic", "orders", "--body", "raw text", "--raw", "--level", "1", "--key", "k", "--json"]) == 0
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


def test_cli_bad_input_is_exit_2_with_a_message(db_url: str, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Scripts rely on the exit codes (README): bad input is 2 and a message on stderr, never a traceback.
    (Bulk cancel's guard codes are in test_cancel.py.)"""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    assert main(["cancel", "--where", "key ==== 'x'"]) == 2
    assert "database error" in capsys.readouterr().err
    assert main(["deliver", "--level", "99", "--duration", "1s"]) == 2
    assert "level 99 is not configured" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["send", "--topic", "orders", "--body", "1", "--in", "99999999999d"])
    assert exited.value.code == 2
    assert "too large" in capsys.readouterr().err
