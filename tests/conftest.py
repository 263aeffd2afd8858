"""Suite-wide: a test that takes a broker fixture is a `broker` test, so `-m "not broker"` (make test-fast) leaves it
out without each test having to say so."""

from __future__ import annotations

import pytest

BROKER_FIXTURES = frozenset({"mosquitto_url", "embedded_url", "broker_url", "fake_clients"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if BROKER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.broker)
