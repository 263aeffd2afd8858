"""Where a simulated round's CPU time goes, and what each arithmetic option saves, in CPU seconds.

Wall-clock figures on a shared 2-core machine mostly measure the neighbours; this thread's CPU time
(``time.thread_time``) does not count the time the thread waits for a core, so the shares and ratios here hold under
load (caches and memory bandwidth are still shared: compare options measured in the same run, interleaved).

The FedNTD setup of ``benchmarks/executors.py`` (fedavg_cnn, 100 clients from shards s = 2, 10 a round, E = 3, B = 50,
momentum SGD, evaluation on the 10,000 test images), one thread, fedge's own code (``TorchBackend``, ``train``,
``predict_logits``, ``weighted_average``, the wire codec):

1. One round's parts in CPU seconds: the ten clients' local training, FedNTD's teacher logits (once per client and
   round, on its 600 images: the teacher is frozen and nothing is augmented here), the test-set evaluation, aggregation
   and the codec; their sum over the cores is the least a round can take on this machine.
2. One client's training under ``torch.profiler``, its operators grouped: convolutions forward and backward, linear
   layers, pooling, ReLU, loss, optimizer, data indexing and copies (the profiler times operators by the clock, so
   under load read the shares, not the seconds).
3. Options, alternated: the papers' order, ReLU before pooling (fedge's eager training and inference pool first,
   :mod:`fedge.learning.pool_first`: exact, as max and ReLU commute; the models and exported programs keep the papers'
   order) and the default NCHW layout
   (fedge trains channels-last on the CPU); CPU time per client and the largest weight difference to fedge's (SGD's
   ``foreach`` and ``fused`` are in ``benchmarks/executors.py``'s arithmetic section).

Usage: python benchmarks/client_profile.py [--data-dir ../shared/data/mnist] [--repeats 5] [--clients 10]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fedge.aggregation.average import weighted_average
from fedge.algorithms.catalog import make_objective
from fedge.learning.backend import TorchBackend
from fedge.learning.training import SGDSettings, TrainRequest, predict_logits, train
from fedge.wire.message import Message, decode, encode
from fedge_io.experiment import prepare

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"

# torch.profiler operator names by group (self CPU time); what matches none counts as "other".
GROUPS = {
    "conv forward": ("mkldnn_convolution", "_convolution", "conv2d"),
    "conv backward": ("convolution_backward",),
    "linear (mm, addmm)": ("aten::mm", "aten::addmm"),
    "max pool fwd+bwd": ("max_pool2d",),
    "relu fwd+bwd": ("relu", "clamp_min", "threshold_backward"),
    "loss": ("cross_entropy", "log_softmax", "nll_loss", "kl_div", "gather", "_softmax"),
    "optimizer (SGD)": ("sgd", "aten::add_", "aten::mul_", "_foreach"),
    "data indexing, copies": ("aten::index", "aten::copy_", "contiguous", "aten::clone", "aten::to"),
    "zero fill": ("aten::fill_", "aten::zero_", "aten::zeros"),
}


def cpu_seconds(fn: Callable[[], object]) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def papers_order(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that fedge's ``train`` runs as it is, ReLU before pooling: an instance of a subclass, which
    :func:`fedge.learning.pool_first.pool_before_relu` leaves alone."""
    copied = copy.deepcopy(model)
    copied.__class__ = type(f"PapersOrder{type(model).__name__}", (type(model),), {})
    return copied


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA))
    p.add_argument("--repeats", type=int, default=5, help="alternated repeats of each option (medians reported)")
    p.add_argument("--clients", type=int, default=10, help="clients in the round of part 1")
    args = p.parse_args()
    torch.set_num_threads(1)
    from executors import setups  # the benchmark's setups (this script runs from benchmarks/)

    exp = prepare(setups(args.data_dir, quick=False)["fedntd"])
    t = exp.config.train
    clients = sorted(exp.parts)[: args.clients]
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    start = backend.get_weights()
    sgd = SGDSettings(lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def request(client: str, objective: str = "ce", inputs: dict[str, torch.Tensor] | None = None) -> TrainRequest:
        d = exp.client_data(client)
        return TrainRequest(
            x=d.x,
            y=d.y,
            objective=make_objective(objective),
            sgd=sgd,
            epochs=t.local_epochs,
            batch_size=t.batch_size,
            seed=1,
            inputs=inputs or {},
        )

    print(
        f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs); "
        f"{exp.model}, {len(clients)} clients of {len(exp.client_data(clients[0]))} samples, E = {t.local_epochs}, "
        f"B = {t.batch_size}"
    )

    # 1. a round's parts
    parts: dict[str, float] = {"clients' training (CE, FedAvg)": 0.0, "FedNTD teacher logits (extra)": 0.0}
    states = []
    for c in clients:
        backend.set_weights(start)
        parts["FedNTD teacher logits (extra)"] += cpu_seconds(lambda c=c: backend.logits(exp.client_data(c).x))
        parts["clients' training (CE, FedAvg)"] += cpu_seconds(lambda c=c: backend.train(request(c)))
        states.append(backend.get_weights())
    test_x, _ = exp.test_tensors()
    parts["evaluation, 10,000 test images"] = cpu_seconds(lambda: predict_logits(backend.model, test_x))
    parts["aggregation"] = cpu_seconds(lambda: weighted_average(states, [1.0] * len(states)))
    msgs = [Message("update", 1, client=c, tensors=s) for c, s in zip(clients, states, strict=True)]
    parts["codec (encode + decode replies)"] = cpu_seconds(lambda: [decode(encode(m)) for m in msgs])
    total = sum(parts.values())
    print(f"\n1. one round's CPU seconds (FedNTD adds its teacher logits to FedAvg's), total {total:.1f} s:")
    for name, s in parts.items():
        print(f"  {name:<34} {s:7.2f} s {100 * s / total:5.1f}%")
    cores = len(os.sched_getaffinity(0))
    fedavg = total - parts["FedNTD teacher logits (extra)"]
    print(f"  least round time on {cores} cores at this speed: {total / cores:.1f} s (FedAvg: {fedavg / cores:.1f} s)")

    # 2. one client's training, by operator group
    backend.set_weights(start)
    backend.train(request(clients[0]))  # warm-up
    backend.set_weights(start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backend.train(request(clients[0]))
    grouped = dict.fromkeys([*GROUPS, "other"], 0.0)
    for event in prof.key_averages():
        if not event.key.startswith("aten::") and event.key not in ("detach",):
            continue  # python-level and optimizer wrapper ranges: their operators are counted themselves
        group = next((g for g, keys in GROUPS.items() if any(k in event.key for k in keys)), "other")
        grouped[group] += event.self_cpu_time_total / 1e6
    whole = sum(grouped.values())
    print(f"\n2. one client's local training by operator (torch.profiler self time; shares), {whole:.2f} s:")
    for name, s in sorted(grouped.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34} {s:7.3f} s {100 * s / whole:5.1f}%")

    # 3. options, alternated
    def run_option(name: str) -> tuple[float, dict[str, torch.Tensor]]:
        r = request(clients[0])
        model = copy.deepcopy(backend.model)  # channels-last; train() runs it pool first
        if name == PAPERS_ORDER:
            model = papers_order(model)
        if name == NCHW:
            model = model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
        else:
            r = dataclasses.replace(r, x=r.x.contiguous(memory_format=torch.channels_last))
        model.load_state_dict(start)
        seconds = cpu_seconds(lambda: train(model, r))
        return seconds, {k: v.detach().clone() for k, v in model.state_dict().items()}

    options = [FEDGE, PAPERS_ORDER, NCHW]
    times: dict[str, list[float]] = {o: [] for o in options}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for o in options:
            seconds, weights[o] = run_option(o)
            times[o].append(seconds)
    base = statistics.median(times[FEDGE])
    print(
        f"\n3. one client's local training, CPU s, median of {args.repeats} alternated (load {os.getloadavg()[0]:.1f}):"
    )
    print(f"  {'option':<40} {'CPU s':>7} {'x fedge':>8} {'max |dw| vs fedge':>18}")
    for o in options:
        med = statistics.median(times[o])
        diff = max(float((weights[o][k] - weights[FEDGE][k]).abs().max()) for k in weights[o])
        print(f"  {o:<40} {med:7.2f} {med / base:7.2f}x {diff:18.2e}")


FEDGE, PAPERS_ORDER, NCHW = "fedge (pool, then ReLU; channels-last)", "papers' order (ReLU, then pool)", "NCHW layout"


if __name__ == "__main__":
    main()
