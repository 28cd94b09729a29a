"""Cancel by id, by key, in bulk by keys, by a checked predicate and by keys from a table; the CLI's guard; cancelled
is never delivered. Attacks through `where` are in test_caller_sql.py."""

from __future__ import annotations

from datetime import datetime, timedelta

import psycopg
import pytest

from delaywheel import Store
from delaywheel.cli import main
from delaywheel.locks import LEVEL_LOCK, WHEEL_LOCK, turns
from delaywheel.ops.cancel import KeysFrom
from delaywheel.ops.predicate import UnsafeSQL
from delaywheel.produce.validation import Message
from tests.helpers import at, deliveries, syncs, traced


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
    assert type(store.cancel(message_id=10**9)[0].message_id) is int  # as given, not the parameter's psycopg type
    assert [r.outcome for r in store.cancel(key="nobody")] == ["not_found"]
    with pytest.raises(ValueError):
        store.cancel()
    with pytest.raises(ValueError, match="must be a bigint"):  # refused at the door, not by a cast on the server
        store.cancel(message_id=2**63)


_LANES = {"level": {"delay_level": 2}, "wheel": {"delay": timedelta(minutes=5)}, "far": {"delay": timedelta(days=3)}}


def passes_after(store: Store, t0: datetime, days: int) -> None:
    """Run the passes of level 2 and of the wheel `days` after t0: every message sent at t0 for them falls due."""
    later = t0 + timedelta(days=days)
    store.deliver_level(2, now=later)
    store.deliver_due(now=later)


@pytest.mark.parametrize("lane", sorted(_LANES))
@pytest.mark.parametrize("how", ["id", "key"])
def test_a_repeated_cancel_after_the_due_time_is_already_cancelled(
    store: Store, t0: datetime, lane: str, how: str
) -> None:
    """Once a pass has moved past a cancelled message it is no longer pending; a second cancel still answers
    already_cancelled (it answered not_found: the find reads pending messages only, and no topic holds it)."""
    mid = store.send("orders", b"a", key="k", now=t0, **_LANES[lane])  # type: ignore[arg-type]
    assert [r.outcome for r in store.cancel(message_id=mid)] == ["cancelled"]
    passes_after(store, t0, days=4)
    again = store.cancel(message_id=mid) if how == "id" else store.cancel(key="k")
    assert [(r.message_id, r.outcome) for r in again] == [(mid, "already_cancelled")]
    with store.conn.transaction():  # inside a caller's transaction, the same answer
        again = store.cancel(message_id=mid) if how == "id" else store.cancel(key="k")
    assert [(r.message_id, r.outcome) for r in again] == [(mid, "already_cancelled")]
    assert deliveries(store) == []


def test_a_cancel_by_key_reports_each_message_once(store: Store, t0: datetime) -> None:
    """A key with a message cancelled and passed, one delivered and one pending: each answered once, whichever way
    the cancel goes (here the pending one is due on a day with no cancellations partition yet: the two-step way)."""
    old = store.send("orders", b"old", delay_level=2, key="k", now=t0)
    done = store.send("orders", b"done", delay=timedelta(minutes=5), key="k", now=t0)
    assert [r.outcome for r in store.cancel(message_id=old)] == ["cancelled"]
    passes_after(store, t0, days=1)
    new = store.send("orders", b"new", delay=timedelta(days=20), key="k", now=t0 + timedelta(days=1))
    outcomes = sorted((r.message_id, r.outcome) for r in store.cancel(key="k"))
    assert outcomes == [(old, "already_cancelled"), (done, "already_delivered"), (new, "cancelled")]
    outcomes = sorted((r.message_id, r.outcome) for r in store.cancel(key="k"))
    assert outcomes == [(old, "already_cancelled"), (done, "already_delivered"), (new, "already_cancelled")]


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
    store.conn.execute(
        "INSERT INTO biz.orders VALUES (1, 'paid', 'eu'), (2, 'paid', 'us'), (3, 'open', 'eu'),"
        " (4, 'void', 'eu'), (5, NULL, 'eu')"
    )
    store.send_many(
        [
            Message(topic, {"i": i}, key=f"order-{i}", delay=timedelta(hours=1))
            for i in range(1, 6)
            for topic in ("timeouts", "reminders")
        ],
        now=t0,
    )
    paid_eu = KeysFrom("biz.orders", "id", prefix="order-", filters={"status": "paid", "region": "eu"})
    assert store.count_matching(keys_from=paid_eu) == 2
    assert (
        store.count_matching(
            keys_from=KeysFrom("biz.orders", "id", prefix="order-", filters={"status": ["paid", "void"]})
        )
        == 6
    )
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
    assert (
        store.count_matching(
            keys_from=KeysFrom(
                "biz.orders", "id", prefix="'); DROP TABLE biz.orders; --", filters={"status": "x' OR '1'='1"}
            )
        )
        == 0
    )
    assert store.conn.execute("SELECT count(*) FROM biz.orders").fetchone() == (5,)


