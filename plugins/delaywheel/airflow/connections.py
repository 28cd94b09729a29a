"""The Airflow connection ids of the stores: what a DAG file names at parse time, without importing a hook.

Airflow parses every DAG file every `[dag_processor] min_file_process_interval` (30 s); a file that imported the
hook for these names would also import the postgres provider, psycopg and the store, in every parse that did not hold
them already. `hooks` re-exports them.
"""

from __future__ import annotations

from delaywheel.config import Settings, load_settings

DEFAULT_CONN_ID = "delaywheel_default"


def store_conn_id(store: str | None) -> str:
    """The Airflow connection of the store called `store` in `stores` (`delaywheel_<name>`, made by
    scripts/airflow.sh from DELAYWHEEL_STORES); None: the single store's, ``delaywheel_default``."""
    return DEFAULT_CONN_ID if store is None else f"delaywheel_{store}"


def store_names(settings: Settings | None = None) -> tuple[str | None, ...]:
    """The configured stores' names, or (None,) for the single store: what a DAG file makes one DAG or task per."""
    names = tuple(name for name, _ in (settings or load_settings()).stores)
    return names or (None,)


def topic_stores(topic: str, settings: Settings | None = None) -> tuple[str | None, ...]:
    """The stores that may hold `topic`'s messages, its current store first (`routing.Router.sources`; a moving topic
    has two); (None,), the single store, with no stores configured. Read from the settings when called (DAG parsing,
    a task's start): every process must see the same routes."""
    settings = settings or load_settings()
    if not settings.stores:
        return (None,)
    from delaywheel.routing import Router  # the store's code: only with several stores configured

    return Router.configured(settings).sources(topic)


def topic_conn_ids(topic: str, settings: Settings | None = None) -> tuple[str, ...]:
    """The connections of `topic_stores`: ``delaywheel_<store>`` each, or ``delaywheel_default`` alone."""
    return tuple(store_conn_id(store) for store in topic_stores(topic, settings))
