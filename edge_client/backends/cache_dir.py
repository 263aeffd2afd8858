"""Where a client looks for exported programs by default."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FEDGE_PROGRAM_CACHE"


def default_cache_dir() -> Path:
    """``$FEDGE_PROGRAM_CACHE``, else ``$XDG_CACHE_HOME/fedge/programs`` (``~/.cache/fedge/programs``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedge" / "programs"
