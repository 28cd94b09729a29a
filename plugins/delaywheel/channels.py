"""The NOTIFY channels producers announce on and deliverers, consumers and triggers listen to.

One module both sides import, beside `db.py`, so that a listener does not import the producer (nor the producer
a listener). send_one (the SQL) spells the same names.
"""

from __future__ import annotations

from delaywheel.lanes import Lane, lane_key

NOTIFY_CHANNEL = "delaywheel_enqueue"  # a new due time on a lane not said; every deliverer listens (lane_channel)
TOPIC_CHANNEL = "delaywheel_topic"  # payload: a topic that got messages (readable once the writer commits)


def lane_channel(lane: Lane) -> str:
    """The channel a producer announces a lane's new due times on (payload: the due time, epoch seconds).
    A deliverer listens to its own lanes' channels (and to NOTIFY_CHANNEL), so a lane does not wake for every
    other lane's sends: the Airflow deliver DAG's level tasks would each wake for every batch of wheel timers."""
    return f"{NOTIFY_CHANNEL}_{lane_key(lane)}"
