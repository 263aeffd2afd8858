"""DS-FL sec. 4 "Model poisoning" (Table IV), scaled to a 2-core machine: one malicious client among K.

Main task MNIST, backdoor task Fashion-MNIST (a Fashion-MNIST image of class c should be classified as c). The
attacker holds a model w_x trained on MNIST + Fashion-MNIST. In FL (FedAvg) it uploads w_M = K w_x - (K-1) w_g
(DS-FL eq. 19), a model replacement, in the attack rounds, and behaves honestly otherwise; in DS-FL it uploads the
softmax outputs of w_x on the round's open samples every round, never updating w_x. After the last round we measure
the global model's accuracy on the MNIST test set (main) and on the Fashion-MNIST test set (backdoor).

Run: ``python experiments/poisoning.py --rounds 5 --out experiments/results/poisoning`` (about 10 minutes here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from common.experiment import prepare
from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge import wire
from fedge.algorithms.base import UpdateReport, evaluate_model, update_message
from fedge.algorithms.dsfl import DSFLSettings, DSFLTask, open_index_set
from fedge.algorithms.fedavg import CrossEntropy, FedAvgSettings
from fedge.backend import TorchBackend
from fedge.config import RunConfig, TrainConfig
from fedge.data import load_dataset
from fedge.messages import Message
from fedge.models import build_model, exchanged_state, load_exchanged_state
from fedge.training import SGDSettings, TrainRequest, predict_logits, train
from sim.inprocess import InProcessTransport

ATTACKER = "c000"


class Attacker(EdgeClient):
    """Model replacement in FL (eq. 19) in ``attack_rounds``; w_x's outputs in DS-FL every round."""

    def __init__(self, inner: EdgeClient, w_x: dict[str, torch.Tensor], k: int, attack_rounds: set[int]) -> None:
        super().__init__(inner.client_id, inner.data, inner.backend)
        self.w_x, self.k, self.attack_rounds = w_x, k, attack_rounds
        self.model = build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10)
        load_exchanged_state(self.model, w_x)

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        report = UpdateReport(num_examples=len(self.data), loss=0.0)
        if task.params["algorithm"] == "dsfl":
            extra = wire.from_params(DSFLTask, task.params, defaults=False)
            settings = wire.from_params(DSFLSettings, task.params)
            assert self.data.open_x is not None
            idx = torch.from_numpy(open_index_set(extra.open_size, settings.open_per_round, extra.index_seed))
            probs = torch.softmax(predict_logits(self.model, self.data.open_x[idx]), dim=1)
            return update_message(task, {"soft_labels": probs.contiguous()}, report)
        if task.round not in self.attack_rounds or broadcast is None:
            return super().handle(task, broadcast)
        w_g = broadcast.tensors
        w_m = {n: self.k * self.w_x[n] - (self.k - 1) * w_g[n] for n in w_g}  # eq. 19
        return update_message(task, w_m, report)


def backdoor_model(data_dir: Path, samples: int, seed: int) -> dict[str, torch.Tensor]:
    """w_x: trained on MNIST and Fashion-MNIST images with their class numbers as labels."""
    mnist, _ = load_dataset("mnist", data_dir / "mnist")
    fashion, _ = load_dataset("fashion_mnist", data_dir / "fashion_mnist")
    rng = np.random.default_rng(seed)
    a, b = rng.choice(len(mnist), samples, replace=False), rng.choice(len(fashion), samples, replace=False)
    x = torch.from_numpy(np.concatenate([mnist.x[a], fashion.x[b]]))
    y = torch.from_numpy(np.concatenate([mnist.y[a], fashion.y[b]]))
    model = build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10, seed=seed)
    train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(0.05, 0.9), 3, 50, seed))
    return exchanged_state(model)


def run(config: RunConfig, w_x: dict, attack_rounds: set[int], fashion_test) -> dict[str, float]:
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    open_x = exp.open_x()
    clients = []
    for cid in sorted(exp.parts):
        client = EdgeClient(cid, exp.client_data(cid, open_x), backend)
        if cid == ATTACKER:
            client = Attacker(client, w_x, config.num_clients, attack_rounds)
        clients.append(client)
    strategy = exp.strategy("poison")
    test_x, test_y = exp.test_tensors()
    history = RoundEngine(exp.config, strategy, InProcessTransport(clients), test_x, test_y).run()
    weights = strategy.global_weights()
    model = build_model(exp.model, input_shape=exp.input_shape, num_classes=10)
    load_exchanged_state(model, weights)
    backdoor = evaluate_model(model, *fashion_test, 10).accuracy
    rejected = sum(1 for r in history.rounds for x in r.rejections if x.client == ATTACKER)
    return {"main": float(history.rounds[-1].accuracy or 0), "backdoor": backdoor, "attacker_rejected": rejected}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("experiments/results/poisoning"))
    args = p.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    w_x = backdoor_model(args.data_dir, 10_000, seed=1)
    _, fashion = load_dataset("fashion_mnist", args.data_dir / "fashion_mnist")
    fashion_test = (torch.from_numpy(fashion.x), torch.from_numpy(fashion.y))
    attack_rounds = {r for r in range(1, args.rounds + 1) if r % 5 == 0 or r == args.rounds}  # every 5th and the last
    base = RunConfig(
        algorithm="fedavg",
        dataset="mnist",
        data_dir=str(args.data_dir / "mnist"),
        model="dsfl_mnist_cnn",
        num_clients=args.clients,
        rounds=args.rounds,
        partition="iid",
        min_replies=0.5,  # a refused attacker must not stall the round
        open_size=10_000,
        private_size=10_000,
        train=TrainConfig(lr=0.1, momentum=0.0, weight_decay=0.0, lr_decay=1.0, local_epochs=1, batch_size=50),
    )
    fl = dataclasses.replace(base, algorithm="fedavg")
    runs = {
        "FL (FedAvg mean, no update bound)": dataclasses.replace(fl, algo=FedAvgSettings(max_update_ratio=0)),
        "FL, fedge default (update bound 10x)": dataclasses.replace(fl, algo=FedAvgSettings()),
        "FL, median, no update bound": dataclasses.replace(
            fl, algo=FedAvgSettings(robust="median", max_update_ratio=0)
        ),
        "DS-FL SA": dataclasses.replace(
            base, algorithm="dsfl", algo=DSFLSettings(aggregation="sa", open_per_round=1000)
        ),
        "DS-FL ERA": dataclasses.replace(
            base, algorithm="dsfl", algo=DSFLSettings(aggregation="era", open_per_round=1000)
        ),
    }
    results = {}
    for name, config in runs.items():
        results[name] = run(config, w_x, attack_rounds, fashion_test)
        print(
            f"{name:40s} main {100 * results[name]['main']:5.1f}%  backdoor {100 * results[name]['backdoor']:5.1f}%"
            f"  attacker updates refused {results[name]['attacker_rejected']}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "rounds": args.rounds,
        "clients": args.clients,
        "attack_rounds": sorted(attack_rounds),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (args.out / "results.json").write_text(json.dumps({"setup": meta, "runs": results}, indent=2) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
