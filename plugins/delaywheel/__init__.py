"""delaywheel: delayed messages on PostgreSQL (RocketMQ's delay levels and timing wheel)."""

from delaywheel.config import ConfigError, Settings, load_settings, parse_levels
from delaywheel.consume.topics import AckResult, Batch, Delivered
from delaywheel.ops.cancel import CancelResult
from delaywheel.produce.validation import InvalidMessage, Message
from delaywheel.store import Store
from delaywheel.types import PassResult

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
