"""The advisory-lock ids (delaywheel/locks.py): distinct, and written nowhere else."""

from __future__ import annotations

from pathlib import Path

import psycopg

from delaywheel import locks
from delaywheel.partitions import WIDTH

PACKAGE = Path(locks.__file__).parent


def _ids() -> dict[str, int]:
    """Each lock's id: a one-key lock's key, or a two-key lock's class (its first key), the lanes' turns among them."""
    ids = {}
    for name in dir(locks):
        if name.endswith("_LOCK"):
            value = getattr(locks, name)
            ids[name] = value[0] if isinstance(value, tuple) else value
    for lane, lane_class in (("LEVEL", locks.LEVEL_LOCK), ("WHEEL", locks.WHEEL_LOCK[0])):
        for i, (turn_class, _) in enumerate(locks.turns(lane_class, 0)):  # a lane's turns: classes of their own too
            ids[f"{lane}_TURN_{i}"] = turn_class
    return ids


def test_every_lock_has_its_own_id() -> None:
    ids = _ids()
    assert len(ids) >= 9, ids  # the module's locks were all found
    assert len(set(ids.values())) == len(ids), {name: hex(i) for name, i in sorted(ids.items(), key=lambda x: x[1])}
    assert all(i >> 8 == 0x647700 for i in ids.values())  # 0x6477_00NN: recognisable in pg_locks


def test_no_module_writes_a_lock_id_of_its_own() -> None:
    """A lock id written anywhere but locks.py would escape the test above (0x6477 is every id's prefix; the SQL
    migrations take no delaywheel advisory lock but hashtext-keyed partition locks)."""
    elsewhere = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".sql") and p.name != "locks.py" and "0x6477" in p.read_text().lower()
    ]
    assert elsewhere == []


def test_partition_locks_take_no_lock_id(server_url: str) -> None:
    """The one-key locks the migrations take while creating a partition (`hashtext('delaywheel.partition.' ||
    parent)`, migrations/001 and 017) share the one-key space with MIGRATE_LOCK and SUMMARIZE_LOCK: none of the
    partitioned tables' keys is one of theirs."""
    with psycopg.connect(server_url) as conn:
        keys = conn.execute(
            "SELECT hashtext('delaywheel.partition.' || p)::bigint FROM unnest(%s::text[]) p", (sorted(WIDTH),)
        ).fetchall()
    assert not {k for (k,) in keys} & {locks.MIGRATE_LOCK, locks.SUMMARIZE_LOCK}


def test_lane_keys_are_distinct() -> None:
    """LANE_PRESENCE_LOCK's second key: the wheel's (0) is no level's (levels start at 1)."""
    assert locks.lane_lock_key(None) == 0
    assert [locks.lane_lock_key(level) for level in range(1, 19)] == list(range(1, 19))


def test_a_lease_consumers_slots_have_keys_of_their_own_and_slot_0_the_group_topic_key(server_url: str) -> None:
    """GROUP_TOPIC_SLOT_KEY: the 16 member slots of one (group, topic) lock 16 keys, and slot 0 locks the
    (group, topic) key itself, so that one consumer per group takes the locks a consumer without a slot takes."""
    pairs = [("g", "t"), ("orders-lease-template", "orders"), ("", ""), ("g'; --", "%RETRY%g")]
    with psycopg.connect(server_url) as conn:
        for group, topic in pairs:
            plain = conn.execute(f"SELECT {locks.GROUP_TOPIC_KEY}", (group, topic)).fetchall()
            slots = [
                conn.execute(f"SELECT {locks.GROUP_TOPIC_SLOT_KEY}", (group, topic, slot)).fetchall()
                for slot in range(16)
            ]
            assert slots[0] == plain
            assert len({key for ((key,),) in slots}) == 16
