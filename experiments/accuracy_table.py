"""Print the accuracy table of experiments/results/*/README.md from run directories.

The READMEs compare runs at fixed rounds against a paper's table; this script is how those rows are made, so that
they can be re-made from the committed metrics.jsonl files rather than typed by hand.

Usage: .venv/bin/python experiments/accuracy_table.py RUN_DIR... [--rounds 5,10,50] [--thresholds 90,95]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from fedge.accounting.markdown import markdown_table
from fedge.errors import FedgeError
from sim.report.runs import Run, load_runs


def table_row(run: Run, rounds: list[int], thresholds: list[float]) -> list[str]:
    evaluations = [r for r in run.rounds if r.accuracy is not None]
    if not evaluations:
        raise FedgeError(f"{run.path}: no evaluated round in metrics.jsonl yet")
    by_round = {r.round: r.accuracy for r in evaluations}
    accuracies = [r.accuracy for r in evaluations]
    cells = [run.label]
    cells += [f"{100 * by_round[n]:.2f}" if n in by_round else "" for n in rounds]
    cells.append(f"{100 * max(accuracies):.2f}")
    cells.append(f"{100 * statistics.fmean(accuracies[-5:]):.2f}")
    # accuracy >= t / 100, as the report's ComU@x compares: 100 * 0.29 is 28.999999999999996, 29 / 100 is 0.29
    firsts = [next((str(r.round) for r in evaluations if r.accuracy >= t / 100), "-") for t in thresholds]
    cells.append(" / ".join(firsts))
    forgetting = [r.forgetting for r in evaluations if r.forgetting is not None]
    cells.append(f"{forgetting[-1]:.4f}" if forgetting else "")
    cells.append(f"{statistics.fmean(forgetting):.4f}" if forgetting else "")
    cells.append(str(evaluations[-1].round))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (written by fedge sim)")
    parser.add_argument("--rounds", default="5,10,20,50,100,150,200", help="rounds to show accuracy at")
    parser.add_argument("--thresholds", default="90,95,97,98", help="accuracies (%%) to report the first round of")
    args = parser.parse_args()
    rounds = [int(n) for n in args.rounds.split(",")]
    thresholds = [float(t) for t in args.thresholds.split(",")]
    header = ["run", *(f"round {n}" for n in rounds), "best", "mean of the last 5 evaluations"]
    header += [f"rounds to {' / '.join(f'{t:g}' for t in thresholds)}%", "F (last)", "F (mean)", "last round"]
    try:
        # The loader `fedge report` uses: clear errors, and the report's labels (what differs between the runs)
        rows = [table_row(run, rounds, thresholds) for run in load_runs(args.runs)]
    except FedgeError as exc:
        sys.exit(f"error: {exc}")
    print(markdown_table(header, rows), end="")


if __name__ == "__main__":
    main()
