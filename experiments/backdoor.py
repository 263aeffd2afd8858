"""Issue 52: deployment defaults measured against a data-poisoning backdoor, confident liars in DS-FL, and their
honest-run cost.

Three experiments, each cell an in-process run through the same round engine, reply policy and strategy as
``fedge coordinator`` (quorum 0.5, ``max_update_ratio`` 10), the attackers being ordinary clients or the
``confident_wrong`` insider of ``tests/support/insiders.py``:

- ``backdoor``: digits, tiny_mlp, 10 clients (IID), 20 rounds, 2 local epochs at lr 0.1. The first 0, 1 or 3 clients
  poison their own data (no boosting, no crafted update): half of their samples, chosen once, get the 3x3 top-left
  corner set to the data set's largest pixel value and the label ``TARGET``. Reported: clean accuracy on the test
  set, attack success (the share of triggered test images outside ``TARGET`` classified as ``TARGET``; the honest run
  gives the baseline), rounds skipped and updates refused or left out.
- ``long``: the ``backdoor`` setting (IID) to round 40, under FLAME (the default), FLAME with noise, the median and
  the clip, and FLAME with ``--max-update-ratio 5``: does a rule that holds to round 20 keep holding? Then a tenth of
  each poisoner's data under both FLAMEs.
- ``secagg``: the ``backdoor`` setting under secure aggregation, where the server sees only the sum and every robust
  rule is refused: what remains is each client's own clip to ``--secagg-clip`` (the default, 5, and 1) before masking.
- ``dsfl``: DS-FL on digits (tiny_mlp, IID, 10 clients, 300 open samples a round), 0, 1 or 3 clients uploading
  confidently wrong one-hot rows, 20 rounds, accuracy after every round; the default (median, ERA) under seeds 1 and 2
  as well.
- ``floor``: the ``dsfl`` setting with no liar, the first 0, 1 or 3 clients absent (they answer every task with an
  error, so each round aggregates the others): an ideal filter that left out exactly the liars' uploads would give
  this run, so its gap to the all-honest run is what any aggregation rule must at least concede. Mean and median
  (both ERA), seeds 0, 1, 2.
- ``cost``: honest MNIST runs, tiny_mlp, 10 clients, 10 rounds, 1 local epoch at lr 0.05, shards s = 2
  and Dirichlet (LDA) alpha 0.1, under each candidate rule.

Every cell is written to ``--out/cells/<experiment>-<cell>.json`` as it finishes, and a cell already there is not run
again (resumable). ``--table`` prints the README tables from the cells.

Run: ``nice -n 10 python experiments/backdoor.py backdoor|weak|long|secagg|dsfl|floor|cost [--out DIR]`` then
``... --table``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from insiders import BACKDOOR_TARGET, dsfl_accuracies, poisoned, trigger

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.algorithms.base import evaluate_model
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import SECAGG_CLIP, RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.learning.models import build_model, load_exchanged_state
from fedge_io.experiment import Experiment, prepare
from sim.inprocess import InProcessTransport

TARGET = BACKDOOR_TARGET
POISON_SHARE = 0.5
RULES: dict[str, FedAvgSettings] = {  # the FedAvg-family candidates, each with max_update_ratio 10 and quorum 0.5
    "mean": FedAvgSettings(),
    "clip1": FedAvgSettings(clip_factor=1.0),  # the deployment default before issue 52
    "clip1+noise": FedAvgSettings(clip_factor=1.0, noise_factor=0.01),  # Sun et al. 2019: clipping + weak noise
    "median": FedAvgSettings(robust="median"),
    "trimmed_mean": FedAvgSettings(robust="trimmed_mean"),
    "flame": FedAvgSettings(robust="flame"),
    "flame+noise": FedAvgSettings(robust="flame", noise_factor=0.001),  # FLAME's lambda for image tasks
    "flame+ratio5": FedAvgSettings(robust="flame", max_update_ratio=5.0),  # a tighter update bound (experiment long)
}
BACKDOOR_RULES = ("mean", "clip1", "clip1+noise", "median", "trimmed_mean", "flame", "flame+noise")
LONG_RULES = ("flame", "flame+noise", "median", "clip1", "flame+ratio5")
DSFL_RULES = ("mean/era", "median/era", "mean/sa", "median/sa")
COST_RULES = ("mean", "clip1", "median", "flame")


def fedavg_config(dataset: str, partition: str, rule: str, *, rounds: int, epochs: int, lr: float) -> RunConfig:
    return RunConfig(
        algorithm="fedavg",
        dataset=dataset,
        model="tiny_mlp",
        num_clients=10,
        rounds=rounds,
        partition=partition,
        min_replies=0.5,
        data_dir="/work/shared/data" if dataset == "mnist" else None,
        train=TrainConfig(local_epochs=epochs, lr=lr),
        algo=RULES[rule],
    )


def run_fedavg(exp: Experiment, attackers: int, share: float = POISON_SHARE) -> dict[str, Any]:
    """One run; the first ``attackers`` clients poison their data. Clean accuracy and attack success per round."""
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    test_x, test_y = exp.test_tensors()
    value = float(exp.train.x.max())
    clients = [EdgeClient(c, exp.client_data(c), backend) for c in sorted(exp.parts)]
    for i in range(attackers):
        c = clients[i]
        clients[i] = EdgeClient(c.client_id, poisoned(c.data, value, seed=i, share=share), backend)
    strategy = exp.strategy("backdoor")
    keep = test_y != TARGET
    triggered_x, triggered_y = trigger(test_x[keep], value), torch.full_like(test_y[keep], TARGET)
    model = build_model(exp.model, input_shape=exp.input_shape, num_classes=exp.num_classes)
    success: list[float] = []

    def on_round(_: Any) -> None:
        weights = strategy.global_weights()
        assert weights is not None
        load_exchanged_state(model, weights)
        success.append(evaluate_model(model, triggered_x, triggered_y, exp.num_classes).accuracy)

    engine = RoundEngine(exp.config, strategy, InProcessTransport(clients), test_x, test_y)
    history = engine.run(on_round)
    attacker_ids = {c.client_id for c in clients[:attackers]}
    return {
        "clean_by_round": [round(float(r.accuracy or 0.0), 4) for r in history.rounds],
        "success_by_round": [round(s, 4) for s in success],
        "skipped": sum(not r.aggregated for r in history.rounds),
        "refused": sum(
            len({x.client for x in r.rejections} | {d.client for d in r.drops if d.reason.startswith("refused")})
            for r in history.rounds
        ),
        "attackers_refused": sum(
            len(attacker_ids & ({x.client for x in r.rejections} | {d.client for d in r.drops})) for r in history.rounds
        ),
    }


def cells(experiment: str) -> list[tuple[str, Any]]:
    """(cell name, thunk) of one experiment, in run order."""
    out: list[tuple[str, Any]] = []
    if experiment == "weak":  # a tenth of each poisoning client's data, IID and shards
        for partition in ("iid", "shards"):
            for rule in ("mean", "clip1", "median", "flame"):
                for attackers in (0, 1, 3):
                    config = fedavg_config("digits", partition, rule, rounds=20, epochs=2, lr=0.1)
                    out.append(
                        (
                            f"{partition}-{rule}-a{attackers}",
                            lambda c=config, a=attackers: run_fedavg(prepare(c), a, 0.1),
                        )
                    )
    elif experiment == "backdoor":
        for attackers in (0, 1, 3):
            for rule in BACKDOOR_RULES:
                config = fedavg_config("digits", "iid", rule, rounds=20, epochs=2, lr=0.1)
                out.append((f"{rule}-a{attackers}", lambda c=config, a=attackers: run_fedavg(prepare(c), a)))
        for rule in ("clip1", "flame", "median", "mean"):  # non-IID: 2-class shards
            for attackers in (0, 1, 3):
                config = fedavg_config("digits", "shards", rule, rounds=20, epochs=2, lr=0.1)
                out.append((f"shards-{rule}-a{attackers}", lambda c=config, a=attackers: run_fedavg(prepare(c), a)))
    elif experiment == "long":  # IID, to round 40; then the weaker poisoning (a tenth of the data) under FLAME
        for rule in LONG_RULES:
            for attackers in (0, 1, 3):
                config = fedavg_config("digits", "iid", rule, rounds=40, epochs=2, lr=0.1)
                out.append((f"{rule}-a{attackers}", lambda c=config, a=attackers: run_fedavg(prepare(c), a)))
        for rule in ("flame", "flame+ratio5"):
            for attackers in (1, 3):
                config = fedavg_config("digits", "iid", rule, rounds=40, epochs=2, lr=0.1)
                out.append((f"weak-{rule}-a{attackers}", lambda c=config, a=attackers: run_fedavg(prepare(c), a, 0.1)))
    elif experiment == "secagg":  # what holds where the server sees only the sum: each client's own clip
        for clip in (SECAGG_CLIP, 1.0):
            for attackers in (0, 1, 3):
                config = dataclasses.replace(
                    fedavg_config("digits", "iid", "mean", rounds=20, epochs=2, lr=0.1),
                    secure_aggregation=True,
                    secagg_clip=clip,
                )
                out.append((f"secagg{clip:g}-a{attackers}", lambda c=config, a=attackers: run_fedavg(prepare(c), a)))
    elif experiment == "dsfl":
        for name in DSFL_RULES:
            for attackers in (0, 1, 3):
                robust, aggregation = name.split("/")

                def thunk(r: str = robust, g: str = aggregation, a: int = attackers) -> dict[str, Any]:
                    return {"accuracy_by_round": [round(x, 4) for x in dsfl_accuracies(r, a, 20, aggregation=g)]}

                out.append((f"{robust}-{aggregation}-a{attackers}", thunk))
        for seed in (1, 2):  # the default (median, ERA) again under two more seeds: how far apart honest runs are
            for attackers in (0, 1, 3):

                def seeded(s: int = seed, a: int = attackers) -> dict[str, Any]:
                    acc = dsfl_accuracies("median", a, 20, seed=s, aggregation="era")
                    return {"accuracy_by_round": [round(x, 4) for x in acc]}

                out.append((f"median-era-s{seed}-a{attackers}", seeded))
    elif experiment == "floor":  # DS-FL without liars, 0, 1 or 3 clients absent: what an ideal filter gives
        for robust in ("median", "mean"):
            for seed in (0, 1, 2):
                for absent in (0, 1, 3):

                    def left_out(r: str = robust, s: int = seed, k: int = absent) -> dict[str, Any]:
                        acc = dsfl_accuracies(r, 0, 20, seed=s, aggregation="era", absent=k)
                        return {"accuracy_by_round": [round(x, 4) for x in acc]}

                    out.append((f"{robust}-s{seed}-absent{absent}", left_out))
    else:
        for rules in (COST_RULES, ("trimmed_mean", "flame+noise")):  # the second group only if time allows
            for partition in ("shards", "dirichlet"):
                for rule in rules:
                    config = fedavg_config("mnist", partition, rule, rounds=10, epochs=1, lr=0.05)
                    out.append((f"{partition}-{rule}", lambda c=config: run_fedavg(prepare(c), 0)))
        for rule in ("mean", "clip1", "flame"):  # does FLAME's cost on LDA 0.1 shrink with rounds?
            config = fedavg_config("mnist", "dirichlet", rule, rounds=20, epochs=1, lr=0.05)
            out.append((f"dirichlet-{rule}-r20", lambda c=config: run_fedavg(prepare(c), 0)))
        for partition, rule in (("dirichlet", "flame+ratio5"), ("shards", "flame"), ("shards", "flame+ratio5")):
            config = fedavg_config("mnist", partition, rule, rounds=20, epochs=1, lr=0.05)  # the tighter bound's cost
            out.append((f"{partition}-{rule}-r20", lambda c=config: run_fedavg(prepare(c), 0)))
    return out


def table(out: Path) -> None:
    """The README's tables from the cells written so far."""
    got = {p.stem: json.loads(p.read_text()) for p in sorted((out / "cells").glob("*.json"))}

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    print("Backdoor (digits, 10 clients, 20 rounds): clean accuracy / attack success / skipped rounds / refusals")
    print("| rule | honest | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|---|")
    for rule in BACKDOOR_RULES:
        row = []
        for a in (0, 1, 3):
            c = got.get(f"backdoor-{rule}-a{a}")
            row.append(
                "-"
                if c is None
                else f"{pct(c['clean_by_round'][-1])} / {pct(c['success_by_round'][-1])} / {c['skipped']} / "
                f"{c['refused']}"
            )
        print(f"| {rule} | " + " | ".join(row) + " |")
    print("\nTo round 40 (experiment long; IID): attack success at rounds 10 / 20 / 25 / 30 / 40; clean accuracy and")
    print("refusals at round 40")
    print("| rule | honest | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|---|")
    for rule in LONG_RULES:
        row = []
        for a in (0, 1, 3):
            c = got.get(f"long-{rule}-a{a}")
            if c is None:
                row.append("-")
                continue
            at = " / ".join(pct(c["success_by_round"][r - 1]) for r in (10, 20, 25, 30, 40))
            row.append(f"{at}; {pct(c['clean_by_round'][-1])}, {c['refused']} refused")
        print(f"| {rule} | " + " | ".join(row) + " |")
    print("\nA tenth of each poisoner's data, to round 40 (IID): attack success at rounds 10 / 20 / 25 / 30 / 40;")
    print("refusals (the honest runs are the table's above)")
    print("| rule | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|")
    for rule in ("flame", "flame+ratio5"):
        row = []
        for a in (1, 3):
            c = got.get(f"long-weak-{rule}-a{a}")
            if c is None:
                row.append("-")
                continue
            row.append(
                " / ".join(pct(c["success_by_round"][r - 1]) for r in (10, 20, 25, 30, 40)) + f"; {c['refused']}"
            )
        print(f"| {rule} | " + " | ".join(row) + " |")
    print("\nUnder secure aggregation (each client's own clip; IID, as above)")
    print("| client clip | honest | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|---|")
    for clip in (SECAGG_CLIP, 1.0):
        row = []
        for a in (0, 1, 3):
            c = got.get(f"secagg-secagg{clip:g}-a{a}")
            row.append("-" if c is None else f"{pct(c['clean_by_round'][-1])} / {pct(c['success_by_round'][-1])}")
        print(f"| --secagg-clip {clip:g} | " + " | ".join(row) + " |")
    print("\nThe same on 2-class shards")
    print("| rule | honest | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|---|")
    for rule in ("mean", "clip1", "median", "flame"):
        row = []
        for a in (0, 1, 3):
            c = got.get(f"backdoor-shards-{rule}-a{a}")
            row.append(
                "-"
                if c is None
                else f"{pct(c['clean_by_round'][-1])} / {pct(c['success_by_round'][-1])} / {c['skipped']} / "
                f"{c['refused']}"
            )
        print(f"| {rule} | " + " | ".join(row) + " |")
    print("\nA tenth of each poisoning client's data (experiment weak), IID and 2-class shards")
    print("| partition, rule | honest | 1 of 10 poisoning | 3 of 10 poisoning |")
    print("|---|---|---|---|")
    for partition in ("iid", "shards"):
        for rule in ("mean", "clip1", "median", "flame"):
            row = []
            for a in (0, 1, 3):
                c = got.get(f"weak-{partition}-{rule}-a{a}")
                row.append("-" if c is None else f"{pct(c['clean_by_round'][-1])} / {pct(c['success_by_round'][-1])}")
            print(f"| {partition}, {rule} | " + " | ".join(row) + " |")
    print("\nDS-FL (digits, 10 clients, 20 rounds): final accuracy; round 4; the attacked run's largest gap to the")
    print("honest run of the same rule from round 3 on (points, at round)")
    print("| rule | honest | 1 confidently wrong | 3 confidently wrong |")
    print("|---|---|---|---|")
    for name in DSFL_RULES:
        robust, aggregation = name.split("/")
        row = []
        honest = got.get(f"dsfl-{robust}-{aggregation}-a0")
        for a in (0, 1, 3):
            c = got.get(f"dsfl-{robust}-{aggregation}-a{a}")
            acc = c["accuracy_by_round"] if c else None
            if acc is None or honest is None:
                row.append("-")
                continue
            cell = f"{pct(acc[-1])}; r4 {pct(acc[3])}"
            if a:
                gaps = [h - x for h, x in zip(honest["accuracy_by_round"], acc, strict=True)]
                worst = max(range(2, len(gaps)), key=lambda r: gaps[r])
                cell += f"; gap {100 * gaps[worst]:.1f} (r{worst + 1})"
            row.append(cell)
        print(f"| {name} | " + " | ".join(row) + " |")
    seeds = {s: [got.get(f"dsfl-median-era-{'' if s == 0 else f's{s}-'}a{a}") for a in (0, 1, 3)] for s in (0, 1, 2)}
    if all(c is not None for cs in seeds.values() for c in cs):
        acc = {s: [c["accuracy_by_round"] for c in cs] for s, cs in seeds.items()}
        print("\nDS-FL's default (median, ERA) under seeds 0, 1, 2: the gap to the same seed's honest run (points)")
        print("| | rounds 3-6, worst seed | rounds 3-6, mean of seeds | rounds 7-20, mean of seeds | round 20, mean |")
        print("|---|---|---|---|---|")
        for i, a in ((1, 1), (2, 3)):
            gaps = [[h - x for h, x in zip(acc[s][0], acc[s][i], strict=True)] for s in acc]  # (seed, round)
            mean = [sum(g[r] for g in gaps) / len(gaps) for r in range(len(gaps[0]))]
            print(
                f"| {a} confidently wrong | {100 * max(max(g[2:6]) for g in gaps):.1f} | {100 * max(mean[2:6]):.1f} | "
                f"{100 * max(mean[6:]):.1f} | {100 * mean[-1]:.1f} |"
            )
        spread = max(abs(acc[s][0][r] - acc[t][0][r]) for s in acc for t in acc for r in range(2, 20))
        print(f"\nThe honest runs of the three seeds differ by up to {100 * spread:.1f} points from round 3 on.")
    floor: dict[tuple[str, int, int], list[float]] = {}
    for r, s, k in ((r, s, k) for r in ("median", "mean") for s in (0, 1, 2) for k in (0, 1, 3)):
        found = got.get(f"floor-{r}-s{s}-absent{k}")
        if found is not None:
            floor[r, s, k] = found["accuracy_by_round"]
    if len(floor) == 18:
        print("\nDS-FL, no liar, the first 1 or 3 clients absent (an ideal filter of as many liars): the gap to the")
        print("same rule and seed's all-honest run (points; worst seed, and the mean of seeds 0, 1, 2)")
        print("| rule, absent | rounds 3-6, worst seed | rounds 3-6, mean of seeds ", end="")
        print("| rounds 7-20, mean of seeds | round 20, mean |\n|---|---|---|---|---|")
        for r in ("median", "mean"):
            for k in (1, 3):
                gaps = [[h - x for h, x in zip(floor[r, s, 0], floor[r, s, k], strict=True)] for s in (0, 1, 2)]
                mean = [sum(g[i] for g in gaps) / len(gaps) for i in range(len(gaps[0]))]  # (round,)
                print(
                    f"| {r}, {k} absent | {100 * max(max(g[2:6]) for g in gaps):.1f} | {100 * max(mean[2:6]):.1f} | "
                    f"{100 * max(mean[6:]):.1f} | {100 * mean[-1]:.1f} |"
                )
    print(
        "\nHonest-run cost (MNIST, tiny_mlp, 10 clients, 10 rounds; 20 in the last two columns): final accuracy (best)"
    )
    print("| rule | shards s=2 | LDA alpha 0.1 | LDA alpha 0.1, 20 rounds | shards s=2, 20 rounds |")
    print("|---|---|---|---|---|")
    for rule in ("mean", "clip1", "median", "trimmed_mean", "flame", "flame+noise", "flame+ratio5"):
        row = []
        for cell in ("shards-" + rule, "dirichlet-" + rule, f"dirichlet-{rule}-r20", f"shards-{rule}-r20"):
            c = got.get(f"cost-{cell}")
            acc = c["clean_by_round"] if c else None
            row.append("-" if acc is None else f"{pct(acc[-1])} ({pct(max(acc))})")
        print(f"| {rule} | " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("experiment", nargs="?", choices=("backdoor", "weak", "long", "secagg", "dsfl", "floor", "cost"))
    p.add_argument("--out", type=Path, default=Path("experiments/results/backdoor-defaults"))
    p.add_argument("--only", nargs="*", default=None, help="cell names to run (default: all)")
    p.add_argument("--table", action="store_true")
    args = p.parse_args()
    if args.table or args.experiment is None:
        table(args.out)
        return
    (args.out / "cells").mkdir(parents=True, exist_ok=True)
    for name, thunk in cells(args.experiment):
        path = args.out / "cells" / f"{args.experiment}-{name}.json"
        if path.exists() or (args.only is not None and name not in args.only):
            continue
        started = time.perf_counter()
        result = thunk()
        result["wall_s"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(result) + "\n")
        print(f"{args.experiment} {name}: {json.dumps(result)[:300]}", flush=True)


if __name__ == "__main__":
    main()
