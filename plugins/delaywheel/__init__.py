"""delaywheel: delayed messages on PostgreSQL (RocketMQ's delay levels and timing wheel)."""

from .config import ConfigError, Settings, load_settings, parse_levels
from .store import Store
from .validation import InvalidMessage, Message

__all__ = ["ConfigError", "InvalidMessage", "Message", "Settings", "Store", "load_settings", "parse_levels"]