def test_cli_bulk_cancel_needs_yes(
    store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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


def test_cli_keys_from_table(
    store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    store.conn.execute("CREATE TABLE public.paid_orders (id int PRIMARY KEY, status text)")
    store.conn.execute("INSERT INTO public.paid_orders VALUES (1, 'paid'), (2, 'paid'), (3, 'open'), (4, 'void')")
    store.send_many([Message("orders", {"i": i}, key=f"order-{i}", delay=timedelta(hours=1)) for i in range(6)], now=t0)
    argv = [
        "cancel",
        "--keys-from-table",
        "public.paid_orders",
        "--keys-from-column",
        "id",
        "--keys-from-prefix",
        "order-",
        "--keys-from-filter",
        "status=paid",
        "--keys-from-filter",
        "status=void",
    ]
    assert main(argv) == 0
    assert "3 pending message(s) match" in capsys.readouterr().out
    assert main([*argv, "--yes", "--json"]) == 0
    assert '"cancelled": 3' in capsys.readouterr().out
    assert main(["cancel", "--keys-from-table", "public.paid_orders", "--keys-from-column", "nope"]) == 2
    assert "not a column of public.paid_orders" in capsys.readouterr().err
    assert main(["cancel", "--keys-from-table", "public.paid_orders"]) == 2
    assert "needs --keys-from-column" in capsys.readouterr().err


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cancel_by_key_finds_exactly_the_pending_messages(store: Store, db_url: str, t0: datetime, seed: int) -> None:
    """A property, over random placements: keys spread over the levels, the near wheel, far segments with a key filter
    (a send of thousands: summaries in several groups, migrations/020), far segments without one (single sends, a small
    send), a bulk chunk (`bulk.write_chunk`, the Spark path); some delivered, some cancelled before. cancel(key=…)
    answers cancelled for exactly the pending ones, already_delivered / already_cancelled for the rest, and
    not_found for a key nobody used; again after a roll moved far days into the near wheel."""
    import random

    import psycopg
    import pyarrow as pa

    from delaywheel.batch import bulk, input_rows
    from delaywheel.partitions import PartitionCache

    rng = random.Random(seed)
    before, after = [f"a{seed}-{i}" for i in range(30)], [f"b{seed}-{i}" for i in range(30)]
    sent: dict[int, tuple[str, datetime]] = {}  # id -> (key, due)

    def some_key(i: int) -> str:
        return rng.choice(before + after) if rng.random() < 0.08 else f"filler-{seed}-{i}"  # most keys unique

    def days(lo: float, hi: float) -> timedelta:
        return timedelta(days=rng.uniform(lo, hi))

    far = [Message("orders", {"i": i}, key=some_key(i), delay=days(4, 30)) for i in range(3000)]
    far_small = [Message("orders", {"i": i}, key=rng.choice(before + after), delay=days(4, 30)) for i in range(10)]
    near = [Message("orders", {"i": i}, key=some_key(i), delay=days(0.01, 2.9)) for i in range(300)]
    levels = [
        Message("orders", {"i": i}, key=rng.choice(before + after), delay_level=rng.randint(1, 5)) for i in range(40)
    ]
    level_ids: set[int] = set()
    for batch in (far, far_small, near, levels):
        ids = store.send_many(batch, now=t0)
        level_ids |= set(ids) if batch is levels else set()
        for m, mid in zip(batch, ids, strict=True):
            sent[mid] = (str(m.key), t0 + (m.delay or timedelta(0)) if m.delay else t0)
    for i in range(15):  # single sends: far segments of one, without a filter
        key, delay = rng.choice(before + after), days(4, 30)
        sent[store.send("orders", {"single": i}, key=key, delay=delay, now=t0)] = (key, t0 + delay)
    pooled = iter(rng.sample(before + after, 50))  # a bulk input claims each key once: no key twice
    chunk = pa.RecordBatch.from_pylist(
        [
            {
                "key": next(pooled) if i % 40 == 0 else f"bulk-{seed}-{i}",
                "body": f"b{i}",
                "delay_ms": int(days(4, 30).total_seconds() * 1000),
                input_rows.FILE_COLUMN: "in.csv",
                input_rows.ROW_COLUMN: i + 1,
            }
            for i in range(2000)
        ]
    )
    mapping = input_rows.ColumnMap.parse("", "orders", "text").with_defaults(["key", "body", "delay_ms"])
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert (
            bulk.write_chunk(conn, store.settings, PartitionCache(), chunk, mapping, "in.csv", now=t0).enqueued == 2000
        )
    for mid, key, due in store.conn.execute(
        "SELECT id, key, deliver_at FROM delaywheel.wheel_far WHERE id <> ALL(%s)", (list(sent),)
    ):
        sent[mid] = (key, due)
    summaries = store.conn.execute(
        "SELECT count(DISTINCT slot), max(slot) FROM delaywheel.far_key_summaries"
    ).fetchone()
    assert summaries is not None and summaries[1] >= 4  # the big sends' far keys are cut into several groups

    delivered = {mid for (mid,) in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages")}
    store.deliver_level(1, now=at(t0, 3600))  # level 1 (1 s) delivered
    delivered = {mid for (mid,) in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages")} - delivered
    cancelled_before = {mid for mid in rng.sample(sorted(sent), 40)}
    for mid in cancelled_before:
        assert [r.outcome for r in store.cancel(message_id=mid)] in (["cancelled"], ["already_delivered"])
    cancelled_before -= delivered

    def check(keys: list[str], delivered: set[int], cancelled: set[int]) -> None:
        """A cancelled message is named already_cancelled, pending or passed by its lane's cursor."""
        for key in keys:
            expected = {
                (
                    mid,
                    "already_delivered"
                    if mid in delivered
                    else "already_cancelled"
                    if mid in cancelled
                    else "cancelled",
                )
                for mid, (k, _) in sent.items()
                if k == key
            }
            got = {(r.message_id, r.outcome) for r in store.cancel(key=key)}
            assert got == (expected or {(None, "not_found")}), key
            cancelled |= {mid for mid, outcome in got if outcome == "cancelled"}

    check([*before, f"nobody-{seed}"], delivered, cancelled_before)
    # each cancellation names its message's due time (a far one's read from its own element of its segment; a level
    # segment has one due time, which `sent` does not know)
    marks = dict(store.conn.execute("SELECT message_id, due_at FROM delaywheel.cancellations").fetchall())
    timed = {mid: due for mid, due in marks.items() if mid not in level_ids}
    assert timed and timed == {mid: sent[mid][1] for mid in timed}
    # the roll: far days within the near window move into the near wheel; what falls due by then is delivered
    later = t0 + timedelta(days=8)
    store.deliver_due(now=later)
    delivered = {mid for (mid,) in store.conn.execute("SELECT message_id FROM delaywheel.topic_messages")}
    assert all(due <= later for mid, (_, due) in sent.items() if mid in delivered)
    assert not delivered & set(marks)  # delivered or cancelled, never both
    assert store.conn.execute(
        "SELECT count(*) FROM delaywheel.wheel_far WHERE deliver_at < %s", (later + store.settings.wheel_near_window,)
    ).fetchone() == (0,)
    check(after, delivered, cancelled_before)
    # a later send deletes the summaries whose far days were all rolled
    store.send_many([Message("orders", {"i": i}, key=f"late-{i}", delay=days(20, 30)) for i in range(100)], now=later)
    assert store.conn.execute(
        "SELECT count(*) FROM delaywheel.far_key_summaries f, delaywheel.wheel_state s"
        " WHERE f.last_block < s.near_until"
    ).fetchone() == (0,)


@pytest.mark.parametrize("count", [16, 600, 5000, 70_000])
def test_a_key_is_looked_up_in_the_summary_its_send_wrote(count: int) -> None:
    """keyblooms: the slot and filter a send writes for each of its far keys (far_filters, numpy) are among the slots
    a lookup of that key tests (slots, plain Python), and that filter lets the key through (bloom_may_hold's bits)."""
    import numpy as np
    import pyarrow as pa

    from delaywheel.produce.keyblooms import HASHES, far_filters, probe, slots

    keys = [f"order-{i * 7919 % 1_000_003}" for i in range(count)]
    _, written, filters = far_filters(pa.array(keys), np.array([count]))
    assert len(written) == len(set(written)) and len(written) >= count // 512
    by_slot = dict(zip(written, filters, strict=True))
    for key in keys[:: max(1, count // 300)]:
        h1, h2 = probe(key)
        (slot,) = set(slots(h2)) & set(by_slot)  # exactly one of the slots looked up was written
        bloom = by_slot[slot]
        m = 8 * len(bloom)
        assert all(bloom[(h1 + i * h2) % m // 8] >> ((h1 + i * h2) % m % 8) & 1 for i in range(HASHES))


def _crowded_keys(count: int) -> list[str]:
    """`count` keys that all fall in the first of 4 summary groups (the top 2 bits of h2 zero): a send of them has 4
    groups, and all its keys in one, so that group's filter would need 20 bits x `count` (keys a caller chose)."""
    from delaywheel.produce.keyblooms import probe

    keys = (f"crowd-{i}" for i in range(100 * count))
    return [k for k in keys if probe(k)[1] >> 30 == 0][:count]


def test_a_crowded_summary_group_keeps_its_filter_small_and_its_keys_found(store: Store, t0: datetime) -> None:
    """A summary filter is read from a B-tree entry (migrations/024), so it is capped at SUMMARY_MAX_BYTES whatever the
    keys: a group crowded by keys chosen to share it gets a capped filter (more false positives), and every one of its
    keys is still found by a cancel. The table refuses a larger filter with a reason."""
    import numpy as np
    import pyarrow as pa

    from delaywheel.produce.keyblooms import SUMMARY_MAX_BYTES, far_filters

    keys = _crowded_keys(1200)  # 20 bits a key: 3,000 bytes uncapped
    _, _, filters = far_filters(pa.array(keys), np.array([len(keys)]))
    assert max(len(f) for f in filters) == SUMMARY_MAX_BYTES
    ids = store.send_many(
        [Message("orders", {"i": i}, key=k, delay=timedelta(days=10)) for i, k in enumerate(keys)], now=t0
    )
    assert store.conn.execute("SELECT max(octet_length(bloom)) FROM delaywheel.far_key_summaries").fetchone() == (
        SUMMARY_MAX_BYTES,
    )
    for i in (0, 599, 1199):
        assert [(r.message_id, r.outcome) for r in store.cancel(key=keys[i])] == [(ids[i], "cancelled")]
    with pytest.raises(psycopg.errors.CheckViolation, match="far_key_summaries_bloom_size"):
        store.conn.execute(
            "INSERT INTO delaywheel.far_key_summaries (slot, id_lo, id_hi, last_block, bloom)"
            " VALUES (1, 1, 2, now(), %s)",
            (b"\xff" * (SUMMARY_MAX_BYTES + 1),),
        )


def test_a_lane_wait_that_fails_leaves_no_lane_locked(store: Store, db_url: str, t0: datetime) -> None:
    """A cancel whose lane wait is cut short (here by statement_timeout, while a pass holds level 2's second turn)
    keeps none of the shared turns it had taken: the wheel's turns are free for its deliverer at once."""
    level = store.send("orders", b"a", delay_level=2, key="k", now=t0)
    store.send("orders", b"b", delay=timedelta(days=2), key="k", now=t0)
    with psycopg.connect(db_url, autocommit=True) as pass_:
        pass_.execute("SELECT pg_advisory_lock(%s, %s)", turns(LEVEL_LOCK, 2)[1])  # a pass of level 2 in progress
        store.conn.execute("SET statement_timeout = 300")
        with pytest.raises(psycopg.errors.QueryCanceled):
            store.cancel(key="k")  # the wheel's turns are taken first (the cancellers' order), level 2's last
        store.conn.execute("RESET statement_timeout")
        held = store.conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()
        assert held == (0,)
        for turn in turns(*WHEEL_LOCK):  # a deliverer of the wheel gets either turn
            assert pass_.execute("SELECT pg_try_advisory_lock(%s, %s)", turn).fetchone() == (True,)
    assert [(r.message_id, r.outcome) for r in store.cancel(message_id=level)] == [(level, "already_cancelled")]


@pytest.mark.parametrize("how", ["id", "key"])
def test_a_cancel_outside_a_transaction_is_one_round_trip(store: Store, t0: datetime, how: str) -> None:
    """Lookup and cancellations, their commit, the wait for the passes in flight and the search of the topics: one
    statement, a CALL (migrations/027; before it one pipeline of seven statements with one Sync, and before that three
    round trips: the lookup, then the insert and its commit, then the rest). The CALL is not prepared, so it stays
    one round trip after psycopg forgets its prepared statements (as it does after a ROLLBACK: the pass below)."""
    store._cache.ensure(store.conn, "cancellations", [t0])  # as after the store's first cancel on that day
    done = store.send("orders", b"d", delay_level=1, key="k", now=t0 - timedelta(minutes=5))
    assert store.deliver_level(1, now=t0 - timedelta(minutes=4)).delivered == 1
    wheel = store.send("orders", b"w", delay=timedelta(seconds=5), key="k", now=t0)
    level = store.send("orders", b"l", delay_level=1, key="k", now=t0)
    if how == "id":
        results, lines = traced(store.conn, lambda: store.cancel(message_id=wheel))
        assert [(r.message_id, r.outcome) for r in results] == [(wheel, "cancelled")]
    else:
        results, lines = traced(store.conn, lambda: store.cancel(key="k"))
        assert sorted((r.message_id, r.outcome) for r in results) == sorted(
            [(wheel, "cancelled"), (level, "cancelled"), (done, "already_delivered")]
        )
    assert syncs(lines) == 1
    assert store.deliver_due(now=t0 + timedelta(minutes=1)) == (1 if how == "id" else 0)


def test_a_connection_plans_each_lookup_once(store: Store, t0: datetime) -> None:
    """Cancels of many keys and ids, their parameters of every size, run the lookup of each kind planned once for the
    connection: the CALL is not prepared, and the procedure keeps its statements' plans for the session. Before
    migrations/027 the lookup was a prepared statement, and psycopg prepares one per combination of parameter types
    and sends an int as int2, int4 or int8 by its size: the keys' 32-bit hashes made up to eight lookups by key per
    connection, each planned over every partition. The procedures' parameters have their types."""
    store._cache.ensure(store.conn, "cancellations", [t0 + timedelta(seconds=5)])
    ids = store.send_many(
        [Message("orders", b"x", delay=timedelta(seconds=5), key=f"k-{i}") for i in range(40)], now=t0
    )
    assert all(store.cancel(key=f"k-{i}")[0].outcome == "cancelled" for i in range(40))
    assert [r.outcome for mid in (*ids[:5], 30_000, 70_000, 2**40) for r in store.cancel(message_id=mid)] == [
        "already_cancelled"
    ] * 5 + ["not_found"] * 3
    prepared = store.conn.execute(
        "SELECT count(*) FROM pg_prepared_statements WHERE statement ~ 'cancellations|cancel_by'"
    ).fetchone()
    assert prepared == (0,)


def test_a_cancel_on_a_day_without_cancellations_partition_makes_it(store: Store, t0: datetime) -> None:
    """A message due on a day no cancellation was made for yet: the CALL's insert fails before anything is
    committed (no partition for its row), and the cancel goes the two-step way, which makes the partition in a
    transaction of its own. Both messages are cancelled, and the next cancel of that day needs no second try."""
    due = t0 + timedelta(days=20)
    first = store.send("orders", b"a", deliver_at=due, key="far", now=t0)
    second = store.send("orders", b"b", deliver_at=due, key="far-2", now=t0)
    day = "cancellations_p" + due.strftime("%Y%m%d") + "t0000"
    exists = "SELECT to_regclass(%s) IS NOT NULL"
    assert store.conn.execute(exists, (f"delaywheel.{day}",)).fetchone() == (False,)
    assert [(r.message_id, r.outcome) for r in store.cancel(key="far")] == [(first, "cancelled")]
    assert store.conn.execute(exists, (f"delaywheel.{day}",)).fetchone() == (True,)
    results, lines = traced(store.conn, lambda: store.cancel(message_id=second))
    assert ([(r.message_id, r.outcome) for r in results], syncs(lines)) == ([(second, "cancelled")], 1)
    assert store.deliver_due(now=due + timedelta(minutes=1)) == 0
