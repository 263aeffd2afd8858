"""The round-time cost of DP-FedAvg (issue 51), whole rounds: ``sim.run``'s in-process runner on MNIST, 1,000 clients
(shards, 2 a client), q = 0.1, 3 local epochs of batch 50, lr 0.01 with momentum 0.9, sequential executor; FedAvg
without DP (100 clients a round) against DP-FedAvg with Z = 1 and an adaptive clip (Poisson cohorts of 100 expected),
alternated block by block (each block a fresh run of ``--rounds-per-block`` rounds, its first round, which pays
one-time costs, and its last, which evaluates the model, not counted). Reports the median seconds a round (``wall_s``
of metrics.jsonl: sampling to the recorded round), the median server part (``wall_s - exchange_s``: the aggregation and
the round's files), per-client seconds (DP cohorts vary in size), the ratios DP / no DP, the load average and the CPU.

Usage: ``.venv/bin/python benchmarks/dp_round_time.py --model tiny_mlp --blocks 3`` (data from ``--data-dir``, by
default ../shared/data/mnist; the runs are written under a temporary directory and removed)."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from dp_aggregation import load_average
from machine import cpu_model

from fedge.config import RunConfig, TrainConfig
from sim.run import run_inprocess

DP = dict(dp_noise_multiplier=1.0, dp_clip="adaptive", dp_delta=1e-5)


def block(model: str, dp: bool, rounds: int, data_dir: str, out: Path) -> list[tuple[float, float, int]]:
    """One fresh run: (wall seconds, server seconds, replies) of each counted round."""
    config = RunConfig(
        algorithm="fedavg",
        dataset="mnist",
        data_dir=data_dir,
        model=model,
        num_clients=1000,
        client_fraction=0.1,
        partition="shards",
        shards_per_client=2,
        rounds=rounds,
        eval_every=rounds,  # evaluate the last round only: it is not counted
        seed=0,
        train=TrainConfig(lr=0.01, momentum=0.9, local_epochs=3, batch_size=50),
        **(DP if dp else {}),  # type: ignore[arg-type]
    )
    result = run_inprocess(config, out, executor="sequential")
    return [(r.wall_s, r.wall_s - r.exchange_s, len(r.replied)) for r in result.rounds[1:-1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_mlp", choices=["tiny_mlp", "fedavg_cnn"])
    parser.add_argument("--blocks", type=int, default=3, help="blocks of each kind, alternated (default 3)")
    parser.add_argument("--rounds-per-block", type=int, default=4, help="rounds of a block, 2 not counted (default 4)")
    parser.add_argument("--data-dir", default="../shared/data/mnist")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch and BLAS threads of this process (the server's checks and sums); 0: the libraries' default",
    )
    args = parser.parse_args()
    if args.rounds_per_block < 3:
        parser.error("--rounds-per-block must be at least 3: the first and the last round are not counted")
    if args.threads > 0:
        # On a machine others load, a pool's workers wait for the scheduler on every parallel op (torch's reply checks
        # and FedAvg's mean, BLAS's dot in DP's clip): one thread measures the work, not the wait. BLAS's thread count
        # also changes the dot's last bits, so a DP run's model with it.
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads, user_api="blas")
        torch.set_num_threads(args.threads)
    threads = f"{torch.get_num_threads()} torch thread(s), BLAS {'default' if args.threads <= 0 else args.threads}"
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; {args.model}, {args.blocks} blocks of each; {threads}")
    rows: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="dp-round-time-") as tmp:
        for i in range(args.blocks):
            for dp in (False, True) if i % 2 == 0 else (True, False):
                before = load_average()
                got = block(args.model, dp, args.rounds_per_block, args.data_dir, Path(tmp) / f"{i}-{int(dp)}")
                rows[dp] += got
                walls = ", ".join(f"{w:.2f}" for w, _, _ in got)
                print(
                    f"block {i + 1} {'DP   ' if dp else 'no DP'}: rounds {walls} s; load average {before} -> "
                    f"{load_average()}",
                    flush=True,
                )
    medians = {}
    for dp, got in rows.items():
        wall = statistics.median(w for w, _, _ in got)
        server = statistics.median(s for _, s, _ in got)
        per_client = statistics.median(w / n for w, _, n in got if n)
        medians[dp] = (wall, server, per_client)
        print(
            f"{'DP (Z = 1, adaptive clip)' if dp else 'no DP':<26} median of {len(got)} rounds: {wall:.2f} s a round, "
            f"server part {server:.3f} s, {1000 * per_client:.1f} ms per replying client"
        )
    (w0, s0, p0), (w1, s1, p1) = medians[False], medians[True]
    print(f"DP / no DP: {w1 / w0:.3f} a round, {p1 / p0:.3f} per client; server part +{s1 - s0:.3f} s a round")


if __name__ == "__main__":
    main()
