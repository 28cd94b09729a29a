"""Redeliver through Spark: catch-up is exactly-once and hands over to the regular deliverer; replays and
reconciles leave audit rows and do not duplicate."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
import redeliver
from psycopg import sql

from delaywheel import Message, Store
from delaywheel.pending import not_cancelled
from tests.helpers import send_backlog

TOPIC = "orders"


def test_catch_up_then_regular_deliverer_exactly_once_never_early(
    spark: object, store: Store, db_url: str, t0: datetime
) -> None:
    send_backlog(store, t0, 4000)
    store.cancel(key="m8")  # a wheel message: cancelled, never delivered
    store.cancel(key="m9")  # a level message
    outage_end = t0 + timedelta(minutes=40)  # part of the backlog is due: levels up to 30m, early wheel times

    report = redeliver.main(
        ["--db-url", db_url, "--now", outage_end.isoformat(), "--mode", "catch-up", "--batch", "300"]
    )

    due_then = store.conn.execute(
        sql.SQL(
            "SELECT count(*) FROM (SELECT id, deliver_at FROM delaywheel.level_queue UNION ALL"
            " SELECT id, deliver_at FROM delaywheel.wheel UNION ALL SELECT id, deliver_at FROM delaywheel.wheel_far) m"
            " WHERE deliver_at <= %s AND {}"
        ).format(not_cancelled("m")),
        (outage_end,),
    ).fetchone()[0]  # type: ignore[index]
    assert 1000 < report["delivered"] == due_then < 4000
    cancelled_due = store.conn.execute(
        "SELECT count(*) FROM delaywheel.cancellations WHERE due_at <= %s", (outage_end,)
    ).fetchone()[0]  # type: ignore[index]
    assert report["skipped_cancelled"] == cancelled_due

    # the regular deliverer resumes from the checkpoints catch-up left
    store.send_many([Message(TOPIC, {"late": i}, delay_level=1, key=f"late{i}") for i in range(50)], now=outage_end)
    assert store.deliver_due(now=t0 + timedelta(hours=3)) == 4000 - 2 - report["delivered"] + 50

    rows = store.conn.execute(
        "SELECT message_id, key, level, origin, deliver_at, delivered_at FROM delaywheel.topic_messages"
        " ORDER BY level, xid, queue_offset"
    ).fetchall()
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)) == 4000 - 2 + 50  # exactly once, nothing lost
    assert not {"m8", "m9"} & {r[1] for r in rows}
    assert all(r[5] >= r[4] for r in rows)  # never early
    for level in {r[2] for r in rows if r[3] == "level"}:
        dues = [r[4] for r in rows if r[3] == "level" and r[2] == level]
        assert dues == sorted(dues), f"level {level} delivered out of due order"


def test_replay_is_recorded_and_deduplicated(spark: object, store: Store, db_url: str, t0: datetime) -> None:
    send_backlog(store, t0, 400)
    store.deliver_due(now=t0 + timedelta(hours=3))
    lo, hi = t0 + timedelta(minutes=5), t0 + timedelta(hours=1, minutes=30)  # spans two hour slices
    in_range = store.conn.execute(
        "SELECT count(*) FROM delaywheel.topic_messages WHERE deliver_at >= %s AND deliver_at < %s", (lo, hi)
    ).fetchone()[0]  # type: ignore[index]
    args = [
        "--db-url",
        db_url,
        "--requested-by",
        "alice",
        "--mode",
        "replay",
        "--from",
        lo.isoformat(),
        "--until",
        hi.isoformat(),
        "--target-topic",
        "orders.replay",
    ]

    first = redeliver.main(args)
    second = redeliver.main(args)
    to_own = redeliver.main(args[:-2])

    assert in_range > 0
    assert (first["replayed"], first["skipped_already_replayed"]) == (in_range, 0)
    assert (second["replayed"], second["skipped_already_replayed"]) == (0, in_range)
    assert to_own["replayed"] == in_range
    replayed = store.conn.execute(
        "SELECT topic, count(*), count(DISTINCT message_id), min(properties->>'REPLAY_ID') FROM delaywheel.topic_messages"
        " WHERE origin = 'replay' GROUP BY topic ORDER BY topic"
    ).fetchall()
    assert replayed == [
        (TOPIC, in_range, in_range, str(to_own["replay_id"])),
        ("orders.replay", in_range, in_range, str(first["replay_id"])),
    ]
    audit = store.conn.execute(
        "SELECT requested_by, due_from, due_until, target_topic, replayed, skipped, finished_at IS NOT NULL"
        " FROM delaywheel.replays ORDER BY id"
    ).fetchall()
    assert audit == [
        ("alice", lo, hi, "orders.replay", in_range, 0, True),
        ("alice", lo, hi, "orders.replay", 0, in_range, True),
        ("alice", lo, hi, None, in_range, 0, True),
    ]


def test_reconcile_creates_missing_cancels_stale_and_records_it(
    spark: object, store: Store, db_url: str, t0: datetime
) -> None:
    conn = store.conn
    conn.execute("CREATE SCHEMA biz")
    conn.execute("CREATE TABLE biz.orders (id bigint PRIMARY KEY, status text NOT NULL, deadline timestamptz NOT NULL)")
    deadline = t0 + timedelta(minutes=30)
    conn.execute(
        "INSERT INTO biz.orders SELECT i, CASE WHEN i = 11 THEN 'paid' ELSE 'pending' END, %s"
        " FROM generate_series(1, 13) i WHERE i <> 12",
        (deadline,),
    )
    for key in ["1", "2", "3", "4", "5", "11", "12", "13"]:  # 11 is paid, 12 has no order: both stale
        store.send("order.timeout", {"order": key}, deliver_at=deadline if key != "13" else t0, key=key, now=t0)
    store.deliver_due(now=t0 + timedelta(seconds=1))  # order 13's timer fired already: not missing
    argv = [
        "--db-url",
        db_url,
        "--requested-by",
        "ops",
        "--now",
        t0.isoformat(),
        "--mode",
        "reconcile",
        "--table",
        "biz.orders",
        "--key-column",
        "id",
        "--predicate",
        "status = 'pending'",
        "--topic",
        "order.timeout",
        "--due-column",
        "deadline",
    ]

    report = redeliver.main(argv)

    assert (report["missing"], report["created"], report["stale"], report["cancelled"]) == (5, 5, 2, 2)
    assert sorted(report["sample"]["missing"]) == ["10", "6", "7", "8", "9"]
    assert sorted(report["sample"]["stale"]) == ["11", "12"]
    timers = conn.execute(
        "SELECT key, deliver_at FROM delaywheel.wheel UNION ALL SELECT key, deliver_at FROM delaywheel.wheel_far"
    ).fetchall()
    assert sorted(k for k, _ in timers) == sorted(["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12"])
    assert {due for _, due in timers} == {deadline}
    assert sorted(r[0] for r in conn.execute("SELECT key FROM delaywheel.cancellations")) == ["11", "12"]
    audit = conn.execute(
        "SELECT requested_by, business, topic, missing, stale, created, cancelled FROM delaywheel.reconcile_runs"
    ).fetchall()
    assert audit == [("ops", "biz.orders.id WHERE status = 'pending'", "order.timeout", 5, 2, 5, 2)]

    again = redeliver.main(argv)

    assert (again["missing"], again["created"], again["stale"], again["cancelled"]) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("--predicate", "status = 'x' OR (SELECT count(*) FROM pg_authid) > 0", "subquery"),
        ("--predicate", "status = 'pending')); DROP TABLE public.victim; --", "not valid SQL"),
        ("--predicate", "pg_read_file('/etc/hostname') = status", "pg_read_file()"),
        ("--table", "biz.orders b; DROP TABLE public.victim; --", "plain identifier"),
        ("--key-column", "id::text FROM pg_authid --", "plain identifier"),
        ("--due-column", "xmin", "not a column of biz.orders"),
    ],
)
def test_reconcile_refuses_hostile_fields_before_spark(
    store: Store, db_url: str, field: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store.conn.execute("CREATE SCHEMA biz")
    store.conn.execute("CREATE TABLE biz.orders (id bigint PRIMARY KEY, status text NOT NULL, deadline timestamptz)")
    store.conn.execute("CREATE TABLE public.victim (x int)")
    args = {
        "--table": "biz.orders",
        "--key-column": "id",
        "--predicate": "status = 'pending'",
        "--topic": "order.timeout",
        "--due-column": "deadline",
        field: value,
    }
    with pytest.raises(SystemExit) as exited:
        redeliver.main(["--db-url", db_url, "--mode", "reconcile", *[x for kv in args.items() for x in kv]])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert store.conn.execute("SELECT to_regclass('public.victim')").fetchone() == ("victim",)
