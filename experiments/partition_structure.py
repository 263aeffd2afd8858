"""Class structure of fedge's client partitions next to the FedNTD authors' partition rules.

FedNTD's Table 1 is 11-15 points under what fedge measures at the same setting (experiments/results/
fedntd-table1-mnist-augmented/). One candidate was how the clients' data is cut. This script measures that part
without training: how many classes each client holds, the share of its largest class, and its sample count, for

- the partitions of committed run directories (their ``partition.json``: per-client class counts), and
- the authors' rules as their code has them (Lee-Gihun/FedNTD, ``train_tools/preprocessing/datasetter.py``):
  ``sharding_partition`` (each class cut into ``s * K / C`` one-class shards; each client gets ``s`` class labels from
  a shuffled list, so two shards of one class can fall to one client) and ``lda_partition`` (per class
  ``Dir(alpha)`` proportions, a client at its fair share ``N / K`` taking no more, redrawn until every client holds
  10 samples), on all 60,000 MNIST training labels, from their data seed 19940817 and two others.

The authors' rules are written here from reading their code (numpy's legacy global generator, as theirs); only the
label structure is compared, no model is trained.

Usage: .venv/bin/python experiments/partition_structure.py RUN_DIR... [--labels FILE] [--seeds 19940817,1,2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedge.accounting.markdown import markdown_table

LABELS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mnist" / "train-labels-idx1-ubyte.gz"
AUTHORS_SEED = 19940817  # main.py's np.random.seed / random.seed before data_distributer


def read_idx_labels(path: Path) -> np.ndarray:
    """The labels of an IDX1 file (MNIST's ``train-labels-idx1-ubyte.gz``), as int64."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 8 or int.from_bytes(raw[:4], "big") != 2049:
        raise SystemExit(f"{path}: not an IDX1 label file")
    return np.frombuffer(raw[8:], dtype=np.uint8).astype(np.int64)


def authors_sharding(labels: np.ndarray, clients: int, shards_per_client: int, seed: int) -> np.ndarray:
    """Per-client class counts ``(clients, classes)`` of the authors' ``sharding_partition``."""
    np.random.seed(seed)
    random.seed(seed)
    classes = int(labels.max()) + 1
    per_class = shards_per_client * clients // classes
    shards: dict[int, list[np.ndarray]] = {}
    for c in range(classes):
        members = np.flatnonzero(labels == c)
        cut = len(members) - len(members) % per_class
        pieces = list(members[:cut].reshape(per_class, -1))
        for i, extra in enumerate(members[cut:]):  # the leftovers go one each to the first shards
            pieces[i] = np.append(pieces[i], extra)
        shards[c] = pieces
    dealt = list(range(classes)) * per_class
    random.shuffle(dealt)
    counts = np.zeros((clients, classes), dtype=np.int64)
    for k, wanted in enumerate(np.array(dealt).reshape(clients, -1)):
        for c in wanted:
            piece = shards[int(c)].pop(np.random.choice(len(shards[int(c)]), replace=False))
            counts[k] += np.bincount(labels[piece], minlength=classes)
    return counts


def authors_lda(labels: np.ndarray, clients: int, alpha: float, seed: int, min_size: int = 10) -> np.ndarray:
    """Per-client class counts ``(clients, classes)`` of the authors' ``lda_partition``."""
    np.random.seed(seed)
    random.seed(seed)
    classes, fair = int(labels.max()) + 1, len(labels) / clients
    while True:
        held: list[list[int]] = [[] for _ in range(clients)]
        for c in range(classes):
            members = np.flatnonzero(labels == c)
            np.random.shuffle(members)
            p = np.random.dirichlet(np.repeat(alpha, clients))
            p = p * np.array([len(h) < fair for h in held])
            cuts = (np.cumsum(p / p.sum()) * len(members)).astype(int)[:-1]
            held = [h + part.tolist() for h, part in zip(held, np.split(members, cuts), strict=True)]
        if min(len(h) for h in held) >= min_size:
            return np.stack([np.bincount(labels[np.array(h, dtype=np.int64)], minlength=classes) for h in held])


def structure(counts: np.ndarray) -> list[str]:
    """Clients holding 1 / 2 / 3 / 4+ classes, the mean share of a client's largest class, samples min/median/max."""
    held = (counts > 0).sum(1)
    by_number = [int((held == n).sum()) for n in (1, 2, 3)] + [int((held >= 4).sum())]
    sizes = counts.sum(1)
    share = float((counts.max(1) / sizes).mean())
    return [" / ".join(map(str, by_number)), f"{share:.3f}", f"{sizes.min()} / {int(np.median(sizes))} / {sizes.max()}"]


def run_counts(run_dir: Path) -> tuple[str, np.ndarray]:
    """The scheme and per-client class counts of a run directory's ``partition.json``."""
    doc = json.loads((run_dir / "partition.json").read_text())
    clients = doc["clients"]
    return doc["scheme"], np.array([clients[c] for c in sorted(clients)], dtype=np.int64)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories with a partition.json")
    parser.add_argument("--labels", type=Path, default=LABELS.resolve(), help="MNIST train-labels IDX file")
    parser.add_argument("--seeds", default=f"{AUTHORS_SEED},1,2", help="data seeds of the authors' rules")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--shards-per-client", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.1)
    args = parser.parse_args(argv)
    if not args.labels.is_file():
        print(f"error: {args.labels} not found; pass --labels", file=sys.stderr)
        return 2
    labels = read_idx_labels(args.labels)
    rows = []
    for run in args.runs:
        scheme, counts = run_counts(run)
        rows.append([f"fedge {scheme}, {run.name}", *structure(counts)])
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(
            [
                f"authors' sharding, seed {seed}",
                *structure(authors_sharding(labels, args.clients, args.shards_per_client, seed)),
            ]
        )
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append([f"authors' LDA, seed {seed}", *structure(authors_lda(labels, args.clients, args.alpha, seed))])
    header = [
        "partition",
        "clients with 1 / 2 / 3 / 4+ classes",
        "mean largest-class share",
        "samples min / median / max",
    ]
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
