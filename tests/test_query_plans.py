"""A queue read costs its batch, not its backlog.

Every hour brings new partitions without statistics (autovacuum analyzes them later), and the rows past a cursor
are always newer than any statistics. Left to its estimates, the planner then reads every row past the cursor in
every partition and sorts them, for each batch: catching up a backlog would cost its square, and a sensor's
once-a-second look would scan every delivered row. Each test builds such a backlog in fresh partitions and counts
the rows one read takes from them (PostgreSQL 15+'s statistics, flushed first).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from psycopg import sql
from psycopg.types.numeric import Int8

from delaywheel import Store
from delaywheel.ops import cancel as cancel_module
from delaywheel.ops.cancel import key_params
from delaywheel.pending import WHEEL_HEAD
from delaywheel.produce.keyblooms import probe
from delaywheel.produce.validation import Message

BACKLOG = 20_000  # per partition: large enough that, without statistics, "bitmap scan, then sort" looks cheaper


def rows_read(store: Store, partitions: str) -> int:
    """Rows this session has read from the tables named like `partitions`, by index or sequentially."""
    if store.conn.info.server_version < 150000:
        pytest.skip("needs pg_stat_force_next_flush (PostgreSQL 15+); the embedded cluster has it")
    store.conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when this (autocommit) statement ends
    row = store.conn.execute(
        "SELECT sum(coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)) FROM pg_stat_user_tables"
        " WHERE relname LIKE %s",
        (partitions,),
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def test_a_level_pass_reads_its_batch(store: Store, t0: datetime) -> None:
    for hour in (0, 1):  # a backlog in two fresh hourly partitions: 20 segments of 1,000 messages each
        store.send_many(
            [Message("orders", b"x", delay_level=1) for _ in range(BACKLOG)], now=t0 + timedelta(hours=hour)
        )
    for _ in range(2):  # the second pass starts inside the first segment
        before = rows_read(store, "level_segments_p%")
        result = store.deliver_level(1, now=t0 + timedelta(hours=2), limit=100)
        assert (result.delivered, result.more) == (100, True)
        # the pass: its batch's segment, the next one's first message (the end of the incremental sort's group) and
        # the other partition's head (merge append); the next-due read after it: each partition's head. Not 40.
        assert rows_read(store, "level_segments_p%") - before <= 5


def test_a_wheel_pass_and_the_wheel_head_read_a_batch(store: Store, t0: datetime) -> None:
    due = t0 + timedelta(hours=5, seconds=1)
    store.send_many([Message("orders", b"x", deliver_at=due) for _ in range(2 * BACKLOG)], now=t0 + timedelta(hours=5))
    for _ in range(2):  # the second pass also looks for stragglers behind the cursor
        before = rows_read(store, "wheel_p%")
        result = store.advance_wheel(now=due + timedelta(seconds=1), limit=100)
        assert (result.delivered, result.more) == (100, True)
        assert rows_read(store, "wheel_p%") - before < 300
    before = rows_read(store, "wheel_p%")
    assert store.conn.execute(WHEEL_HEAD).fetchone() == (due,)  # what a sensor polls
    assert rows_read(store, "wheel_p%") - before < 10  # the head row, and no straggler scan of delivered rows


def test_a_pull_reads_its_batch(store: Store, t0: datetime) -> None:
    for hour in (0, 1):  # delivered into two fresh hourly topic partitions
        store.send_many([Message("orders", b"x") for _ in range(BACKLOG)], now=t0 + timedelta(hours=hour))
    for _ in range(2):
        before = rows_read(store, "topic_messages_p%")
        batch = store.pull("orders", "billing", 100)
        assert len(batch.messages) == 100
        assert rows_read(store, "topic_messages_p%") - before < 300
        store.ack(batch)


def test_a_far_block_is_searched_by_its_segments(store: Store, t0: datetime) -> None:
    """Far blocks hold segments (migrations/012): a cancel by id reads the one segment whose id range holds it; the
    wheel's head with only far rows is `near_until`."""
    store.advance_wheel(now=t0)  # the first roll sets near_until
    far = t0 + timedelta(days=20)
    ids = store.send_many(
        [
            Message("orders", b"x" * 100, deliver_at=far + timedelta(seconds=i), key=f"order-{i}")
            for i in range(BACKLOG)
        ],
        now=t0,
    )  # one day: 20 segments of 1,000
    (near_until,) = store.conn.execute("SELECT near_until FROM delaywheel.wheel_state").fetchone()
    assert t0 < near_until <= far
    assert store.conn.execute(WHEEL_HEAD).fetchone() == (near_until,)  # a waiter wakes by then, never later
    # the day's cancellations partition, as after its first cancel (which looks the message up twice: its one-trip
    # insert finds no partition, and the two-step way looks again, test_cancel.py)
    store._cache.ensure(store.conn, "cancellations", [far])
    before = rows_read(store, "wheel_far_segments_p%")
    assert [r.outcome for r in store.cancel(message_id=ids[7000])] == ["cancelled"]
    assert rows_read(store, "wheel_far_segments_p%") - before <= 1
    assert [r.outcome for r in store.cancel(key="order-12000")] == ["cancelled"]
    while store.advance_wheel(now=far + timedelta(seconds=BACKLOG)).more:  # rolled into the near wheel, delivered
        pass
    delivered = store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone()
    assert delivered == (BACKLOG - 2,)


