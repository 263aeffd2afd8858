"""Which fedge made a run: its version and, from a git checkout, its commit (recorded in config.json and summary.json).

The commit is read with ``git`` from the checkout this package was imported from, and only when that checkout is the
repository's own top level (not some enclosing repository a wheel was unpacked into). ``dirty`` says whether tracked
files differed from the commit. An installed wheel, or a machine without git, records the version alone.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import fedge

_SOURCE_ROOT = Path(fedge.__file__).resolve().parent.parent


@functools.cache
def provenance() -> dict[str, str | bool]:
    """``{"version": ..., "commit": ..., "dirty": ...}``; the last two only when running from a git checkout."""
    out: dict[str, str | bool] = {"version": fedge.__version__}
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != _SOURCE_ROOT:
        return out
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    if commit:
        out["commit"] = commit
        if status is not None:
            out["dirty"] = bool(status)
    return out


def version_text() -> str:
    """One line for ``fedge --version``: ``fedge 0.1.0 (commit 0123abcd, modified)``."""
    p = provenance()
    if "commit" not in p:
        return f"fedge {p['version']}"
    return f"fedge {p['version']} (commit {str(p['commit'])[:12]}{', modified' if p.get('dirty') else ''})"


def _git(*args: str) -> str | None:
    """``git args...`` in the source tree; None when git is missing, fails or hangs."""
    try:
        done = subprocess.run(
            ["git", "-C", str(_SOURCE_ROOT), *args], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
