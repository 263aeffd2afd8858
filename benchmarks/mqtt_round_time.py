"""Per-round wall time of FedAvg over a loopback mosquitto, split into local compute and communication.

    .venv/bin/python benchmarks/mqtt_round_time.py [--clients 20] [--rounds 3] [--data-dir ../shared/data/mnist]

Set-up: the DS-FL MNIST CNN (584,458 values, 2.3 MB per message), N ``fedge client`` processes with one torch thread
each, a private mosquitto on 127.0.0.1, the coordinator in this process. Two runs with the same clients:
  1. ``--local-epochs`` of local SGD (the real round), and
  2. zero local epochs (clients load the broadcast and send it back: the same messages, next to no compute),
so the second run measures communication alone (encode, broker, decode, validation) for the same bytes. Per round
it also reports what clients measured themselves: client-step wall and CPU seconds, and the rest of each reply's
round trip (communication as the client saw it). Without MNIST files, ``--dataset synthetic`` works offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from coordinator.run import run_coordinator
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig, TrainConfig
from fedge_io.experiment import prepare
from sim.brokers import mosquitto_broker
from sim.laptop import client_processes
from sim.provision import write_client_files

KEYS = ("wall_s", "exchange_s", "client_compute_s", "client_cpu_s", "client_comm_s")


def summarize(rounds: list[RoundRecord], skip_first: bool) -> dict[str, float]:
    """Median over rounds of each timing (round 1 left out when asked: it still pays one-time costs)."""
    use = [r.to_json() for r in (rounds[1:] if skip_first and len(rounds) > 1 else rounds)]
    return {k: statistics.median(r[k] for r in use if k in r) for k in KEYS}


def split(train: dict[str, float], comm: dict[str, float]) -> dict[str, float]:
    """Round wall time = server work (aggregate + evaluate) + exchange; exchange = communication + local compute.

    Communication is the exchange of the zero-epoch round (same messages, no training); local compute is what the
    training round's exchange takes beyond it.
    """
    return {
        "round_wall_s": train["wall_s"],
        "server_aggregate_evaluate_s": train["wall_s"] - train["exchange_s"],
        "communication_s": comm["exchange_s"],
        "local_compute_s": train["exchange_s"] - comm["exchange_s"],
        "communication_share_of_round": comm["exchange_s"] / train["wall_s"],
        "compute_over_communication": (train["exchange_s"] - comm["exchange_s"]) / comm["exchange_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"))
    p.add_argument("--private-size", type=int, default=0, help="labeled samples shared by all clients (0 = all)")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    base = RunConfig(
        algorithm="fedavg",
        dataset=args.dataset,
        data_dir=args.data_dir if args.dataset in ("mnist", "fashion_mnist") else None,
        model="dsfl_mnist_cnn",
        num_clients=args.clients,
        rounds=args.rounds,
        partition="iid",
        eval_samples=1000,
        private_size=args.private_size,
        train=TrainConfig(lr=0.01, local_epochs=args.local_epochs, batch_size=50),
    )
    exp = prepare(base)
    results: dict[str, Any] = {"clients": args.clients, "rounds": args.rounds, "model": "dsfl_mnist_cnn"}
    with tempfile.TemporaryDirectory() as tmp, mosquitto_broker() as url:
        files = write_client_files(exp, Path(tmp))
        started = time.perf_counter()
        with client_processes(files, url, "bench", log_dir=Path(tmp) / "logs", threads=1):
            for label, epochs in (("train", args.local_epochs), ("comm_only", 0)):
                config = dataclasses.replace(
                    exp.config, train=dataclasses.replace(exp.config.train, local_epochs=epochs)
                )
                exp_run = dataclasses.replace(exp, config=config)
                result = run_coordinator(
                    config,
                    Path(tmp) / f"run-{label}",
                    broker=url,
                    run="bench",
                    round_timeout=600,
                    join_timeout=300,
                    broker_counters=True,
                    experiment=exp_run,
                )
                if label == "train":
                    results["startup_and_train_run_s"] = time.perf_counter() - started
                rounds = result.rounds
                results[label] = {
                    "per_round": [{k: r.to_json().get(k) for k in (*KEYS, "wire_bytes", "accuracy")} for r in rounds],
                    "median_after_round_1": summarize(rounds, skip_first=True),
                    "wire_bytes_per_round": rounds[-1].bytes.wire,
                    "broker_bytes": result.summary.get("broker_bytes"),
                    "samples_per_client": int(statistics.mean(len(v) for v in exp.parts.values())),
                }

    results["split"] = split(results["train"]["median_after_round_1"], results["comm_only"]["median_after_round_1"])
    print(f"FedAvg, dsfl_mnist_cnn, {args.clients} client processes, loopback mosquitto, {args.rounds} rounds")
    print(f"samples per client: {results['train']['samples_per_client']}, local epochs: {args.local_epochs}")
    print(f"wire bytes per round: {results['train']['wire_bytes_per_round'] / 1e6:.1f} MB")
    bb = results["train"]["broker_bytes"]
    if bb:
        print(f"broker $SYS vs our wire count: {bb['diff_pct']:+.3f}%")
    print(f"{'median over rounds 2..R':28s} " + " ".join(f"{k:>16s}" for k in KEYS))
    for label in ("train", "comm_only"):
        m = results[label]["median_after_round_1"]
        print(f"{label:28s} " + " ".join(f"{m[k]:16.3f}" for k in KEYS))
    print("split of the median round:")
    for k, v in results["split"].items():
        print(f"  {k:38s} {v:9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
