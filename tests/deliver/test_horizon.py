"""The commit horizon leaves out transactions of other databases; it can then dip (a transaction it left
out ends between the snapshot and the activity read, and its xid briefly counts). The wheel must not
deliver twice when that happens: its horizon only ever moves forward."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import psycopg

from delaywheel import Store
from delaywheel.produce.validation import Message


def test_wheel_delivers_once_while_other_databases_churn(db_url: str, server_url: str, store: Store) -> None:
    store.prepare()
    stop = threading.Event()
    sent: list[int] = []
    errors: list[BaseException] = []

    def churn_other_database() -> None:  # Airflow's metadata DB on the same cluster does this all day
        try:
            with psycopg.connect(server_url, autocommit=True) as conn:
                while not stop.is_set():
                    with conn.transaction():
                        conn.execute("SELECT pg_current_xact_id()")
                        time.sleep(random.uniform(0, 0.003))
        except BaseException as exc:
            errors.append(exc)

    def produce() -> None:
        try:
            with Store(db_url) as own:
                while not stop.is_set():
                    sent.extend(own.send_many([Message("churn", i, delay=random.uniform(0, 200)) for i in range(5)]))
        except BaseException as exc:
            errors.append(exc)

    def advance() -> None:
        try:
            with Store(db_url) as own:
                while not stop.is_set():
                    own.advance_wheel(limit=7)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=f) for f in (churn_other_database, churn_other_database, produce, advance, advance)
    ]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    store.deliver_due(now=store.clock() + __import__("datetime").timedelta(seconds=1))
    delivered = Counter(
        r[0]
        for r in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages WHERE topic = 'churn'").fetchall()
    )
    assert [m for m, n in delivered.items() if n > 1] == []
    assert set(delivered) == set(sent)
