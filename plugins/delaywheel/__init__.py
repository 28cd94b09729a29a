"""delaywheel: delayed messages on PostgreSQL (RocketMQ's delay levels and timing wheel).

The names below are loaded when first used (PEP 562), not with the package: `import delaywheel.config` (an Airflow
DAG file reading the level table, the CLI's argument parsing) then costs the standard library only, not psycopg and
the store. Airflow parses every DAG file every 30 s; in a process that had not loaded the store already, importing it
would be most of a parse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from delaywheel.config import ConfigError, Settings, load_settings, parse_levels
    from delaywheel.consume.topics import AckResult, Batch, Delivered
    from delaywheel.ops.cancel import CancelResult
    from delaywheel.produce.validation import InvalidMessage, Message
    from delaywheel.store import Store
    from delaywheel.types import PassResult

_HOMES = {
    "AckResult": "delaywheel.consume.topics",
    "Batch": "delaywheel.consume.topics",
    "CancelResult": "delaywheel.ops.cancel",
    "ConfigError": "delaywheel.config",
    "Delivered": "delaywheel.consume.topics",
    "InvalidMessage": "delaywheel.produce.validation",
    "Message": "delaywheel.produce.validation",
    "PassResult": "delaywheel.types",
    "Settings": "delaywheel.config",
    "Store": "delaywheel.store",
    "load_settings": "delaywheel.config",
    "parse_levels": "delaywheel.config",
}
__all__ = [
    "AckResult",
    "Batch",
    "CancelResult",
    "ConfigError",
    "Delivered",
    "InvalidMessage",
    "Message",
    "PassResult",
    "Settings",
    "Store",
    "load_settings",
    "parse_levels",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'delaywheel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
