"""The consumer's handler timeout (`Store.consume(handler_timeout_s=…)`): a handler that outlives it leaves its batch
unacked, and the batch comes again; within it, the handler's result and exceptions count as inline; a bad value is
refused before anything is read."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from delaywheel import Message, Store
from delaywheel.consume import consumer as consume
from delaywheel.consume.retry import retry_topic


def test_a_handler_that_outlives_its_timeout_leaves_its_batch_unacked_and_it_comes_again(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    ids = store.send_many([Message("t", {"n": i}) for i in range(3)])
    hung = threading.Event()
    calls: list[list[int]] = []

    def handler(messages: list[Any]) -> None:
        calls.append([m.message_id for m in messages])
        if len(calls) == 1:
            hung.wait(30)  # the first call hangs past the timeout (released at the end)

    try:
        with Store(db_url) as own:
            totals = own.consume("t", "g", handler, handler_timeout_s=0.3, limit=3, duration_s=30)
    finally:
        hung.set()
    assert calls == [ids, ids]  # handed out again, whole, after the timeout
    assert totals.handler_timeouts == 1 and totals.messages == 3 and totals.retried == 0
    assert totals.stopped_by == "limit"
    assert "did not return within 0.3 s on a batch of 3" in caplog.text
    assert len(store.pull("t", "g")) == 0  # acked once handled
    assert store.pull(retry_topic("g"), "x").messages == []


def test_a_handler_within_its_timeout_is_as_without_one(store: Store, db_url: str) -> None:
    """On its thread, the handler's failures and exceptions count as they do inline: to a retry."""
    ids = store.send_many([Message("t", {"n": i}) for i in range(4)])
    calls = []

    def handler(messages: list[Any]) -> list[int]:
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return [messages[0].message_id]

    with Store(db_url) as own:
        totals = own.consume("t", "g", handler, max_messages=2, handler_timeout_s=5, limit=4, duration_s=30)
    assert calls == ["delaywheel-handler"] * 2
    assert totals.messages == 4 and totals.retried == 3 and totals.handler_errors == 1 and totals.handler_timeouts == 0
    assert len(ids) == 4


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "5", 86_401])
def test_a_bad_handler_timeout_is_refused_before_anything_is_read(store: Store, value: object) -> None:
    store.send("t", {"n": 1})
    with pytest.raises(ValueError, match="handler_timeout_s must be a number of seconds above 0"):
        store.consume("t", "g", lambda messages: None, handler_timeout_s=value, limit=1)  # type: ignore[arg-type]
    assert len(store.pull("t", "g")) == 1  # nothing acked
    assert consume.checked_handler_timeout(86_400) == 86_400.0
