"""Racing producers and two deliverers per lane on the real clock: every message delivered exactly once."""

from __future__ import annotations

import random
import threading
import time

from delaywheel import Store
from delaywheel.produce.validation import Message

LANES: list[int | None] = [1, 2, None]  # two levels and the wheel


def test_producers_and_two_deliverers_per_lane(db_url: str, store: Store) -> None:
    store.prepare()
    sent: list[int] = []
    lock = threading.Lock()
    stop_producing = threading.Event()
    stop_delivering = threading.Event()
    errors: list[BaseException] = []

    def produce(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with Store(db_url) as own:
                while not stop_producing.is_set():
                    batch = [
                        rng.choice(
                            [
                                Message("race", {"s": seed}, delay_level=rng.choice([1, 2])),
                                Message("race", {"s": seed}, delay=rng.uniform(0, 1500)),
                                Message("race", {"s": seed}),
                            ]
                        )
                        for _ in range(rng.randint(1, 20))
                    ]
                    ids = own.send_many(batch)
                    with lock:
                        sent.extend(ids)
        except BaseException as exc:
            errors.append(exc)

    def deliver(lane: int | None) -> None:
        try:
            with Store(db_url) as own:
                while not stop_delivering.is_set():
                    result = own.advance_wheel(limit=50) if lane is None else own.deliver_level(lane, limit=50)
                    if not result.more and not result.delivered:
                        time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=deliver, args=(lane,)) for lane in LANES for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(3)
    stop_producing.set()
    time.sleep(6)  # longer than the longest delay sent (level 2 = 5 s)
    stop_delivering.set()
    for t in threads:
        t.join()
    assert not errors, errors
    store.deliver_due()  # whatever the racing deliverers left between their last pass and the stop
    counts = dict(
        store.conn.execute(
            "SELECT message_id, count(*) FROM delaywheel.topic_messages WHERE topic = 'race' GROUP BY 1"
        ).fetchall()
    )
    assert len(sent) > 100
    assert set(counts) == set(sent)
    assert set(counts.values()) == {1}
    early = store.conn.execute(
        "SELECT count(*) FROM delaywheel.topic_messages WHERE delivered_at < deliver_at"
    ).fetchone()
    assert early == (0,)
