"""Issue 29's sweep: `fedge export` for every model x objective x batch bound a client's program cache can request,
from a fresh initialization and from a trained global model, each program through the parity gate.

For each (model, input shape, weights), one `fedge export` process writes the .onnx and the inference .pte, then one
process per training loss (ce, fd, lsd, ntd, soft) writes its programs at both batch bounds (64: local training at
batch <= 64; 128: DS-FL's distillation at batch 100), and one more FedProx's ce programs; each into its own directory,
its exit status saying whether every program passed the gate.
Results go to OUT/results.jsonl, one line per command (exit status, wall time, the gate's figures from its output),
and the log of each command beside it. Resumable: a command already recorded with exit 0 is skipped, so the sweep can
be spread over several sittings; it is CPU-bound (one to three minutes per program on one core), so run it niced.
One loss per command keeps a stopped sweep's finished losses: a model's losses together take up to 100 minutes on one
core (dsfl_fmnist_cnn), and imdb_lstm's programs about 25 minutes each (its LSTM is unrolled over 200 time steps,
about 80 ops a step in the two methods of a program, and torch.export's and ExecuTorch's passes trace every op with a
symbolic batch size).

Run: ``nice -n 19 .venv/bin/python experiments/export_sweep.py --out runs/export-sweep [--trained MODEL=W.safetensors]``
(``--only fedavg_cnn`` to restrict models; ``--list`` prints the commands without running them; ``--shard 1/2`` and
``--shard 2/2`` in two processes split the commands between two cores, each process on one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

OBJECTIVES = ("ce", "fd", "lsd", "ntd", "soft")
BOUNDS = ("64", "128")
# (model, per-sample input shape): the shapes of the datasets fedge trains each model on.
MODELS = (
    ("fedavg_cnn", "1,28,28"),  # MNIST, Fashion-MNIST (FedNTD)
    ("fedavg_cnn", "1,8,8"),  # the bundled digits
    ("dsfl_mnist_cnn", "1,28,28"),
    ("dsfl_fmnist_cnn", "1,28,28"),
    ("tiny_mlp", "1,8,8"),
    ("reuters_mlp", ""),
    ("imdb_lstm", ""),
)
PROX_MU = "0.01"  # FedProx's programs carry the proximal term (one value stands for the term being present)


def commands(
    trained: dict[tuple[str, str], Path], only: set[str], weights_kinds: Collection[str] = ("fresh", "trained")
) -> list[tuple[str, list[str]]]:
    """(name, fedge export arguments) for every case of the sweep (of the weights kinds asked for)."""
    out: list[tuple[str, list[str]]] = []
    for model, shape in MODELS:
        if only and model not in only:
            continue
        weights: list[tuple[str, list[str]]] = [("fresh", ["--seed", "0"])]
        if (model, shape) in trained:
            weights.append(("trained", ["--weights", str(trained[model, shape])]))
        for label, flags in weights:
            if label not in weights_kinds:
                continue
            for prox in ("", PROX_MU):
                name = f"{model}-{shape.replace(',', 'x') or 'default'}-{label}" + (f"-prox{prox}" if prox else "")
                args = ["--model", model, *(["--input-shape", shape] if shape else []), *flags]
                if prox:  # FedProx trains with ce only
                    out.append((name, [*args, "--format", "pte-train", "--objective", "ce", "--prox-mu", prox]))
                else:  # one command per loss: each finished one is recorded, and a resumed sweep skips it
                    out.append((name, [*args, "--format", "onnx", "pte"]))
                    out.extend(
                        (f"{name}-{kind}", [*args, "--format", "pte-train", "--objective", kind]) for kind in OBJECTIVES
                    )
    return [(name, [*args, "--max-batch", *BOUNDS]) for name, args in out]


def parse_trained(item: str) -> tuple[tuple[str, str], Path]:
    """``MODEL[@SHAPE]=WEIGHTS`` -> ((model, shape as in MODELS), weights); a shape that MODELS lacks is an error."""
    key, sep, path = item.partition("=")
    model, _, shape = key.partition("@")
    shapes = [s for m, s in MODELS if m == model]
    if not sep or not path or not shapes:
        raise ValueError(
            f"--trained {item}: want MODEL[@SHAPE]=WEIGHTS with MODEL one of {sorted({m for m, _ in MODELS})}"
        )
    if not shape:
        shape = "1,28,28" if "1,28,28" in shapes else shapes[0]
    shape = shape.replace("x", ",")
    if shape not in shapes:
        raise ValueError(f"--trained {item}: {model} is swept at {' or '.join(s.replace(',', 'x') for s in shapes)}")
    return (model, shape), Path(path)


def shard(todo: list[tuple[str, list[str]]], spec: str) -> list[tuple[str, list[str]]]:
    """The K-th of N interleaved parts of the command list ("K/N"): by position in the whole list, so the parts never
    overlap however many commands each part has finished, and a model's losses spread over the parts."""
    match = re.fullmatch(r"(\d+)/(\d+)", spec)
    k, n = (int(match[1]), int(match[2])) if match else (0, 0)
    if not 1 <= k <= n:
        raise ValueError(f"--shard {spec}: want K/N with 1 <= K <= N, e.g. 1/2")
    return todo[k - 1 :: n]


