"""DS-FL sec. 4 "Model poisoning" (Table IV), scaled to a 2-core machine: one malicious client among K.

Main task MNIST; backdoor task Fashion-MNIST (a Fashion-MNIST image of class c should be classified as class c). The
attacker holds a model w_x trained on MNIST and Fashion-MNIST images with their class numbers as labels.

- FL (FedAvg): the attacker trains honestly, except once every ``--attack-every`` rounds, when it uploads the model
  replacement w_M = K w_x - (K-1) w_g (eq. 19; K the number of clients, w_g the broadcast). Run with plain mean
  aggregation and fedge's update bound off (the paper's FL row), with fedge's default bound (an update may move the
  model at most ``max_update_ratio`` = 10 x the global model's norm), with a bound-aware attacker that shrinks its
  boost to 90% of that bound, and with robust aggregation (coordinate-wise median, trimmed mean, norm clipping) and
  the bound off, so each defence is seen alone.
- DS-FL (SA and ERA): the attacker uploads w_x's softmax outputs on the round's open samples every round and never
  updates w_x.

After the last round: main accuracy = the global model on the MNIST test set; backdoor accuracy = the global model on
the Fashion-MNIST test set (10% is chance). Both are also probed after every round on subsets, to see whether a
planted backdoor survives the honest rounds in between.

The attacker is an :class:`EdgeClient` subclass in this script (nothing in the library knows about it), run by the
same round engine, in-process transport and reply policy as ``fedge sim``; each run writes a normal run directory.
Run: ``bash experiments/poisoning.sh`` (the settings of experiments/results/poisoning/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator.engine import RoundEngine
from coordinator.resume import RunJournal
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.aggregation.robust import state_norm, update_norm
from fedge.algorithms.base import UpdateReport, evaluate_model, update_message
from fedge.algorithms.dsfl import DSFLSettings, DSFLTask, open_index_set
from fedge.algorithms.fedavg import CrossEntropy, FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.data.datasets import load_dataset
from fedge.learning.backend import TorchBackend
from fedge.learning.models import build_model, exchanged_state, load_exchanged_state
from fedge.learning.training import SGDSettings, TrainRequest, predict_logits, train
from fedge.types import StateDict
from fedge.wire import fields as wire
from fedge.wire.message import Message
from fedge_io.experiment import Experiment, prepare
from sim.inprocess import InProcessTransport

ATTACKER = "c000"
MODEL = "dsfl_mnist_cnn"  # DS-FL sec. 4.1's MNIST CNN (583,242 parameters)
INPUT_SHAPE = (1, 28, 28)
KEPT = ("config.json", "partition.json", "metrics.jsonl", "summary.json", "ledger.csv")  # no weights, no journal


class ModelReplacement(EdgeClient):
    """FL attacker: honest, except in every ``every``-th round, when it uploads w_g + boost (w_x - w_g).

    boost = K is eq. 19. With ``bound_ratio`` > 0 the attacker knows the server's update bound and shrinks the boost
    so that its update moves the model 90% of the allowed distance (``bound_ratio`` x the global model's norm).
    """

    def __init__(self, honest: EdgeClient, w_x: StateDict, k: int, every: int, bound_ratio: float = 0.0) -> None:
        super().__init__(honest.client_id, honest.data, honest.backend)
        self.w_x, self.k, self.every, self.bound_ratio = w_x, k, every, bound_ratio
        self.boosts: dict[int, float] = {}  # attack round -> boost used

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        if task.round % self.every or broadcast is None:
            return super().handle(task, broadcast)
        w_g = dict(broadcast.tensors)
        boost = float(self.k)
        if self.bound_ratio > 0:
            room = 0.9 * self.bound_ratio * max(state_norm(w_g), 1.0)  # the server's rule, FedAvg.check_reply
            boost = min(boost, room / update_norm(self.w_x, w_g))
        self.boosts[task.round] = boost
        w_m = {n: (w_g[n] + boost * (self.w_x[n] - w_g[n])).contiguous() for n in w_g}  # eq. 19 for boost = K
        return update_message(task, w_m, UpdateReport(num_examples=len(self.data), loss=0.0))


class FrozenTeacher(EdgeClient):
    """DS-FL attacker: uploads w_x's softmax outputs on the round's open samples; never distills or trains."""

    def __init__(self, honest: EdgeClient, w_x: StateDict) -> None:
        super().__init__(honest.client_id, honest.data, honest.backend)
        self.model = build_model(MODEL, input_shape=INPUT_SHAPE, num_classes=10)
        load_exchanged_state(self.model, w_x)

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        extra = wire.from_params(DSFLTask, task.params, defaults=False)
        settings = wire.from_params(DSFLSettings, task.params)
        assert self.data.open_x is not None
        idx = torch.from_numpy(open_index_set(extra.open_size, settings.open_per_round, extra.index_seed))
        probs = torch.softmax(predict_logits(self.model, self.data.open_x[idx]), dim=1)  # (|o_r|, C)
        return update_message(task, {"soft_labels": probs.contiguous()}, UpdateReport(num_examples=len(self.data)))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One row of the table."""

    slug: str  # run directory
    label: str
    config: RunConfig
    attacked: bool = True
    bound_aware: bool = False


@dataclasses.dataclass(frozen=True)
class TestSets:
    """MNIST (main) and Fashion-MNIST (backdoor) test sets, and fixed subsets of the latter for per-round probes."""

    main: tuple[torch.Tensor, torch.Tensor]
    backdoor: tuple[torch.Tensor, torch.Tensor]
    backdoor_probe: tuple[torch.Tensor, torch.Tensor]


def as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(x), torch.from_numpy(y)


def accuracy(weights: StateDict, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model = build_model(MODEL, input_shape=INPUT_SHAPE, num_classes=10)
    load_exchanged_state(model, weights)
    return evaluate_model(model, *data, 10).accuracy


def backdoor_model(
    mnist: Experiment, fashion_x: np.ndarray, fashion_y: np.ndarray, args: argparse.Namespace
) -> StateDict:
    """w_x: the DS-FL MNIST CNN trained on MNIST and Fashion-MNIST training images, labels = class numbers."""
    rng = np.random.default_rng(args.seed)
    a = rng.choice(len(mnist.train), args.wx_samples, replace=False)
    b = rng.choice(len(fashion_x), args.wx_samples, replace=False)
    x = torch.from_numpy(np.concatenate([mnist.train.x[a], fashion_x[b]]))
    y = torch.from_numpy(np.concatenate([mnist.train.y[a], fashion_y[b]]))
    model = build_model(MODEL, input_shape=INPUT_SHAPE, num_classes=10, seed=args.seed + 1)
    train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(0.05, 0.9), args.wx_epochs, 100, args.seed))
    return exchanged_state(model)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    base = RunConfig(
        algorithm="fedavg",
        dataset="mnist",
        data_dir=str(args.data_dir / "mnist"),
        model=MODEL,
        num_clients=args.clients,
        rounds=args.rounds,
        partition="iid",
        seed=args.seed,
        min_replies=0.5,  # a refused attacker must not stall the round
        eval_samples=args.eval_samples,  # per-round main accuracy on a subset; the final one on the whole test set
        open_size=args.open_size,
        private_size=args.private_size,  # FL and DS-FL clients hold the same private data
        # DS-FL sec. 4.1: plain SGD, lr 0.1 (batch 100 and 5 local epochs there)
        train=TrainConfig(
            lr=0.1,
            momentum=0.0,
            weight_decay=0.0,
            lr_decay=1.0,
            local_epochs=args.local_epochs,
            batch_size=args.batch_size,
        ),
    )

    def fl(**settings: Any) -> RunConfig:
        return dataclasses.replace(base, algo=FedAvgSettings(**settings))

    def dsfl(aggregation: str) -> RunConfig:
        algo = DSFLSettings(
            aggregation=aggregation, open_per_round=args.open_per_round, distill_epochs=1, distill_batch_size=100
        )
        return dataclasses.replace(base, algorithm="dsfl", algo=algo)

    return [
        Scenario("fl-clean", "FL, no attacker (reference)", fl(max_update_ratio=0), attacked=False),
        Scenario("fl-mean-nobound", "FL, mean, update bound off", fl(max_update_ratio=0)),
        Scenario("fl-mean-bound", "FL, mean, fedge default (update bound 10x)", fl()),
        Scenario("fl-mean-bound-aware", "FL, mean, bound 10x, bound-aware attacker", fl(), bound_aware=True),
        Scenario("fl-median", "FL, coordinate-wise median, bound off", fl(robust="median", max_update_ratio=0)),
        Scenario("fl-trimmed", "FL, trimmed mean (20%), bound off", fl(robust="trimmed_mean", max_update_ratio=0)),
        Scenario("fl-clip", "FL, mean + norm clipping (1x median), bound off", fl(clip_factor=1.0, max_update_ratio=0)),
        Scenario("dsfl-sa", "DS-FL, SA", dsfl("sa")),
        Scenario("dsfl-era", "DS-FL, ERA", dsfl("era")),
    ]


