"""Print the accuracy table of experiments/results/*/README.md from run directories.

The READMEs compare runs at fixed rounds against a paper's table; this script is how those rows are made, so that
they can be re-made from the committed metrics.jsonl files rather than typed by hand.

Usage: python experiments/accuracy_table.py RUN_DIR... [--rounds 5,10,20,50,100,150,200] [--thresholds 90,95,97,98]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load_evaluations(run: Path) -> list[dict]:
    """The rounds of a run's metrics.jsonl that carry a test evaluation, in round order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r.get("accuracy") is not None), key=lambda r: r["round"])


def run_label(run: Path) -> str:
    config = json.loads((run / "config.json").read_text())
    algorithm = config.get("algorithm", "?")
    partition = config.get("partition", "")
    return f"{algorithm} ({partition})" if partition else algorithm


def table_row(run: Path, rounds: list[int], thresholds: list[float]) -> list[str]:
    evaluations = load_evaluations(run)
    if not evaluations:
        raise SystemExit(f"{run}: no evaluated round in metrics.jsonl (is the run started?)")
    by_round = {r["round"]: r for r in evaluations}
    accuracies = [r["accuracy"] for r in evaluations]
    cells = [run_label(run)]
    cells += [f"{100 * by_round[n]['accuracy']:.2f}" if n in by_round else "" for n in rounds]
    cells.append(f"{100 * max(accuracies):.2f}")
    cells.append(f"{100 * statistics.fmean(accuracies[-5:]):.2f}")
    reached = []
    for threshold in thresholds:
        first = next((r["round"] for r in evaluations if 100 * r["accuracy"] >= threshold), None)
        reached.append(str(first) if first is not None else "-")
    cells.append(" / ".join(reached))
    forgetting = [r["forgetting"] for r in evaluations if r.get("forgetting") is not None]
    cells.append(f"{evaluations[-1].get('forgetting', float('nan')):.4f}")
    cells.append(f"{statistics.fmean(forgetting):.4f}" if forgetting else "")
    cells.append(str(evaluations[-1]["round"]))
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
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for run in args.runs:
        print("| " + " | ".join(table_row(run, rounds, thresholds)) + " |")


if __name__ == "__main__":
    main()
