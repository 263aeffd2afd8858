"""Issue 27's table: one admitted attacker (or three) among K digits clients, per attack and aggregation rule.

Every cell is an in-process run through the same round engine, reply policy and strategy as ``fedge coordinator``
(the attackers of ``tests/support/insiders.py``; the re-hello attack needs a broker and is in
``tests/coordinator/test_insiders.py``). Printed: final accuracy and skipped rounds, next to the all-honest run of the
same seed and rule, and the honest-run cost of each rule against the papers' mean.

Run: ``python experiments/insiders.py [--clients 10] [--rounds 5] [--attackers 1] [--rules NAME ...]`` (``--rules``:
the rules to run, by the start of their name, e.g. ``--rules mean flame``; the honest-run cost is then against the
first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from insiders import Insider

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge_io.experiment import Experiment, prepare
from sim.inprocess import InProcessTransport

RULES = {  # name -> (aggregation, quorum)
    "sim default (mean, quorum 1)": (FedAvgSettings(), 1.0),
    "trimmed_mean (quorum 0.5)": (FedAvgSettings(robust="trimmed_mean"), 0.5),
    "median (quorum 0.5)": (FedAvgSettings(robust="median"), 0.5),
    "clip 1x, the deployment default before issue 52 (mean, quorum 0.5)": (FedAvgSettings(clip_factor=1.0), 0.5),
    "clip 2x (mean, quorum 0.5)": (FedAvgSettings(clip_factor=2.0), 0.5),
    "flame, the deployment default (quorum 0.5)": (FedAvgSettings(robust="flame", clip_factor=1.0), 0.5),
}
ATTACKS = ("replacement", "sign_flip", "int8_offset", "label_rotation")


def config(clients: int, rounds: int, rule: tuple[FedAvgSettings, float], int8: bool, partition: str) -> RunConfig:
    settings, quorum = rule
    return RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=clients,
        rounds=rounds,
        partition=partition,
        min_replies=quorum,
        train=TrainConfig(local_epochs=2, lr=0.1),
        algo=settings,
        upload_codec="int8" if int8 else "float32",
    )


def run(exp: Experiment, attack: str | None, attackers: int) -> tuple[float, int]:
    """Final accuracy and skipped rounds of one run; the first ``attackers`` clients attack."""
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients: list[EdgeClient] = [EdgeClient(c, exp.client_data(c), backend) for c in sorted(exp.parts)]
    if attack is not None:
        ratio = exp.config.algo.max_update_ratio
        clients[:attackers] = [Insider(c, attack, ratio) for c in clients[:attackers]]
    test_x, test_y = exp.test_tensors()
    engine = RoundEngine(exp.config, exp.strategy("insiders"), InProcessTransport(clients), test_x, test_y)
    history = engine.run()
    final = history.rounds[-1].accuracy
    return float(final or 0.0), sum(not r.aggregated for r in history.rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attackers", type=int, default=1)
    p.add_argument("--partition", default="iid", help="iid, or shards (2 classes per client), or dirichlet")
    p.add_argument("--rules", nargs="*", default=None, help="run only the rules whose name starts with one of these")
    args = p.parse_args()
    rules = {n: r for n, r in RULES.items() if args.rules is None or any(n.startswith(w) for w in args.rules)}
    print(
        f"digits, tiny_mlp, {args.partition}, {args.clients} clients, {args.rounds} rounds, "
        f"{args.attackers} attacker(s)"
    )
    print("| attack | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    rows: dict[str, list[str]] = {}
    honest: dict[tuple[str, bool], float] = {}
    for name, rule in rules.items():
        for int8 in (False, True):
            exp = prepare(config(args.clients, args.rounds, rule, int8, args.partition))
            honest[(name, int8)], _ = run(exp, None, 0)
    for label, int8 in (("honest", False), ("honest, int8 uploads", True)):
        rows[label] = [f"{100 * honest[(n, int8)]:.1f}%" for n in rules]
    for attack in ATTACKS:
        int8 = attack == "int8_offset"
        cells = []
        for name, rule in rules.items():
            exp = prepare(config(args.clients, args.rounds, rule, int8, args.partition))
            acc, skipped = run(exp, attack, args.attackers)
            delta = 100 * (acc - honest[(name, int8)])
            cells.append(f"{100 * acc:.1f}% ({delta:+.1f}), {skipped} skipped")
        rows[attack] = cells
        print(f"| {attack} | " + " | ".join(cells) + " |", flush=True)
    for label in ("honest", "honest, int8 uploads"):
        print(f"| {label} | " + " | ".join(rows[label]) + " |")
    base = honest[(next(iter(rules)), False)]
    costs = ", ".join(f"{n} {100 * (honest[(n, False)] - base):+.1f}" for n in rules)
    print(f"honest-run cost against the mean (points): {costs}")


if __name__ == "__main__":
    main()