def run(sc: Scenario, w_x: StateDict, tests: TestSets, args: argparse.Namespace) -> dict[str, Any]:
    """Run one scenario; write its run directory; return its figures."""
    started = time.perf_counter()
    exp = prepare(sc.config)
    run_dir = args.runs / sc.slug
    shutil.rmtree(run_dir, ignore_errors=True)
    open_x = exp.open_x()
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)  # one runtime, used in turn
    clients = [EdgeClient(c, exp.client_data(c, open_x), backend) for c in sorted(exp.parts)]
    attacker: EdgeClient | None = None
    if sc.attacked and sc.config.algorithm == "dsfl":
        attacker = FrozenTeacher(clients[0], w_x)
    elif sc.attacked:
        ratio = sc.config.algo.max_update_ratio if sc.bound_aware else 0.0
        attacker = ModelReplacement(clients[0], w_x, sc.config.num_clients, args.attack_every, ratio)
    if attacker is not None:
        assert attacker.client_id == ATTACKER
        clients[0] = attacker
    strategy = exp.strategy(run_dir.name)
    test_x, test_y = exp.test_tensors()
    transport = InProcessTransport(clients)
    engine = RoundEngine(exp.config, strategy, transport, test_x, test_y, initial_bytes=exp.initial_bytes())
    journal = RunJournal(run_dir, exp.config, exp.partition_summary(), engine)
    probes: list[float] = []

    def record(r: RoundRecord) -> None:
        journal.round(r)
        weights = strategy.global_weights()
        assert weights is not None
        probes.append(accuracy(weights, tests.backdoor_probe))
        refused = [x.reason for x in r.rejections]
        print(
            f"  {sc.slug} round {r.round:2d}: main {100 * (r.accuracy or 0):5.1f}%  backdoor {100 * probes[-1]:5.1f}%"
            f"  {time.perf_counter() - started:6.0f} s{'  refused: ' + '; '.join(refused) if refused else ''}",
            flush=True,
        )

    history = engine.run(record)
    weights = strategy.global_weights()
    assert weights is not None
    journal.finish(weights, initial_bytes=exp.initial_bytes(), extra={"model": exp.model, "transport": "inprocess"})
    result: dict[str, Any] = {
        "label": sc.label,
        "main": accuracy(weights, tests.main),
        "backdoor": accuracy(weights, tests.backdoor),
        "main_by_round": [round(r.accuracy or 0.0, 4) for r in history.rounds],
        "backdoor_by_round": [round(b, 4) for b in probes],
        "attacker_refused": [
            {"round": r.round, "category": x.category, "reason": x.detail} for r in history.rounds for x in r.rejections
        ],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if isinstance(attacker, ModelReplacement):
        result["attack_rounds"] = sorted(attacker.boosts)
        result["boosts"] = {str(r): round(b, 3) for r, b in sorted(attacker.boosts.items())}
    keep = args.out / sc.slug
    keep.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        shutil.copy(run_dir / name, keep / name)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data"), help="holds mnist/ and fashion_mnist/")
    p.add_argument("--clients", type=int, default=10, help="K, the attacker included")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--attack-every", type=int, default=5, help="FL: the attacker replaces the model every N rounds")
    p.add_argument("--private-size", type=int, default=5_000, help="I^p, labeled samples over all clients")
    p.add_argument("--open-size", type=int, default=10_000, help="I^o, DS-FL's unlabeled open set")
    p.add_argument("--open-per-round", type=int, default=500, help="|o_r|")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--wx-samples", type=int, default=10_000, help="w_x trains on this many MNIST + as many Fashion")
    p.add_argument("--wx-epochs", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=1_000, help="MNIST test samples of the per-round probe")
    p.add_argument("--probe-samples", type=int, default=1_000, help="Fashion-MNIST test samples of the per-round probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None, help="run only these scenarios (slugs)")
    p.add_argument("--runs", type=Path, default=Path("runs/poisoning"), help="full run directories")
    p.add_argument("--out", type=Path, default=Path("experiments/results/poisoning"), help="small files + results")
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()

    todo = [sc for sc in scenarios(args) if args.only is None or sc.slug in args.only]
    mnist = prepare(todo[0].config)
    fashion_train, fashion_test = load_dataset("fashion_mnist", args.data_dir / "fashion_mnist")
    probe = np.random.default_rng(args.seed).choice(len(fashion_test), args.probe_samples, replace=False)
    tests = TestSets(
        main=as_tensors(mnist.test.x, mnist.test.y),
        backdoor=as_tensors(fashion_test.x, fashion_test.y),
        backdoor_probe=as_tensors(fashion_test.x[probe], fashion_test.y[probe]),
    )
    w_x = backdoor_model(mnist, fashion_train.x, fashion_train.y, args)
    wx = {"main": accuracy(w_x, tests.main), "backdoor": accuracy(w_x, tests.backdoor)}
    print(
        f"w_x: main {100 * wx['main']:.1f}%  backdoor {100 * wx['backdoor']:.1f}%"
        f"  ({time.perf_counter() - started:.0f} s)"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for sc in todo:
        results[sc.slug] = run(sc, w_x, tests, args)
        r = results[sc.slug]
        print(f"{sc.label:50s} main {100 * r['main']:5.1f}%  backdoor {100 * r['backdoor']:5.1f}%", flush=True)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta = {"setup": setup, "w_x": wx, "wall_s": round(time.perf_counter() - started, 1)}
    (args.out / "results.json").write_text(json.dumps({**meta, "runs": results}, indent=2) + "\n")
    print(f"wall time {meta['wall_s']} s; results in {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
