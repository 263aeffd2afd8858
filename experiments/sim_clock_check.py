"""Check the simulated clock's compute term against the clients' own compute (docs/simulated_time.md).

Runs FedAvg on MNIST shards (10 clients of 600 samples, one local epoch, sequential executor, one thread) with the
reference compute measured on this machine, and prints per round the simulated compute (samples x reference) next to
what each client timed around its own local training (``client_compute_s``).

    .venv/bin/python experiments/sim_clock_check.py fedavg_cnn dsfl_mnist_cnn [--out runs/sim-clock-check]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fedge.config import RunConfig, TrainConfig
from fedge_io.experiment import prepare
from sim.run import run_inprocess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", type=Path, default=Path("runs/sim-clock-check"))
    parser.add_argument("--data", default=os.environ.get("FEDGE_DATA", "../shared/data") + "/mnist")
    args = parser.parse_args()
    for model in args.models:
        config = RunConfig(
            algorithm="fedavg", dataset="mnist", data_dir=args.data, model=model, num_clients=10, train_size=6000,
            rounds=2, partition="shards", train=TrainConfig(local_epochs=1), client_profiles="uniform", link="wifi",
        )  # fmt: skip
        exp = prepare(config)
        run_dir = args.out / model
        result = run_inprocess(config, run_dir, experiment=exp, executor="sequential")
        reference = result.summary["sim_clock"]["reference_compute_s"]
        sizes = {c: len(idx) for c, idx in exp.parts.items()}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            simulated = [sizes[c] * config.train.local_epochs * reference for c in row["replied"]]
            print(
                f"{model} round {row['round']}: reference {1000 * reference:.3g} ms/sample-step; simulated compute "
                f"mean {sum(simulated) / len(simulated):.3f} s; clients' own mean {row['client_compute_s']:.3f} s, "
                f"max {row['client_compute_s_max']:.3f} s"
            )


if __name__ == "__main__":
    main()