def test_a_level_queue_is_searched_by_its_segments(store: Store, t0: datetime) -> None:
    """A cancel by id reads the level segment whose id range holds the message (migrations/011), not the queue."""
    ids = store.send_many(
        [Message("orders", b"x" * 100, delay_level=18, key=f"order-{i}") for i in range(BACKLOG)], now=t0
    )
    before = rows_read(store, "level_segments_p%")
    assert [r.outcome for r in store.cancel(message_id=ids[7000])] == ["cancelled"]
    assert rows_read(store, "level_segments_p%") - before <= 2  # that segment, by the lock and by the lookup; not 20
    assert [r.outcome for r in store.cancel(key="order-12000")] == ["cancelled"]
    while store.deliver_level(18, now=t0 + timedelta(hours=3)).more:
        pass
    delivered = store.conn.execute("SELECT count(*) FROM delaywheel.topic_messages").fetchone()
    assert delivered == (BACKLOG - 2,)


def test_a_cancel_by_key_finds_a_delivered_message_by_page_summaries(store: Store, t0: datetime) -> None:
    """Cancel by key reports delivered messages too: topics carry bloom summaries on key (migrations/009), so that
    search reads a range or two, not every delivered message within retention."""
    store.send_many([Message("orders", b"x" * 100, key=f"order-{i}") for i in range(BACKLOG)], now=t0)  # delivered
    # autosummarize (autovacuum) may or may not have summarized the full ranges yet; the last, partly filled range
    # is left to store.summarize alone (20,000 rows do not fill a whole number of 16-page ranges)
    assert store.summarize() >= 1
    before = rows_read(store, "topic_messages_p%")
    assert [r.outcome for r in store.cancel(key="order-12000")] == ["already_delivered"]
    assert rows_read(store, "topic_messages_p%") - before < BACKLOG / 5


def test_a_message_delivered_into_a_summarized_partial_range_is_still_found(store: Store, t0: datetime) -> None:
    """The delivery loop summarizes the topic it delivers into every second, the last, partly filled range included
    (partitions.summarize): rows delivered into that range afterwards must update its summary, or a cancel by key
    would answer `not_found` for a message already in its topic."""
    store.send_many([Message("orders", b"x" * 100, key=f"early-{i}") for i in range(BACKLOG)], now=t0)  # delivered
    assert store.summarize() >= 1  # the last range is partial (as in the test above) and now summarized
    store.send_many([Message("orders", b"x" * 100, key=f"late-{i}") for i in range(50)], now=t0)  # into that range
    for key in ("late-0", "late-49", "early-7"):
        assert [r.outcome for r in store.cancel(key=key)] == ["already_delivered"], key


