"""The lateness contract with real Great Expectations on Spark: a clean window passes; an injected early,
duplicate or missing delivery (and a lane over its p99 limit) each fails the expectation that names it, and
none of the others (two faults per run, to keep the number of Spark validations down)."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import lateness_quality

from delaywheel import Message, Store
from delaywheel.batch.quality import ContractBroken


def _deliver_steadily(store: Store, t0: datetime) -> None:
    """Levels 1-5 and wheel times in the first minute, enqueued at t0 and delivered by passes every 2 s of
    injected clock: every message is delivered 0-2 s after it is due."""
    messages = [Message("orders", {"i": i}, delay_level=1 + i % 5, key=f"l{i}") for i in range(100)]
    messages += [
        Message("payments", {"i": i}, deliver_at=t0 + timedelta(seconds=1 + i % 55, milliseconds=300), key=f"w{i}")
        for i in range(60)
    ]
    store.send_many(messages, now=t0)
    store.cancel(key="w3")
    for step in range(1, 36):
        store.deliver_due(now=t0 + timedelta(seconds=2 * step))


def _run(db_url: str, t0: datetime, report_dir: Path, p99: str = "2500") -> tuple[set[str], str]:
    """Run the job on [t0, t0 + 70 s); returns the names of the failed expectations and the error message."""
    argv = [
        "--db-url",
        db_url,
        "--start",
        t0.isoformat(),
        "--end",
        (t0 + timedelta(seconds=70)).isoformat(),
        "--p99-ms",
        p99,
        "--report-dir",
        str(report_dir),
    ]
    try:
        result = lateness_quality.main(argv)
    except ContractBroken as broken:
        return {line.split(" (")[0].strip("- ") for line in str(broken).splitlines()[1:]}, str(broken)
    assert result.success
    return set(), ""


def test_clean_window_passes_and_injected_faults_fail_their_expectation(
    spark: object, store: Store, db_url: str, t0: datetime, tmp_path: Path
) -> None:
    _deliver_steadily(store, t0)
    conn = store.conn

    assert _run(db_url, t0, tmp_path) == (set(), "")
    minutes = conn.execute(
        "SELECT sum(deliveries), max(max_ms), min(p50_ms) FROM delaywheel.lateness_minutes"
    ).fetchone()
    assert minutes is not None and minutes[0] == 159 and 0 <= minutes[2] <= minutes[1] <= 2000
    report = Path(conn.execute("SELECT report_path FROM delaywheel.validation_results").fetchone()[0])  # type: ignore[index]
    assert report.read_text().count("data:image/png;base64,") == 2

    victim = conn.execute("SELECT message_id, queue_offset FROM delaywheel.topic_messages WHERE key = 'l7'").fetchone()
    other = conn.execute("SELECT message_id FROM delaywheel.topic_messages WHERE key = 'w9'").fetchone()
    assert victim is not None and other is not None
    # an early delivery and a missing one: each breaks its own expectation, and only that one
    conn.execute(
        "UPDATE delaywheel.topic_messages SET delivered_at = deliver_at - interval '1500 ms' WHERE queue_offset = %s",
        (victim[1],),
    )
    conn.execute("UPDATE delaywheel.topic_messages SET origin = 'replay' WHERE message_id = %s", (other[0],))
    failed, message = _run(db_url, t0, tmp_path)
    assert failed == {"zero_early_deliveries", "completeness"}
    assert "1 of 158 deliveries early (lateness ms, e.g. [-1500.0])" in message
    assert "1 of 160 messages due in the window neither delivered nor cancelled" in message

    # a duplicate delivery, and a lane held to a limit it cannot meet
    conn.execute("UPDATE delaywheel.topic_messages SET delivered_at = deliver_at WHERE queue_offset = %s", (victim[1],))
    conn.execute("UPDATE delaywheel.topic_messages SET origin = 'wheel' WHERE message_id = %s", (other[0],))
    conn.execute(
        "INSERT INTO delaywheel.topic_messages (topic, message_id, origin, level, body, is_json, deliver_at,"
        " delivered_at) SELECT topic, message_id, origin, level, body, is_json, deliver_at, delivered_at"
        " FROM delaywheel.topic_messages WHERE queue_offset = %s",
        (victim[1],),
    )
    failed, message = _run(db_url, t0, tmp_path, p99="default=2500,1=1")
    assert failed == {"no_duplicate_delivery", "p99_within_threshold"}
    assert f"share a message id (e.g. message ids [{victim[0]}, {victim[0]}])" in message
    assert "lanes over their p99 threshold (1: p99 1000 ms > 1 ms)" in message

    saved = conn.execute("SELECT success, failed FROM delaywheel.validation_results ORDER BY id").fetchall()
    assert saved == [
        (True, []),
        (False, ["zero_early_deliveries", "completeness"]),
        (False, ["no_duplicate_delivery", "p99_within_threshold"]),
    ]
