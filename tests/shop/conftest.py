"""The shop example's tests: each test's database also carries the shop's own line (its schema `shop`)."""

from __future__ import annotations

import pytest
from delaywheel_shop import schema


@pytest.fixture
def db_url(db_url: str) -> str:
    """The store's fresh database (tests/conftest.py), with the shop's schema migrated into it (as the
    `shop_schema` fixture does for a test elsewhere)."""
    schema.migrate(db_url)
    return db_url