def test_a_cancel_by_key_reads_the_keys_of_the_segments_its_filter_lets_through(store: Store, t0: datetime) -> None:
    """Each segment carries a Bloom filter of its keys (keyblooms.py): of 40 segments (20 level, 20 far) only the
    one holding a key passes it, give or take a false positive, and no key that is there is ever missed."""
    store.advance_wheel(now=t0)
    far = t0 + timedelta(days=20)
    store.send_many([Message("orders", b"x", delay_level=18, key=f"order-{i}") for i in range(BACKLOG)], now=t0)
    store.send_many([Message("orders", b"x", deliver_at=far, key=f"far-{i}") for i in range(BACKLOG)], now=t0)
    through = """SELECT count(*) FILTER (WHERE delaywheel.bloom_may_hold(key_bloom, %(h1)s, %(h2)s)),
                        count(*) FILTER (WHERE keys @> ARRAY[%(k)s]) FROM delaywheel.{} s"""
    passed = []
    for key in [f"order-{i}" for i in range(0, BACKLOG, 97)] + [f"far-{i}" for i in range(0, BACKLOG, 97)]:
        h1, h2 = probe(key)
        for table in ("level_segments", "wheel_far_segments"):
            let_through, holding = store.conn.execute(through.format(table), {"h1": h1, "h2": h2, "k": key}).fetchone()
            assert let_through >= holding  # never a false negative
            passed.append(let_through - holding)
    assert sum(passed) <= 0.05 * len(passed) * 20  # false positives: about 1 % of the segments without the key
    assert [r.outcome for r in store.cancel(key="far-12345")] == ["cancelled"]
    assert [r.outcome for r in store.cancel(key="order-54321")] == ["not_found"]


def test_a_cancel_by_key_reads_the_far_summaries_from_their_index(store: Store, t0: datetime) -> None:
    """A lookup tests one far-key summary of each send; those rows lie a page apart in the table, side by side in the
    index that carries their id ranges and filters (migrations/024): the lookup reads them from there alone, with the
    settings a cancel's find runs it under (delaywheel.lookup_plan, a generic plan), before any VACUUM."""
    for send in range(4):
        store.send_many(
            [Message("orders", b"x", deliver_at=t0 + timedelta(days=20), key=f"far-{send}-{i}") for i in range(3000)],
            now=t0,
        )
    store.conn.execute("ANALYZE delaywheel.far_key_summaries")
    with store.conn.transaction():
        store.conn.execute(cancel_module._FIND_PLAN)
        plan = explain(store, cancel_module._FIND["key"], key_params("far-2-17"))
    assert "Index Only Scan using far_key_summaries_lookup on far_key_summaries" in plan, plan


def test_a_cancels_steps_are_planned_with_the_statement_that_calls_them(store: Store, t0: datetime) -> None:
    """The finds, the lanes and the search of topics and cancellations (sql/cancel.sql) are SQL functions the planner
    inlines into the statement that calls them: planned once with it (generic, kept for the session), their indexes
    chosen for the id or key. A function run as a function (say, declared VOLATILE or STRICT) would be planned again
    at every call, over every partition: a cancel's cost several times over."""
    store.send_many([Message("orders", b"x", delay_level=3, key=f"k-{i}") for i in range(10)], now=t0)
    steps = [
        (cancel_module._FIND["id"], {"v": Int8(1)}),
        (cancel_module._FIND["key"], key_params("k-1")),
        (cancel_module._HOLD_MAY_HOLD["id"], {"v": Int8(1)}),
        (cancel_module._HOLD_MAY_HOLD["key"], key_params("k-1")),
        (cancel_module._SETTLED["id"], {"v": Int8(1)}),
        (cancel_module._SETTLED["key"], {"v": "k-1"}),
    ]
    for query, params in steps:
        plan = explain(store, query, params)
        assert "Function Scan on cancel_" not in plan, plan


def explain(store: Store, query: str, params: dict[str, object]) -> str:
    return "\n".join(row[0] for row in store.conn.execute(f"EXPLAIN (COSTS OFF) {query}", params))


