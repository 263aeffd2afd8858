"""The server's per-round cost of DP-FedAvg (issue 51): ``strategy.aggregate`` over 100 replies of the FedAvg CNN
(1.66M values each), plain FedAvg against DP-FedAvg with a fixed and an adaptive clip, timed for the second round (the
first pays one-time costs), one torch thread; and the accountant's cost per round. Usage:
``.venv/bin/python benchmarks/dp_aggregation.py``."""

from __future__ import annotations

import time

import torch
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import ServerContext, UpdateReport
from fedge.config import RunConfig
from fedge.learning.models import build_model
from fedge.privacy.accountant import Ledger
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message


def _model() -> nn.Module:
    return build_model("fedavg_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0)


def aggregate_seconds(**dp: object) -> float:
    """Seconds of round 2's aggregation of 100 replies (each the global weights plus a small random step)."""
    config = RunConfig(algorithm="fedavg", dataset="mnist", num_clients=1000, client_fraction=0.1, **dp)  # type: ignore[arg-type]
    strategy = make_strategy(config, ServerContext(_model, 10, "bench"))
    weights = strategy.global_weights()
    assert weights is not None
    clients = [f"c{i:03d}" for i in range(100)]
    gen = torch.Generator().manual_seed(0)
    seconds = 0.0
    for rnd in (1, 2):
        strategy.configure(rnd, clients)
        replies = {}
        for c in clients:
            tensors = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
            report = UpdateReport(num_examples=60, loss=1.0)
            message = Message(UPDATE, rnd, run="bench", client=c, params=wire.to_params(report), tensors=tensors)
            replies[c] = strategy.accept(rnd, c, message)
        start = time.perf_counter()
        strategy.aggregate(rnd, replies)
        seconds = time.perf_counter() - start
    return seconds


def main() -> None:
    torch.set_num_threads(1)
    print(f"plain FedAvg:            {aggregate_seconds():.2f} s")
    print(f"DP-FedAvg, fixed clip:   {aggregate_seconds(dp_noise_multiplier=1.0, dp_clip='1', dp_delta=1e-5):.2f} s")
    print(f"DP-FedAvg, adaptive:     {aggregate_seconds(dp_noise_multiplier=1.0, dp_delta=1e-5):.2f} s")
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
