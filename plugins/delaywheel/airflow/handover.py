"""The lease consumer's statements on its (group, topic) locks (`operators.ConsumeOperator`).

Composed once from the lock classes and the shared key expression (`locks.GROUP_TOPIC_KEY`); parameters group, then
topic. A module of their own so that `operators` imports psycopg only when a consumer runs, not when a DAG is parsed.
"""

from __future__ import annotations

from psycopg import sql

from delaywheel.locks import CONSUMER_PRESENCE_LOCK, CONSUMER_TURN_LOCK, GROUP_TOPIC_KEY

_PRESENCE_KEYS = sql.SQL("{}, {}").format(sql.Literal(CONSUMER_PRESENCE_LOCK), sql.SQL(GROUP_TOPIC_KEY))
_TURN_KEYS = sql.SQL("{}, {}").format(sql.Literal(CONSUMER_TURN_LOCK), sql.SQL(GROUP_TOPIC_KEY))
BE_PRESENT = sql.SQL("SELECT pg_advisory_lock_shared({})").format(_PRESENCE_KEYS)
TAKE_TURN = sql.SQL("SELECT pg_advisory_lock({})").format(_TURN_KEYS)
GIVE_TURN = sql.SQL("SELECT pg_advisory_unlock({})").format(_TURN_KEYS)
# How many other live lease consumers of (group, topic) hold their presence lock in this database.
SUCCESSORS = sql.SQL(
    """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2
         AND pid <> pg_backend_pid() AND classid::bigint = {presence}
         AND objid = ({key})::oid
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
).format(presence=sql.Literal(CONSUMER_PRESENCE_LOCK), key=sql.SQL(GROUP_TOPIC_KEY))
