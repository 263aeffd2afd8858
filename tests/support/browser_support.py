"""The status page in a real browser: chromium-headless-shell (``make chromium``), when it is installed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

MISSING = "chromium-headless-shell is not installed (make chromium, or apt-get install chromium-headless-shell)"


def find_chromium() -> str | None:
    """The headless Chromium binary, or None."""
    return shutil.which("chromium-headless-shell")


def chromium() -> str:
    """The headless Chromium binary; the test is skipped without it."""
    found = find_chromium()
    if found is None:
        pytest.skip(MISSING)
    return found


def dump_dom(url: str, budget_ms: int = 3000) -> str:
    """The page's DOM after its script ran (virtual time: the first polls of /status.json are in)."""
    cmd = [chromium(), "--no-sandbox", "--disable-gpu", f"--virtual-time-budget={budget_ms}", "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