GATE = re.compile(r"(step|drift|logits)[^\n]*?(\d\.\d+e[-+]\d+)")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/export-sweep"))
    p.add_argument(
        "--trained",
        action="append",
        default=[],
        metavar="MODEL[@SHAPE]=WEIGHTS",
        help=(
            "a trained global model for MODEL at input SHAPE (e.g. fedavg_cnn=runs/x/global_model.safetensors, "
            "fedavg_cnn@1x8x8=...; without @SHAPE, 1x28x28 or the model's only shape); repeatable"
        ),
    )
    p.add_argument("--only", nargs="*", default=[], help="models to sweep (default: all)")
    p.add_argument(
        "--weights",
        nargs="+",
        choices=("fresh", "trained"),
        default=["fresh", "trained"],
        help="which weights to export from: fresh seed-0 weights, the --trained models, or both (default)",
    )
    p.add_argument(
        "--shard",
        default="1/1",
        metavar="K/N",
        help="run only the K-th of N interleaved parts of the commands, for N sweeps side by side (default 1/1)",
    )
    p.add_argument("--list", action="store_true", help="print the commands and stop")
    args = p.parse_args()
    try:
        trained = dict(map(parse_trained, args.trained))
    except ValueError as err:
        p.error(str(err))
    if args.weights == ["trained"] and not trained:
        p.error("--weights trained needs at least one --trained MODEL=WEIGHTS")
    try:
        todo = shard(commands(trained, set(args.only), set(args.weights)), args.shard)
    except ValueError as err:
        p.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = set()
    if results.exists():
        done = {r["name"] for r in map(json.loads, results.read_text().splitlines()) if r["exit"] == 0}
    fedge = [sys.executable, "-m", "fedge_cli.main", "export"]
    for i, (name, cmd) in enumerate(todo, 1):
        line = " ".join(["fedge export", *cmd, "--out", str(args.out / name)])
        if args.list:
            print(line)
            continue
        if name in done:
            print(f"[{i}/{len(todo)}] {name}: done already")
            continue
        print(f"[{i}/{len(todo)}] {name}: {line}", flush=True)
        started = time.monotonic()
        with open(args.out / f"{name}.log", "w") as log:
            code = subprocess.run(
                [*fedge, *cmd, "--out", str(args.out / name)], stdout=log, stderr=subprocess.STDOUT
            ).returncode
        text = (args.out / f"{name}.log").read_text()
        record = {
            "name": name,
            "command": line,
            "exit": code,
            "wall_s": round(time.monotonic() - started, 1),
            "load": os.getloadavg()[0],
            "gate": [f"{kind} {value}" for kind, value in GATE.findall(text)][:40],
            "failed": [ln for ln in text.splitlines() if "FAIL" in ln or "refus" in ln][:10],
        }
        with open(results, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"    exit {code} in {record['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
