"""Secure aggregation's overhead on its own: one SecAgg+ round (fedge.secagg.run_round, every message packed and
parsed) per cohort size and dropout rate, against the plain float32 upload of the same vector.

Bytes: what each client sends and receives besides its masked upload (keys, sealed shares, unmask shares and requests;
payload bytes, i.e. the packed messages), and that as a share of a plain update of the model (4 bytes a value). Time:
each client's own work (mean: keys, shares, encoding and masking, unmasking) and the server's per stage, unmasking
above all; the simulator runs every client's part in one process, a deployment runs them in parallel on the devices.

Dropouts: the given share of the cohort vanishes, each at a stage drawn uniformly from "share" (after advertising its
keys), "upload" (after sharing them) and "unmask" (after uploading), as ``fedge sim --simulate-dropouts`` does. Where
SecAgg+'s default degree cannot survive that rate (fedge.secagg.recovery_risk >= 1%), the smallest odd degree that can
is used, with t = floor(k / 2) + 1, and the row says so.

Usage: python benchmarks/secure_aggregation.py [--cohorts 10,100,1000] [--dropouts 0,0.1,0.3] [--dim 1663370]
       [--dim-1000 100000]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from fedge.secagg import RoundAbandoned, default_degree, default_threshold, recovery_risk, run_round
from fedge.secagg.messages import SecAggMessage
from fedge.secagg.rounds import simulated_dropouts

FEDAVG_CNN_VALUES = 1_663_370  # fedavg_cnn (FedNTD B.1) on 28 x 28 MNIST


def degree_for(n: int, dropout: float, risk: float = 0.01) -> int:
    """SecAgg+'s default degree for ``n`` clients, or the smallest odd one whose abandonment risk at ``dropout`` is
    below ``risk``."""
    k = default_degree(n)
    while k < n - 1 and recovery_risk(n, k, default_threshold(k), dropout) >= risk:
        k = min(n - 1, k + 2)
    return k


def one_round(n: int, dropout: float, dim: int, seed: int) -> dict[str, float | str]:
    cohort = [f"c{i:04d}" for i in range(n)]
    gen = np.random.default_rng(seed)
    vectors = {c: gen.uniform(-0.01, 0.01, dim) for c in cohort}
    drops = simulated_dropouts(cohort, dropout, seed, 1)
    k = degree_for(n, dropout)
    per_client_up = dict.fromkeys(cohort, 0)
    per_client_down = dict.fromkeys(cohort, 0)

    def count(message: SecAggMessage, stage: str, direction: str, size: int) -> None:
        if stage == "upload" and direction == "up":
            return  # the masked upload: as large as the plain one
        (per_client_up if direction == "up" else per_client_down)[message.client] += size

    start = time.perf_counter()
    try:
        result = run_round(
            vectors, bound=0.01, round_seed=os.urandom(32), run="bench", session="s", round=1, drop_at=drops,
            degree=k, rng=np.random.default_rng(seed), on_message=count,
        )  # fmt: skip
    except RoundAbandoned as exc:
        return {"n": n, "dropout": dropout, "k": k, "abandoned": str(exc)}
    wall = time.perf_counter() - start
    t = result.timings
    senders = [c for c in cohort if per_client_up[c]]  # everyone who sent anything (an "advertise" at least)
    clients_s = sum(v for key, v in t.items() if key.endswith(".clients"))
    return {
        "n": n,
        "dropout": dropout,
        "k": k,
        "t": result.config.threshold,
        "survivors": len(result.survivors),
        "up_extra": sum(per_client_up[c] for c in senders) / len(senders),
        "down_extra": sum(per_client_down.values()) / n,
        "client_s": clients_s / n,
        "server_s": sum(v for key, v in t.items() if key.endswith(".server")),
        "unmask_server_s": t["unmask.server"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cohorts", default="10,100,1000")
    parser.add_argument("--dropouts", default="0,0.1,0.3")
    parser.add_argument("--dim", type=int, default=FEDAVG_CNN_VALUES, help="values per vector (fedavg_cnn's)")
    parser.add_argument("--dim-1000", type=int, default=100_000, help="values per vector for cohorts of 1,000+")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plain = 4 * FEDAVG_CNN_VALUES
    print("| Cohort | Dropout | k / t | Survivors | Up besides the upload, per client | Down, per client | vs a "
          "fedavg_cnn update | Client s (mean) | Server s | Server unmask s | Values |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.cohorts.split(",")):
        dim = args.dim if n < 1000 else args.dim_1000
        for dropout in (float(x) for x in args.dropouts.split(",")):
            r = one_round(n, dropout, dim, args.seed)
            if "abandoned" in r:
                print(f"| {n} | {dropout:.0%} | {r['k']} | abandoned: {r['abandoned']} |||||||")
                continue
            ratio = (plain + float(r["up_extra"])) / plain
            print(
                f"| {n} | {dropout:.0%} | {r['k']} / {r['t']} | {r['survivors']} | {r['up_extra']:,.0f} B | "
                f"{r['down_extra']:,.0f} B | {ratio:.5f}x | {r['client_s']:.3f} | {r['server_s']:.2f} | "
                f"{r['unmask_server_s']:.2f} | {dim:,} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
