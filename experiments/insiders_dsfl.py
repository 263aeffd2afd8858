"""DS-FL under the mean and --robust median|trimmed_mean with 0, 1 and 3 confidently-wrong uploaders of 10 (in
process, digits, IID, ERA): the accuracy after round 5 and after the last round, per seed.

Run: ``python experiments/insiders_dsfl.py [--rounds 10] [--seeds 0 1 2] [--rules mean median trimmed_mean]``.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from insiders import dsfl_accuracies

p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--seeds", type=int, nargs="+", default=[0])
p.add_argument("--rules", nargs="+", default=["mean", "median"], choices=["mean", "median", "trimmed_mean"])
args = p.parse_args()
print("| rule | seed | honest | 1 of 10 wrong | 3 of 10 wrong |")
print("|---|---|---|---|---|")
for robust in args.rules:
    for seed in args.seeds:
        runs = [dsfl_accuracies(robust, attackers, args.rounds, seed) for attackers in (0, 1, 3)]
        cells = [f"{100 * acc[-1]:.1f}% (round 5: {100 * acc[min(4, len(acc) - 1)]:.1f}%)" for acc in runs]
        print(f"| {robust} | {seed} | " + " | ".join(cells) + " |", flush=True)
