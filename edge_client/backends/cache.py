"""A directory of exported programs shared by client processes: export once, check, then reuse.

A program is written only after it passed its parity check, through a temporary file and an atomic rename, so a
client never reads a half-written or unchecked file, and several client processes on one machine can share a cache.
File names carry the fedge format version and the torch/ExecuTorch/ONNX versions, so an upgrade never reuses a
program exported by another toolchain.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "FEDGE_PROGRAM_CACHE"


def default_cache_dir() -> Path:
    """``$FEDGE_PROGRAM_CACHE``, else ``$XDG_CACHE_HOME/fedge/programs`` (``~/.cache/fedge/programs``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fedge" / "programs"


def toolchain_tag(runtime: str) -> str:
    """Versions that change what an export contains, for cache file names."""
    import torch

    if runtime == "executorch":
        from importlib.metadata import version

        return f"torch{torch.__version__.split('+')[0]}-et{version('executorch')}"
    import onnx

    return f"torch{torch.__version__.split('+')[0]}-onnx{onnx.__version__}"


_checked: set[str] = set()  # digests of the programs that passed their check in this process


def checked_once(data: bytes, source: str, check: Callable[[bytes, str], None] | None) -> None:
    """Run ``check`` (which raises on failure) unless these exact bytes already passed it in this process.

    ``check=None`` skips checking (and records nothing).
    """
    if check is None:
        return
    digest = hashlib.sha256(data).hexdigest()
    if digest not in _checked:
        check(data, source)
        _checked.add(digest)


def cached_program(path: Path, make: Callable[[], bytes], check: Callable[[bytes, str], None] | None) -> bytes:
    """The program at ``path``; if absent, ``make()`` it, ``check`` it (raises on failure), then store it.

    A program read from the cache is checked again (once per process): a cache directory is a place where stale or
    foreign files can appear, and the check costs far less than an export.
    """
    if path.exists():
        data = path.read_bytes()
        checked_once(data, str(path), check)
        log.debug("using cached program %s", path)
        return data
    log.info("exporting %s (cached for later runs)", path.name)
    data = make()
    checked_once(data, path.name, check)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)  # atomic: readers see the whole file or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return data