def test_a_repeated_cancel_reads_its_own_cancellations(store: Store, t0: datetime) -> None:
    """A cancel also reads the cancellations of its id or key (a repeated cancel after the due time answers
    already_cancelled from them): by id through cancellations_once, by key through cancellations_key, a few rows
    each, not the whole day's cancellations."""
    ids = store.send_many(
        [Message("orders", b"x", delay=timedelta(minutes=5), key=f"order-{i}") for i in range(BACKLOG)], now=t0
    )
    assert store.cancel_matching(keys=[f"order-{i}" for i in range(BACKLOG)]) == BACKLOG
    store.deliver_due(now=t0 + timedelta(hours=1))  # the wheel's cursor moves past them all
    for answer in (lambda: store.cancel(key="order-1234"), lambda: store.cancel(message_id=ids[1234])):
        before = rows_read(store, "cancellations_p%")
        assert [(r.message_id, r.outcome) for r in answer()] == [(ids[1234], "already_cancelled")]
        assert rows_read(store, "cancellations_p%") - before <= 2


def index_entries_read(store: Store, indexes: str) -> int:
    """Index entries this session's scans returned from the indexes named like `indexes` (flushed first)."""
    store.conn.execute("SELECT pg_stat_force_next_flush()")
    row = store.conn.execute(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE indexrelname LIKE %s", (indexes,)
    ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def test_a_bulk_cancel_probes_the_cancellations_of_what_it_found_not_all_of_them(store: Store, t0: datetime) -> None:
    """Bulk cancel leaves out messages already cancelled. The planner overestimates every pending message by orders of
    magnitude (the wheel cursor's view joins tables never analyzed), so the anti-join against the cancellations looked
    cheapest as a merge over all of them, sorted: each call read the whole history (the demo's customers spent 0.2-1.2
    s a tick in it). Probed per row found (pending.cancelled, probe=True), a call reads about what it found."""
    due = t0 + timedelta(minutes=30)
    store.send_many([Message("orders", b"x", deliver_at=due, key=f"old-{i}") for i in range(BACKLOG)], now=t0)
    assert store.cancel_matching(keys=[f"old-{i}" for i in range(BACKLOG)]) == BACKLOG  # the history
    store.send_many([Message("orders", b"x", deliver_at=due, key=f"new-{i}") for i in range(200)], now=t0)
    before = rows_read(store, "cancellations_p%") + index_entries_read(store, "cancellations_p%")
    assert store.cancel_matching(keys=[f"new-{i}" for i in range(200)]) == 200
    assert rows_read(store, "cancellations_p%") + index_entries_read(store, "cancellations_p%") - before < 2000


@pytest.mark.parametrize("lane", ["wheel", "level"])
def test_a_pass_probes_the_cancellations_of_its_batch_not_all_of_them(
    store: Store, db_url: str, t0: datetime, lane: str
) -> None:
    """A pass leaves out cancelled messages, with the plan its connection made after its first few passes (prepared,
    generic), while the day's cancellations keep growing. Made when they were a few hundred, analyzed, that plan hashed
    all of them at every pass: with 700 cancels a second the wheel's due move went from 0.2 to 1.2 ms in 20 s. With
    hashes, merges and scans priced out for the pass (db.PASS_PLAN), a pass probes the index once a row of its batch."""
    with Store(db_url) as other:  # the producer and canceller; `store` only delivers, as a deliverer's connection

        def send(at: datetime) -> None:
            due = {"deliver_at": at + timedelta(seconds=1)} if lane == "wheel" else {"delay_level": 1}
            other.send_many([Message("orders", b"x", **due) for _ in range(10)], now=at)  # type: ignore[arg-type]

        def deliver(at: datetime) -> int:
            passed = store.advance_wheel(now=at) if lane == "wheel" else store.deliver_level(1, now=at)
            return passed.delivered

        def cancellations(first: int, last: int) -> None:  # of other messages
            other.conn.execute(
                "INSERT INTO delaywheel.cancellations (message_id, due_at, key, reason)"
                " SELECT -g, %s, 'other-' || g, 'other' FROM generate_series(%s::int, %s::int) g",
                (t0, first, last),
            )

        other._cache.ensure(other.conn, "cancellations", [t0])
        cancellations(1, 300)  # the day's first few hundred, analyzed, and not again until the test ends
        partition = other.conn.execute(
            "SELECT name FROM delaywheel.partitions WHERE parent = 'cancellations' AND lo <= %s AND hi > %s", (t0, t0)
        ).fetchone()
        assert partition is not None
        other.conn.execute(sql.SQL("ANALYZE delaywheel.{}").format(sql.Identifier(partition[0])))
        other.conn.execute(
            sql.SQL("ALTER TABLE delaywheel.{} SET (autovacuum_enabled = off)").format(sql.Identifier(partition[0]))
        )
        for i in range(7):  # psycopg prepares a statement at its sixth execution: the plan the pass then keeps
            send(t0 + timedelta(seconds=10 * i))
            assert deliver(t0 + timedelta(seconds=10 * i + 5)) == 10
        cancellations(301, BACKLOG)
        send(t0 + timedelta(seconds=80))
        before = rows_read(store, "cancellations_p%") + index_entries_read(store, "cancellations_p%")
        assert deliver(t0 + timedelta(seconds=85)) == 10
        assert rows_read(store, "cancellations_p%") + index_entries_read(store, "cancellations_p%") - before < 100


def test_stats_reads_segments_and_index_ranges_without_jit(
    store: Store, t0: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stats` took 16-18 s on an empty store: JIT compiled its wheel query (a hundred partitions push the estimate
    past jit_above_cost). Store connections have JIT off, and stats turns it off for its own transaction too (here
    the session asks for JIT on every statement). Its counts read segments (`n`) and index ranges: a level backlog
    of 20,000 is 20 segment rows; of 41,000 timers it reads the next hour's 1,000 one by one and takes the 40,000
    due in 5 h from the statistics, with the exact budget set below them."""
    from delaywheel.ops import stats

    assert store.conn.execute("SHOW jit").fetchone() == ("off",)  # db.connect's session options
    store.send_many([Message("orders", b"x", delay_level=18) for _ in range(BACKLOG)], now=t0)
    store.send_many(
        [Message("orders", b"x", deliver_at=t0 + timedelta(hours=5, milliseconds=i)) for i in range(2 * BACKLOG)],
        now=t0,
    )
    store.send_many([Message("orders", b"x", deliver_at=t0 + timedelta(minutes=30)) for _ in range(1000)], now=t0)
    monkeypatch.setattr(stats, "EXACT_ROWS", 5000)
    jit_settings = []
    plain_rows = stats._rows

    def watched(conn: Any, sql: str, params: Any = None) -> list[dict[str, Any]]:
        jit_settings.append(conn.execute("SELECT current_setting('jit')").fetchone()[0])
        return plain_rows(conn, sql, params)

    monkeypatch.setattr(stats, "_rows", watched)
    store.conn.execute("SET jit = on")
    store.conn.execute("SET jit_above_cost = 0")  # would compile every statement
    try:
        levels_before, wheel_before = rows_read(store, "level_segments_p%"), index_entries_read(store, "wheel_p%")
        figures = store.stats(now=t0)
        levels_read = rows_read(store, "level_segments_p%") - levels_before
        wheel_read = index_entries_read(store, "wheel_p%") - wheel_before
    finally:
        store.conn.execute("RESET jit")
        store.conn.execute("RESET jit_above_cost")
    assert jit_settings and set(jit_settings) == {"off"}
    assert next(row["backlog"] for row in figures["levels"] if row["level"] == 18) == BACKLOG
    wheel = figures["wheel"]
    assert (wheel["next_hour"], wheel["next_day"], wheel["estimated_after"]) == (
        1000,
        2 * BACKLOG,
        t0 + timedelta(hours=4),  # the start of their partition (4 hours wide, migrations/025)
    )
    assert levels_read <= 2 * (BACKLOG // 1000) + 5  # its segments (backlog and head reads), not its 20,000 messages
    assert wheel_read < 1000 + 100  # the next hour's entries, not the 40,000 of hour 5


def test_store_connections_keep_a_urls_own_options(db_url: str) -> None:
    """JIT goes off by libpq `options`, appended to any the URL already sets (not replacing them)."""
    from psycopg.conninfo import make_conninfo

    from delaywheel.db import connect

    url = make_conninfo(db_url, options="-c statement_timeout=12345")
    with connect(url) as conn:
        assert conn.execute("SELECT current_setting('jit'), current_setting('statement_timeout')").fetchone() == (
            "off",
            "12345ms",
        )
