"""A cache of decoded datasets: MNIST's IDX files are gunzipped, converted to float32 and normalized once (about 1 s,
most of it writing 220 MB of fresh memory), then kept as ``.npy`` files and memory-mapped on later loads (milliseconds;
processes of one run, e.g. the executor's workers, share the pages).

Safe by construction: an entry's name is the SHA-256 of the source files' bytes and of how they are decoded, so a
changed file, or another decoding, is another entry; an entry is written to a temporary directory and renamed into
place whole; a damaged one (wrong shapes or types, truncated) is ignored and decoded again; ``.npy`` files are read
without pickle, and copy-on-write (a process that writes into its arrays changes its own copy, never the file).

Where: ``$FEDGE_CACHE_DIR`` (set to an empty value: no cache), else ``$XDG_CACHE_HOME/fedge/datasets``, else
``~/.cache/fedge/datasets``. Deleting the directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from fedge.errors import DatasetError

log = logging.getLogger(__name__)

ENV = "FEDGE_CACHE_DIR"
FORMAT = "fedge-dataset-cache/1"
_SPLITS = ("train", "test")


class Split(Protocol):
    """What the cache stores of a split (:class:`fedge.data.datasets.Dataset` is one)."""

    @property
    def x(self) -> np.ndarray: ...
    @property
    def y(self) -> np.ndarray: ...
    @property
    def num_classes(self) -> int: ...
    @property
    def name(self) -> str: ...


SplitT = TypeVar("SplitT", bound=Split)


def cache_root() -> Path | None:
    """Where decoded datasets are cached; None when ``$FEDGE_CACHE_DIR`` is set empty (no cache)."""
    value = os.environ.get(ENV)
    if value is not None:
        return Path(value).expanduser() if value.strip() else None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # no home directory (a bare service account): no cache
            return None
    return Path(base) / "fedge" / "datasets"


def cached_splits(
    sources: Sequence[Path], recipe: str, decode: Callable[[], tuple[SplitT, SplitT]], kind: Callable[..., SplitT]
) -> tuple[SplitT, SplitT]:
    """``decode()``'s (train, test) splits, from the cache when ``sources`` and ``recipe`` (what decoding does, with
    its version) are those of a cached entry; otherwise decoded and cached. ``kind``: the dataset class, passed by
    :mod:`fedge.data.datasets` (which imports this module) to rebuild cached splits."""
    root = cache_root()
    if root is None:
        return decode()
    entry = root / _key(sources, recipe)
    if entry.is_dir():
        cached = _read(entry, kind)
        if cached is not None:
            return cached
    splits = decode()
    try:
        _write(root, entry, splits)
    except OSError as exc:  # a read-only or full disk: the run goes on without a cache
        log.info("cannot cache the decoded dataset in %s (%s); set %s= to turn the cache off", root, exc, ENV)
    return splits


def _key(sources: Sequence[Path], recipe: str) -> str:
    digest = hashlib.sha256(f"{FORMAT}\n{recipe}\n".encode())
    for path in sources:
        digest.update(f"{path.name}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def _read(entry: Path, kind: Callable[..., SplitT]) -> tuple[SplitT, SplitT] | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        splits = []
        for split in _SPLITS:
            x = np.asarray(np.load(entry / f"{split}_x.npy", mmap_mode="c", allow_pickle=False))
            y = np.load(entry / f"{split}_y.npy", allow_pickle=False)
            if x.dtype != np.float32 or y.dtype != np.int64 or x.ndim != 4 or y.shape != (len(x),):
                raise ValueError(f"{split}: x {x.dtype}{list(x.shape)}, y {y.dtype}{list(y.shape)}")
            if list(x.shape) != meta[f"{split}_shape"]:
                raise ValueError(f"{split}: shape {list(x.shape)}, meta.json says {meta[f'{split}_shape']}")
            splits.append(kind(x=x, y=y, num_classes=int(meta["num_classes"]), name=str(meta["name"])))
    except (OSError, ValueError, KeyError, TypeError, DatasetError) as exc:
        log.warning("ignoring the damaged dataset cache %s (%s): decoding the dataset again", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return splits[0], splits[1]


def _write(root: Path, entry: Path, splits: tuple[Split, Split]) -> None:
    """Write the entry beside its place and rename it there whole (another process may be writing the same one)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
    try:
        meta = {"format": FORMAT, "name": splits[0].name, "num_classes": splits[0].num_classes}
        for split, data in zip(_SPLITS, splits, strict=True):
            np.save(tmp / f"{split}_x.npy", data.x, allow_pickle=False)
            np.save(tmp / f"{split}_y.npy", data.y, allow_pickle=False)
            meta[f"{split}_shape"] = list(data.x.shape)
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.is_dir():  # not another process's entry, renamed first
            raise
