"""The shop's own migrations line: its schema (`shop`) beside the store's, in `delaywheel_shop/migrations/`.

The store's `delaywheel migrate` knows nothing of the shop; the shop applies its line itself (`python -m
delaywheel_shop migrate`, the demo) through the store's migration machinery, recorded as line `shop`.
"""

from __future__ import annotations

from importlib import resources

from delaywheel import migrate as migrations

LINE = migrations.Line("shop", resources.files("delaywheel_shop") / "migrations", schemas=("shop",))


def migrate(url: str) -> list[str]:
    """The store's line, then the shop's (its orders enqueue their timeouts in the store's schema); returns the names
    applied now, the store's first."""
    return [*migrations.migrate(url), *migrations.migrate(url, LINE)]
