"""``python -m export.ort_training [generate|check|bench]``: make ONNX Runtime training artifacts, check, time them.

Runs in ``.venv-ort-training``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from edge_client.backends.ort_training import ArtifactDirectory
from export.ort_training.cache import ArtifactCache
from export.ort_training.check import check_artifacts
from export.ort_training.timing import step_times
from fedge.algorithms.catalog import make_objective, objective_classes, objective_kinds, terms_from_flags
from fedge.errors import ConfigError, ExportError
from fedge.programs.spec import ModelSpec, TrainingLoss


def _spec(args: argparse.Namespace) -> ModelSpec:
    from fedge.learning.models import example_input

    try:
        shape = (
            tuple(int(d) for d in args.input_shape.split(","))
            if args.input_shape
            else tuple(example_input(args.model, batch=1).shape[1:])
        )
    except ValueError:
        raise ConfigError(f"--input-shape must be comma-separated integers, got {args.input_shape!r}") from None
    return ModelSpec(args.model, shape, args.num_classes)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m export.ort_training [generate|check|bench]``: make artifacts for a device, check, time them."""
    p = argparse.ArgumentParser(prog="python -m export.ort_training", description=(__doc__ or "").splitlines()[0])
    p.add_argument("command", choices=["generate", "check", "bench"], nargs="?", default="generate")
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 1,28,28 (none: the paper's)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--objective", nargs="+", choices=objective_kinds(), default=["ntd"])
    p.add_argument("--tau", type=float, default=1.0, help="distillation temperature baked into ntd/lsd artifacts")
    p.add_argument("--beta", type=float, default=1.0, help="distillation weight baked into ntd artifacts")
    p.add_argument("--gamma", type=float, default=1.0, help="FD regularizer weight baked into fd artifacts")
    p.add_argument("--prox-mu", type=float, default=0.0, help="FedProx: bake the proximal term mu in")
    p.add_argument(
        "--term",
        action="append",
        default=[],
        metavar="KIND[:name=value,...]",
        help="a local term baked in, e.g. prox:mu=0.1 or moon:mu=1,tau=0.5 (repeat for several, in the loss's order)",
    )
    p.add_argument("--out", type=Path, default=None, help="artifact directory (default: the program cache)")
    p.add_argument("--batch", type=int, default=50, help="bench: batch size")
    p.add_argument("--threads", type=int, default=1, help="bench: threads for both runtimes")
    p.add_argument("--repeats", type=int, default=5, help="bench: timed passes of 10 steps (after one warm-up)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = _spec(args)
    if args.command == "bench":
        print(json.dumps(step_times(spec, batch=args.batch, threads=args.threads, repeats=args.repeats)))
        return 0
    failed = False
    for kind in args.objective:
        given = {"tau": args.tau, "beta": args.beta, "gamma": args.gamma}
        fields = {f.name for f in dataclasses.fields(objective_classes()[kind])}
        objective = make_objective(kind, {k: repr(float(v)) for k, v in given.items() if k in fields})
        loss = TrainingLoss(objective, terms_from_flags(args.term, float(args.prox_mu)))
        try:
            if args.command == "check":  # what is there, without making anything
                for report in check_artifacts(ArtifactDirectory(args.out)(spec, loss)):
                    print(report)
                    failed |= not report.passed
            else:  # made, checked (the parity gate logs its reports) and written under the cache's name
                print(ArtifactCache(args.out)(spec, loss))
        except (ConfigError, ExportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0
