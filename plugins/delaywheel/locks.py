"""Every PostgreSQL advisory lock delaywheel takes, in one place, so that no two uses share an id.

Advisory locks have two key spaces that never meet: one bigint key (`pg_advisory_lock(key)`, pg_locks' objsubid 1)
and two int4 keys (`pg_advisory_lock(class, key)`, objsubid 2). Each id below is `0x6477_00NN` ("dw"): the key of a
one-key lock, or the class (first key) of a two-key lock, whose second key says which lane, group or hour. Two
users of one class would wait on each other whenever their second keys met, and a count of a class's holders in
pg_locks (`runner._keep_going`, the lease consumer's watchdog) would count the other's: keep them distinct
(tests/test_locks.py checks it). Nothing here imports more than the standard library.
"""

from __future__ import annotations

# One migrator at a time (`migrate.migrate`, a session lock around the whole run): two would both find a
# migration pending and apply it twice. One key.
MIGRATE_LOCK = 0x64770001

# One setter-up of the embedded cluster at a time (`dev.embedded`: its databases, roles and grants, a session lock
# for that one connection): two `delaywheel db start` at once would both CREATE DATABASE or GRANT the same thing and
# one would fail ("tuple concurrently updated"). One key.
SETUP_LOCK = 0x64770002

# A level's lane; second key: the level. Exclusive, for one transaction, by the level's delivery pass
# (`levels.deliver_level`; a second deliverer of the level waits LANE_WAIT for it, then reports busy) and by the
# setting aside of its undeliverable rows (`levels.set_aside`), so two passes never move the same prefix. Cancels
# never take it: they wait on the lane's turns (TURNS).
LEVEL_LOCK = 0x64770010

# The timing wheel's lane, as (class, key): the same for the wheel as LEVEL_LOCK for a level. Exclusive by the
# wheel's pass and roll (`wheel.advance_wheel`, `wheel._roll`, `wheel._set_aside_far`).
WHEEL_LOCK = (0x64770020, 0)

# A lane's two turns: the lane lock's class plus each of these, the same second key (0x64770011-12 for a level,
# 0x64770021-22 for the wheel). A delivery pass holds its lane's lock and one turn, whichever is free
# (`delaywheel.take_lane`, sql/lanes.sql), for its transaction. A cancel waiting for the passes in flight takes each
# turn shared and lets it go at once, one after the other (`delaywheel.await_lanes`, sql/cancel.sql); a cancel inside
# a caller's transaction holds both until that ends (`delaywheel.hold_lanes`): so a cancelled message is never
# delivered after the cancel returns. Two turns because PostgreSQL grants the cancels queued behind a pass when it
# commits, before their processes run: the next pass takes the other turn instead of waiting for them (cancels in
# that order: the wheel's turns first, then the levels' ascending, so no deadlock).
TURNS = (1, 2)

# A delivery loop's presence on a lane; second key: `lane_lock_key(lane)`. Shared, for the whole run, by every live
# `runner.run` on its listening connection (released with it, so a crashed runner is never counted); a runner
# past its lease counts the other holders to hand its lanes over only to a live successor (`runner._keep_going`).
LANE_PRESENCE_LOCK = 0x64770030

# A lease consumer's presence on (group, topic) in its member slot; second key: `GROUP_TOPIC_SLOT_KEY`. Shared, for
# the task's run, by every live Airflow lease consumer (`airflow.operators.ConsumeOperator`); its watchdog counts the
# other holders of its slot to know its successor is running before it stops at its lease end.
CONSUMER_PRESENCE_LOCK = 0x64770050

# A lease consumer's turn on (group, topic) in its member slot; same second key. Exclusive, by the lease consumer of
# that slot that is consuming: its successor queues on it and the server grants it the instant the predecessor lets
# go. Consumers in other slots take other turns and consume beside it.
CONSUMER_TURN_LOCK = 0x64770051

# One BRIN summarizer at a time (`partitions.summarize`, a session lock tried, never waited for): every lane's
# delivery loop calls it every minute, and one is enough. One key.
SUMMARIZE_LOCK = 0x64770060

# A replayed hour; second key: the hour (hours since the epoch). Exclusive, for the transaction, by the replay of
# a slice (`batch.replay.replay_slice`), so two replays of one hour cannot both pass the NOT EXISTS dedup. A class of
# its own: sharing CONSUMER_PRESENCE_LOCK's, an hour number equal to a (group, topic) hash would make a replay wait
# for a consumer's lease and count as a live lease consumer.
REPLAY_LOCK = 0x64770070

# A consumer group's dead-letter topic; second key: `GROUP_KEY`. Exclusive, for the transaction, by a redrive
# (`ops.dlq.redrive`), so two redrives of one group take turns and the second finds what the first redrove taken
# (the record's key would otherwise make it fail at its commit).
REDRIVE_LOCK = 0x64770080

# The second key of the (group, topic) locks, as SQL over two text parameters (group, then topic).
GROUP_TOPIC_KEY = "hashtext(jsonb_build_array(%s::text, %s::text)::text)"
# The second key of a lease consumer's locks, as SQL over group, topic and member slot (0..15): the (group, topic)
# key with the slot XORed into its low bits. Slot 0's is the (group, topic) key itself: a group with one member
# takes the (group, topic) locks.
GROUP_TOPIC_SLOT_KEY = f"({GROUP_TOPIC_KEY} # %s::int)"
# The second key of the group locks, as SQL over one text parameter (the group).
GROUP_KEY = "hashtext(%s::text)"


def lane_lock_key(lane: int | None) -> int:
    """LANE_PRESENCE_LOCK's second key for a lane: the level, or 0 for the wheel (levels start at 1)."""
    return 0 if lane is None else lane


def turns(lane_class: int, key: int) -> list[tuple[int, int]]:
    """A lane's turns (TURNS) as (class, key) pairs, in the order cancels take them: from its lock's (class, key)."""
    return [(lane_class + turn, key) for turn in TURNS]
