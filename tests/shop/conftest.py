"""The shop example's tests: each test's database also carries the shop's own line (its schema `shop`)."""

from __future__ import annotations

import pytest

from tests.conftest import migrate_shop


@pytest.fixture
def db_url(db_url: str) -> str:
    """The store's fresh database (tests/conftest.py), with the shop's schema migrated into it."""
    return migrate_shop(db_url)
