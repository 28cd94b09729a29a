"""delaywheel: delayed messages on PostgreSQL (RocketMQ's delay levels and timing wheel)."""

from .cancel import CancelResult
from .config import ConfigError, Settings, load_settings, parse_levels
from .levels import PassResult
from .store import Store
from .topics import AckResult, Batch, Delivered
from .validation import InvalidMessage, Message

__all__ = ["AckResult", "Batch", "CancelResult", "ConfigError", "Delivered", "InvalidMessage", "Message", "PassResult",
           "Settings", "Store", "load_settings", "parse_levels"]
