"""What a long-running loop rides out and how long it waits: the one reconnect policy of the delivery loop, the
consumer, the Airflow triggers and the sensor. Beside `db.py`, importing nothing above the core, so that each of
them imports it without importing another."""

from __future__ import annotations

import random
from collections.abc import Iterator

import psycopg

RECONNECT_FIRST_S = 0.2  # after a lost connection, the first retry comes this soon; later ones back off ...
RECONNECT_MAX_S = 5.0  # ... doubling up to this (also the wait after the server refused for want of a resource)

# SQLSTATEs after which the session is gone: the server shut down, crashed or is starting up / shutting down.
_GONE = {"57P01", "57P02", "57P03", "57P05"}


def connection_lost(exc: BaseException) -> bool:
    """Is `exc` the loss of the connection (the server restarted, crashed or is unreachable), as opposed to
    an error of the statement (a lock not available, a query cancelled), which must not be hidden?"""
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith("08") or state in _GONE


def short_of_resources(exc: BaseException) -> bool:
    """Did the server refuse for want of a resource (SQLSTATE class 53: disk full, out of memory, too many
    connections, a configured limit)? The statement did nothing and may succeed once the resource is back, so a
    long-running loop waits and tries again rather than ending; an error of the statement itself is not this."""
    state = getattr(exc, "sqlstate", None)
    return isinstance(exc, psycopg.Error) and isinstance(state, str) and state.startswith("53")


def transient(exc: BaseException) -> bool:
    """The one rule for what a long-running loop (deliverer, consumer, trigger, sensor) rides out by backing off and
    trying again: a lost connection or a server short of a resource. Anything else is raised."""
    return connection_lost(exc) or short_of_resources(exc)


def transient_reason(exc: BaseException) -> str:
    """Why a loop waits, for its log: the lost connection or the missing resource, with the server's message."""
    text = str(exc).strip()
    if short_of_resources(exc):
        return f"the database is short of a resource (SQLSTATE {getattr(exc, 'sqlstate', '')}: {text})"
    return f"lost the database connection ({text})"


def backoff_delays(first_s: float = RECONNECT_FIRST_S, most_s: float = RECONNECT_MAX_S) -> Iterator[float]:
    """Waits between reconnect attempts: doubling from `first_s` up to `most_s`, with up to 25 % jitter
    so that many loops cut by one restart do not all knock at the same instant."""
    delay = first_s
    while True:
        yield delay * (1 + random.random() / 4)
        delay = min(delay * 2, most_s)
