"""fedge.data.cache: a decoded IDX dataset is cached once and read back bit for bit; a changed file, a damaged entry
and an empty FEDGE_CACHE_DIR each lead to decoding the files again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedge.data import datasets as data
from fedge.data.cache import ENV
from fedge.data.datasets import load_idx_dir
from tests.fedge.data.test_datasets import idx_images, write_file, write_idx_dir

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(root))
    return root


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    decode = data._decode_idx_dir
    monkeypatch.setattr(data, "_decode_idx_dir", lambda d, n: calls.append(n) or decode(d, n))
    return calls


def _same(a: data.Dataset, b: data.Dataset) -> bool:
    return (
        a.x.dtype == b.x.dtype
        and np.array_equal(a.x.view(np.uint32), b.x.view(np.uint32))  # every bit
        and np.array_equal(a.y, b.y)
        and (a.num_classes, a.name) == (b.num_classes, b.name)
    )


@pytest.mark.parametrize("name", ["mnist", "my_digits"])
def test_a_decoded_dataset_is_cached_once_and_read_back_bit_for_bit(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    write_idx_dir(tmp_path / "idx")
    calls = _decodes(monkeypatch)
    first = load_idx_dir(tmp_path / "idx", name)
    second = load_idx_dir(tmp_path / "idx", name)
    assert calls == [name]  # the second load came from the cache
    assert len(list(cache.iterdir())) == 1
    assert all(_same(a, b) for a, b in zip(first, second, strict=True))
    second[0].x[0, 0, 0, 0] = 99.0  # copy-on-write: the cache file keeps its value
    third = load_idx_dir(tmp_path / "idx", name)
    assert _same(third[0], first[0]) and calls == [name]


def test_changed_files_and_another_decoding_are_other_entries(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = write_idx_dir(tmp_path / "idx")
    calls = _decodes(monkeypatch)
    before, _ = load_idx_dir(tmp_path / "idx", "mnist")
    load_idx_dir(tmp_path / "idx", "fashion_mnist")  # other normalization
    images = raw["train_x"].copy()
    images[0, 0, 0] ^= 1  # one pixel
    write_file(tmp_path / "idx" / "train-images-idx3-ubyte.gz", idx_images(images))
    changed, _ = load_idx_dir(tmp_path / "idx", "mnist")
    assert calls == ["mnist", "fashion_mnist", "mnist"]
    assert len(list(cache.iterdir())) == 3
    assert not _same(changed, before)
    fresh, _ = data._decode_idx_dir(tmp_path / "idx", "mnist")
    assert _same(changed, fresh)


def test_a_damaged_entry_is_decoded_again(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_idx_dir(tmp_path / "idx")
    calls = _decodes(monkeypatch)
    first, _ = load_idx_dir(tmp_path / "idx", "mnist")
    (entry,) = cache.iterdir()
    npy = entry / "train_x.npy"
    npy.write_bytes(npy.read_bytes()[:-100])  # truncated
    again, _ = load_idx_dir(tmp_path / "idx", "mnist")
    assert calls == ["mnist", "mnist"] and _same(first, again)
    load_idx_dir(tmp_path / "idx", "mnist")
    assert calls == ["mnist", "mnist"]  # rewritten whole


def test_an_empty_cache_dir_turns_the_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    write_idx_dir(tmp_path / "idx")
    calls = _decodes(monkeypatch)
    load_idx_dir(tmp_path / "idx", "mnist")
    load_idx_dir(tmp_path / "idx", "mnist")
    assert calls == ["mnist", "mnist"] and not (tmp_path / "xdg").exists()
    monkeypatch.delenv(ENV)
    load_idx_dir(tmp_path / "idx", "mnist")
    assert len(list((tmp_path / "xdg" / "fedge" / "datasets").iterdir())) == 1  # the default place


def test_an_unwritable_cache_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(ENV, str(blocker / "cache"))
    raw = write_idx_dir(tmp_path / "idx")
    train, _ = load_idx_dir(tmp_path / "idx", "my_digits")
    assert len(train.x) == len(raw["train_x"])


def test_the_digits_split_is_cached_per_seed_and_read_without_scikit_learn(tmp_path: Path, cache: Path) -> None:
    first = _digits_in_a_new_process(cache)  # decodes with scikit-learn and caches
    second = _digits_in_a_new_process(cache)
    assert first["sklearn"] and not second["sklearn"]  # the cached load never imports it
    assert first["digest"] == second["digest"]  # the same split bit for bit
    assert len(list(cache.iterdir())) == 1
    data.load_digits_dataset(seed=1)  # another split is another entry
    assert len(list(cache.iterdir())) == 2


def _digits_in_a_new_process(cache: Path) -> dict[str, object]:
    """load_digits_dataset in a new interpreter (whether scikit-learn was imported is a per-process fact)."""
    code = (
        "import hashlib, json, sys\n"
        "from fedge.data.datasets import load_digits_dataset\n"
        "h = hashlib.sha256()\n"
        "for s in load_digits_dataset(): h.update(s.x.tobytes()); h.update(s.y.tobytes())\n"
        "print(json.dumps({'sklearn': 'sklearn' in sys.modules, 'digest': h.hexdigest()}))\n"
    )
    env = {**os.environ, ENV: str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])
