"""A fresh fedge.plugins registry per test: no plugin registered or imported, FEDGE_PLUGINS empty."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fedge import plugins


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry as in a new process, restored afterwards (``--plugin`` and FEDGE_PLUGINS changes included)."""
    monkeypatch.setattr(plugins, "_models", {})
    monkeypatch.setattr(plugins, "_datasets", {})
    monkeypatch.setattr(plugins, "_origin", {})
    monkeypatch.setattr(plugins, "_imported", set())
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    monkeypatch.setenv(plugins.ENV, "")
    yield
