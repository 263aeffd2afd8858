"""Local-training throughput of the simulator against a plain PyTorch loop on the same data, in the same run.

Both sides train the same model from the same weights for the same number of epochs, batch size and optimizer.
The simulator side is the full in-process path of one round (task and broadcast encoded and decoded, weights loaded,
local SGD, weights encoded back), so the ratio shows what fedge's machinery costs on top of the arithmetic.
Absolute numbers depend on the machine; the ratio is the result.

Usage: python benchmarks/local_training.py [--model fedavg_cnn] [--samples 600] [--epochs 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F

from edge_client.client import EdgeClient
from fedge.algorithms import make_strategy
from fedge.algorithms.base import ClientData, ServerContext
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.learning.models import build_model
from sim.inprocess import InProcessTransport


def plain_loop(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, seed: int) -> None:
    """What a researcher writes by hand: shuffle, batch, CE, momentum SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(cfg.local_epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--samples", type=int, default=600, help="local dataset size (FedNTD MNIST: 600 per client)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    shape, classes = (1, 28, 28), 10
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, *shape, generator=gen)
    y = torch.randint(0, classes, (args.samples,), generator=gen)
    train = TrainConfig(local_epochs=args.epochs, batch_size=args.batch_size)
    samples = args.samples * args.epochs

    def model_factory() -> torch.nn.Module:
        return build_model(args.model, input_shape=shape, num_classes=classes, seed=0)

    backend = TorchBackend(args.model, shape, classes)
    results: dict[str, list[float]] = {"plain PyTorch loop": [], "fedge FedAvg round": [], "fedge FedNTD round": []}
    for _ in range(args.repeats):
        model = model_factory()
        t = time.perf_counter()
        plain_loop(model, x, y, train, seed=0)
        results["plain PyTorch loop"].append(samples / (time.perf_counter() - t))
        for algorithm in ("fedavg", "fedntd"):
            cfg = RunConfig(algorithm=algorithm, num_clients=1, train=train)
            strategy = make_strategy(cfg, ServerContext(model_factory, classes))
            client = EdgeClient("c000", ClientData(x=x, y=y, num_classes=classes), backend)
            transport = InProcessTransport([client])
            plan = strategy.configure(1, ["c000"])
            t = time.perf_counter()
            exchange = transport.exchange(plan, functools.partial(strategy.accept, 1))
            elapsed = time.perf_counter() - t
            assert exchange.replies, exchange.rejections
            results[f"fedge {'FedAvg' if algorithm == 'fedavg' else 'FedNTD'} round"].append(samples / elapsed)

    base = statistics.median(results["plain PyTorch loop"])
    print(
        f"model {args.model}, {args.samples} samples x {args.epochs} epochs, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}, "
        f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs"
    )
    print(f"{'path':<22} {'samples/s':>10} {'vs plain':>9}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<22} {med:>10.0f} {med / base:>8.2f}x")


if __name__ == "__main__":
    main()
