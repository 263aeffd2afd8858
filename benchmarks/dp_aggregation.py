"""The server's per-round cost of DP-FedAvg (issue 51): ``strategy.accept`` and ``strategy.aggregate`` over 100 replies
of the FedAvg CNN (1.66M values each), plain FedAvg against DP-FedAvg with a fixed and an adaptive clip, timed for the
second round (the first pays one-time costs), one torch thread; and the accountant's cost per round.

Usage: ``.venv/bin/python benchmarks/dp_aggregation.py`` (each variant once, this tree's code), or
``.venv/bin/python benchmarks/dp_aggregation.py --compare OLD NEW --repeats 5``: two source trees (e.g. ``git archive``
of two commits), each variant run in a fresh process against each tree in turn (the order swapped every repeat, so a
change in the machine's load falls on both), and the medians and their ratio new / old, with the load average and the
CPU model."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import cpu_model
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import ServerContext, UpdateReport
from fedge.config import RunConfig
from fedge.learning.models import build_model
from fedge.privacy.accountant import Ledger
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

VARIANTS: dict[str, dict[str, object]] = {
    "plain FedAvg": {},
    "DP-FedAvg, fixed clip": dict(dp_noise_multiplier=1.0, dp_clip="1", dp_delta=1e-5),
    "DP-FedAvg, adaptive": dict(dp_noise_multiplier=1.0, dp_delta=1e-5),
}


def _model() -> nn.Module:
    return build_model("fedavg_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0)


def server_seconds(**dp: object) -> tuple[float, float]:
    """Seconds of round 2's accept (the reply checks) and aggregation of 100 replies (each the global weights plus a
    small random step)."""
    config = RunConfig(algorithm="fedavg", dataset="mnist", num_clients=1000, client_fraction=0.1, **dp)  # type: ignore[arg-type]
    strategy = make_strategy(config, ServerContext(_model, 10, "bench"))
    weights = strategy.global_weights()
    assert weights is not None
    clients = [f"c{i:03d}" for i in range(100)]
    gen = torch.Generator().manual_seed(0)
    accept = aggregate = 0.0
    for rnd in (1, 2):
        strategy.configure(rnd, clients)
        messages = {}
        for c in clients:
            tensors = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
            report = UpdateReport(num_examples=60, loss=1.0)
            messages[c] = Message(UPDATE, rnd, run="bench", client=c, params=wire.to_params(report), tensors=tensors)
        start = time.perf_counter()
        replies = {c: strategy.accept(rnd, c, m) for c, m in messages.items()}
        middle = time.perf_counter()
        strategy.aggregate(rnd, replies)
        accept, aggregate = middle - start, time.perf_counter() - middle
    return accept, aggregate


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def compare(old: Path, new: Path, repeats: int) -> None:
    """Each variant, ``repeats`` times against each tree, alternated; the medians and new / old."""
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; load average (1/5/15 min) at start {load_average()}")
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for i in range(repeats):
        trees = [("old", old), ("new", new)] if i % 2 == 0 else [("new", new), ("old", old)]
        for variant in VARIANTS:
            for label, tree in trees:
                env = {**os.environ, "PYTHONPATH": str(tree)}  # ahead of the editable install's finder
                out = subprocess.run(
                    [sys.executable, __file__, "--variant", variant],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()
                times.setdefault((label, variant), []).append((float(out[0]), float(out[1])))
        print(f"repeat {i + 1}/{repeats} done, load average {load_average()}", flush=True)
    print(f"medians of {repeats} (seconds for 100 fedavg_cnn replies; accept = the reply checks):")
    print(f"| {'variant':<24}| accept old | accept new | new/old | aggregate old | aggregate new | new/old |")
    print("|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        o, n = times[("old", variant)], times[("new", variant)]
        cells = []
        for j in (0, 1):
            mo, mn = statistics.median(t[j] for t in o), statistics.median(t[j] for t in n)
            cells += [f"{mo:.3f}", f"{mn:.3f}", f"{mn / mo:.2f}"]
        print(f"| {variant:<24}| " + " | ".join(cells) + " |")
    print(f"load average at end {load_average()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="time one variant; print 'accept_s aggregate_s'")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"), help="two source trees to alternate")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.variant:
        accept, aggregate = server_seconds(**VARIANTS[args.variant])
        print(f"{accept:.6f} {aggregate:.6f}")
        return
    if args.compare:
        old, new = args.compare
        compare(old, new, args.repeats)
        return
    for variant, dp in VARIANTS.items():
        accept, aggregate = server_seconds(**dp)
        print(f"{variant + ':':<24} accept {accept:.2f} s, aggregate {aggregate:.2f} s")
    for kind in ("rdp", "pld"):
        ledger = Ledger(0.1, 1.0, 1e-5, kind)
        start = time.perf_counter()
        ledger.epsilon(1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        value = ledger.epsilon(200)
        later = time.perf_counter() - start
        print(f"{kind}: one round's analysis {first:.2f} s, epsilon after 200 rounds {later:.3f} s (= {value:.3f})")


if __name__ == "__main__":
    main()
