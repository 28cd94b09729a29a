"""Stats report real numbers: level backlog and head, wheel horizons and histogram, topic depth, group lag."""

from __future__ import annotations

from datetime import datetime

from delaywheel import Store
from delaywheel.validation import Message
from tests.conftest import at


def test_level_stats(store: Store, t0: datetime) -> None:
    store.send_many([Message("orders", {"i": i}, delay_level=2) for i in range(4)], now=t0)  # due t0+5
    store.send_many([Message("orders", {"i": i}, delay_level=2) for i in range(3)], now=at(t0, 10))  # t0+15
    store.send("orders", b"x", delay_level=5, now=t0)  # due t0+60
    store.deliver_level(2, now=at(t0, 6))
    levels = {row["level"]: row for row in store.stats(now=at(t0, 20))["levels"]}
    assert len(levels) == 18
    two = levels[2]
    assert (two["backlog"], two["delivered"], two["head_due"], two["delay"]) == (3, 4, at(t0, 15), 5.0)
    assert float(two["oldest_overdue_s"]) == 5.0
    assert two["checkpoint_id"] > 0
    five = levels[5]
    assert (five["backlog"], five["head_due"], five["oldest_overdue_s"], five["checkpoint_id"]) == (1, at(t0, 60), None, 0)
    assert levels[1]["backlog"] == 0 and levels[1]["head_due"] is None


def test_wheel_stats(store: Store, t0: datetime) -> None:
    store.prepare(now=t0)
    offsets = [-30, -10, 30, 50, 600, 1800, 5400, 7200, 2 * 86400, 40 * 86400]
    ids = store.send_many([Message("timers", {"s": s}, deliver_at=at(t0, s)) for s in offsets if s > 0], now=t0)
    store.send_many([Message("timers", {"s": s}, deliver_at=at(t0, s)) for s in offsets if s <= 0], now=at(t0, -60))
    store.cancel(message_id=ids[-1])
    store.advance_wheel(now=at(t0, -20))  # delivers the one due at -30; cursor at -20
    wheel = store.stats(now=t0)["wheel"]
    assert (wheel["overdue"], float(wheel["oldest_overdue_s"])) == (1, 10.0)
    assert (wheel["next_minute"], wheel["next_hour"], wheel["next_day"], wheel["later"]) == (2, 2, 2, 1)
    assert wheel["pending"] == 8
    assert float(wheel["cursor_lag_s"]) == 20.0
    assert wheel["cursor_at"] == at(t0, -20)
    histogram = {row["hour"]: row["due"] for row in wheel["histogram_24h"]}
    assert histogram == {t0: 4, at(t0, 3600): 1, at(t0, 7200): 1}


def test_topic_depth_and_group_lag(store: Store, t0: datetime) -> None:
    store.send_many([Message("a", {"i": i}) for i in range(7)] + [Message("b", {"i": 0})], now=t0)
    store.ack(store.pull("a", "g1", 5))
    store.ack(store.pull("a", "g2", 2))
    topics = {(r["topic"], r["consumer_group"]): r for r in store.stats(now=t0)["topics"]}
    assert topics[("a", "g1")]["depth"] == 7 and topics[("a", "g1")]["lag"] == 2
    assert topics[("a", "g2")]["lag"] == 5 and topics[("a", "g2")]["acked"] == 2
    assert topics[("b", None)]["depth"] == 1
