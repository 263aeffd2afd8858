"""experiments/partition_structure.py: the FedNTD authors' partition rules as written there, and the table it prints."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fedge.data.partition import partition

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "partition_structure.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("partition_structure", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LABELS = np.repeat(np.arange(10), [103, 97, 100, 100, 99, 101, 100, 100, 100, 100])  # 1,000, uneven classes


def test_the_authors_sharding_gives_each_client_at_most_two_classes_and_deals_every_sample(script: ModuleType) -> None:
    counts = script.authors_sharding(LABELS, 10, 2, seed=3)
    assert counts.shape == (10, 10)
    assert ((counts > 0).sum(1) <= 2).all()  # one-class shards: never a third class
    assert (counts.sum(0) == np.bincount(LABELS)).all()  # leftovers included: every sample dealt once
    assert (counts == script.authors_sharding(LABELS, 10, 2, seed=3)).all()  # the seed fixes it


def test_the_authors_lda_holds_every_client_to_its_minimum_and_deals_every_sample(script: ModuleType) -> None:
    counts = script.authors_lda(LABELS, 10, 0.1, seed=3, min_size=10)
    assert (counts.sum(1) >= 10).all() and (counts.sum(0) == np.bincount(LABELS)).all()
    assert not (counts == script.authors_lda(LABELS, 10, 0.1, seed=4, min_size=10)).all()


def test_structure_counts_classes_largest_share_and_sizes(script: ModuleType) -> None:
    counts = np.array([[10, 0, 0, 0], [5, 5, 0, 0], [4, 3, 3, 0], [1, 1, 1, 7]])
    assert script.structure(counts) == ["1 / 1 / 1 / 1", f"{(1 + 0.5 + 0.4 + 0.7) / 4:.3f}", "10 / 10 / 10"]


def test_the_table_has_a_row_per_run_and_per_seed_of_each_rule(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels_file = tmp_path / "labels.gz"  # an IDX1 file, as MNIST's
    labels_file.write_bytes(gzip.compress((2049).to_bytes(4, "big") + len(LABELS).to_bytes(4, "big") + bytes(LABELS)))
    run = tmp_path / "run"
    run.mkdir()
    parts = partition(LABELS, 10, scheme="shards", rng=np.random.default_rng(0))
    counts = np.stack([np.bincount(LABELS[p], minlength=10) for p in parts])
    clients = {f"c{i:03d}": c.tolist() for i, c in enumerate(counts)}
    (run / "partition.json").write_text(json.dumps({"scheme": "shards", "clients": clients}))

    assert script.main([str(run), "--labels", str(labels_file), "--seeds", "5,6", "--clients", "10"]) == 0
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()[2:] if line
    ]
    assert [r[0] for r in rows] == [
        "fedge shards, run",
        *(f"authors' {rule}, seed {seed}" for rule in ("sharding", "LDA") for seed in (5, 6)),
    ]
    assert rows[0][1:] == script.structure(counts)
    for row in rows[1:3]:  # the authors' shards are one class each: no client holds three
        held = [int(n) for n in row[1].split(" / ")]
        assert sum(held) == 10 and held[2:] == [0, 0]
    assert script.main([str(run), "--labels", str(tmp_path / "missing")]) == 2


def test_shards_per_client_and_alpha_change_the_authors_rows(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labels_file = tmp_path / "labels"
    labels_file.write_bytes((2049).to_bytes(4, "big") + len(LABELS).to_bytes(4, "big") + bytes(LABELS))
    base = ["--labels", str(labels_file), "--seeds", "5", "--clients", "10"]
    rows = {}
    for extra in ([], ["--shards-per-client", "1"], ["--alpha", "100"]):
        assert script.main([*base, *extra]) == 0
        rows[tuple(extra)] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| authors'")]
    assert "| 10 / 0 / 0 / 0 " in rows[("--shards-per-client", "1")][0]  # one shard each: one class each
    assert rows[()][0] != rows[("--shards-per-client", "1")][0]
    assert rows[()][1] != rows[("--alpha", "100")][1]  # another Dirichlet concentration: another split
