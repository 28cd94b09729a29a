"""Cancel by id, by key, in bulk by keys, by a checked predicate and by keys from a table; the CLI's guard; cancelled
is never delivered. Attacks through `where` are in test_caller_sql.py."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from delaywheel import Store
from delaywheel.cancel import KeysFrom
from delaywheel.cli import main
from delaywheel.predicate import UnsafeSQL
from delaywheel.validation import Message
from tests.conftest import at, deliveries


def test_cancel_by_id_and_key(store: Store, t0: datetime) -> None:
    a = store.send("orders", b"a", delay_level=2, key="k-a", now=t0)
    b = store.send("orders", b"b", delay=timedelta(minutes=5), key="k-b", now=t0)
    c = store.send("orders", b"c", delay=timedelta(days=100), key="k-b", now=t0)
    keep = store.send("orders", b"keep", delay_level=2, now=t0)
    assert [(r.message_id, r.outcome) for r in store.cancel(message_id=a)] == [(a, "cancelled")]
    assert [(r.message_id, r.outcome) for r in store.cancel(message_id=a)] == [(a, "already_cancelled")]
    assert sorted((r.message_id, r.outcome) for r in store.cancel(key="k-b")) == [(b, "cancelled"), (c, "cancelled")]
    store.deliver_due(now=t0 + timedelta(days=101))
    assert [r[0] for r in deliveries(store)] == [keep]
    result = store.deliver_level(2, now=at(t0, 5))
    assert result.delivered == 0


def test_cancel_after_delivery_and_not_found(store: Store, t0: datetime) -> None:
    mid = store.send("orders", b"x", delay_level=1, key="done", now=t0)
    store.deliver_level(1, now=at(t0, 1))
    assert [(r.message_id, r.outcome) for r in store.cancel(message_id=mid)] == [(mid, "already_delivered")]
    assert [r.outcome for r in store.cancel(key="done")] == ["already_delivered"]
    assert [(r.message_id, r.outcome) for r in store.cancel(message_id=10**9)] == [(10**9, "not_found")]
    assert [r.outcome for r in store.cancel(key="nobody")] == ["not_found"]
    with pytest.raises(ValueError):
        store.cancel()


def test_skipped_cancelled_is_counted(store: Store, t0: datetime) -> None:
    ids = store.send_many([Message("orders", {"i": i}, delay_level=1) for i in range(4)], now=t0)
    store.cancel(message_id=ids[1])
    result = store.deliver_level(1, now=at(t0, 1))
    assert (result.delivered, result.skipped_cancelled) == (3, 1)


def test_bulk_cancel_by_keys(store: Store, t0: datetime) -> None:
    msgs = [Message("orders", {"i": i}, key=f"order-{i}", delay=timedelta(minutes=30)) for i in range(10)]
    msgs += [Message("orders", {"i": i}, key=f"order-{i}", delay_level=4) for i in range(10, 14)]
    ids = store.send_many(msgs, now=t0)
    keys = ["order-1", "order-3", "order-11", "order-99"]
    assert store.count_matching(keys=keys) == 3
    assert store.cancel_matching(keys=keys) == 3
    assert store.count_matching(keys=keys) == 0
    assert store.cancel_matching(keys=keys) == 0  # idempotent
    store.deliver_due(now=at(t0, 3600))
    assert sorted(r[0] for r in deliveries(store)) == sorted(ids[i] for i in range(14) if i not in (1, 3, 11))


def test_bulk_cancel_by_keys_from_a_user_table(store: Store, t0: datetime) -> None:
    store.conn.execute("CREATE TABLE public.shop_orders (id int PRIMARY KEY, paid boolean NOT NULL)")
    store.conn.execute("INSERT INTO public.shop_orders SELECT g, g % 3 = 0 FROM generate_series(1, 30) g")
    msgs = [Message("timeouts", {"order": i}, key=str(i), delay=timedelta(minutes=30)) for i in range(1, 21)]
    msgs += [Message("timeouts", {"order": i}, key=str(i), delay=timedelta(days=40)) for i in range(21, 31)]
    ids = dict(zip(range(1, 31), store.send_many(msgs, now=t0), strict=True))
    paid = KeysFrom("public.shop_orders", "id", filters={"paid": True})  # was: key IN (SELECT id::text ... WHERE paid)
    assert store.count_matching(keys_from=paid) == 10
    assert store.cancel_matching(keys_from=paid, reason="paid") == 10
    reasons = store.conn.execute("SELECT DISTINCT reason FROM delaywheel.cancellations").fetchall()
    assert reasons == [("paid",)]
    assert store.cancel_matching(where="topic = 'timeouts' AND deliver_at > '2031-01-01'::timestamptz") == 0
    store.deliver_due(now=t0 + timedelta(days=41))
    assert sorted(r[0] for r in deliveries(store)) == sorted(v for k, v in ids.items() if k % 3)


def test_keys_from_with_prefix_lists_and_a_checked_where(store: Store, t0: datetime) -> None:
    store.conn.execute("CREATE SCHEMA biz")
    store.conn.execute("CREATE TABLE biz.orders (id int PRIMARY KEY, status text, region text)")
    store.conn.execute("INSERT INTO biz.orders VALUES (1, 'paid', 'eu'), (2, 'paid', 'us'), (3, 'open', 'eu'),"
                       " (4, 'void', 'eu'), (5, NULL, 'eu')")
    store.send_many([Message(topic, {"i": i}, key=f"order-{i}", delay=timedelta(hours=1))
                     for i in range(1, 6) for topic in ("timeouts", "reminders")], now=t0)
    paid_eu = KeysFrom("biz.orders", "id", prefix="order-", filters={"status": "paid", "region": "eu"})
    assert store.count_matching(keys_from=paid_eu) == 2
    assert store.count_matching(keys_from=KeysFrom("biz.orders", "id", prefix="order-",
                                                   filters={"status": ["paid", "void"]})) == 6
    assert store.count_matching(keys_from=KeysFrom("biz.orders", "id", prefix="order-", filters={"status": None})) == 2
    assert store.cancel_matching(keys_from=paid_eu, where="topic = 'timeouts'") == 1
    with pytest.raises(UnsafeSQL, match="does not exist"):
        store.count_matching(keys_from=KeysFrom("biz.nothing", "id"))
    with pytest.raises(UnsafeSQL, match=r"not a column of biz\.orders"):
        store.count_matching(keys_from=KeysFrom("biz.orders", "xmin"))
    with pytest.raises(UnsafeSQL, match="not a plain identifier"):
        store.count_matching(keys_from=KeysFrom("biz.orders", "id", filters={"status; DROP TABLE x": "a"}))
    with pytest.raises(UnsafeSQL, match="plain identifier"):
        store.count_matching(keys_from=KeysFrom('biz.orders"; DROP TABLE biz.orders; --', "id"))
    with pytest.raises(UnsafeSQL, match="system table"):
        store.count_matching(keys_from=KeysFrom("pg_catalog.pg_authid", "rolpassword"))
    # a hostile value is a value: bound, never SQL
    assert store.count_matching(keys_from=KeysFrom("biz.orders", "id", prefix="'); DROP TABLE biz.orders; --",
                                                   filters={"status": "x' OR '1'='1"})) == 0
    assert store.conn.execute("SELECT count(*) FROM biz.orders").fetchone() == (5,)


def test_cli_bulk_cancel_needs_yes(store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    store.send_many([Message("orders", {"i": i}, key=f"k{i}", delay=timedelta(hours=1)) for i in range(6)], now=t0)
    where = "key IN ('k1', 'k2', 'k5')"
    assert main(["cancel", "--where", where]) == 0  # counted, as asked
    assert "3 pending message(s) match" in capsys.readouterr().out
    assert store.count_matching(where=where) == 3  # nothing cancelled without --yes
    assert main(["cancel", "--where", where, "--yes", "--json"]) == 0
    assert '"cancelled": 3' in capsys.readouterr().out
    assert store.count_matching(where=where) == 0
    assert main(["cancel", "--where", where, "--yes"]) == 1  # already cancelled: nothing done
    assert main(["cancel", "--where", "key = 'none'"]) == 1  # nothing matches


def test_bulk_cancel_rejects_bad_sql_and_writes_nothing(store: Store, t0: datetime) -> None:
    store.send("orders", b"x", delay=timedelta(hours=1), key="a", now=t0)
    with pytest.raises(UnsafeSQL, match="not valid SQL"):
        store.cancel_matching(where="key = = 'a'")
    assert store.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (0,)


def test_cli_keys_from_table(store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    store.conn.execute("CREATE TABLE public.paid_orders (id int PRIMARY KEY, status text)")
    store.conn.execute("INSERT INTO public.paid_orders VALUES (1, 'paid'), (2, 'paid'), (3, 'open'), (4, 'void')")
    store.send_many([Message("orders", {"i": i}, key=f"order-{i}", delay=timedelta(hours=1)) for i in range(6)],
                    now=t0)
    argv = ["cancel", "--keys-from-table", "public.paid_orders", "--keys-from-column", "id",
            "--keys-from-prefix", "order-", "--keys-from-filter", "status=paid", "--keys-from-filter", "status=void"]
    assert main(argv) == 0
    assert "3 pending message(s) match" in capsys.readouterr().out
    assert main([*argv, "--yes", "--json"]) == 0
    assert '"cancelled": 3' in capsys.readouterr().out
    assert main(["cancel", "--keys-from-table", "public.paid_orders", "--keys-from-column", "nope"]) == 2
    assert "not a column of public.paid_orders" in capsys.readouterr().err
    assert main(["cancel", "--keys-from-table", "public.paid_orders"]) == 2
    assert "needs --keys-from-column" in capsys.readouterr().err
