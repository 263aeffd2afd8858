"""Print the secure-aggregation experiment's table (experiments/results/secagg-mnist/README.md) from run directories.

One row per run: algorithm, cohort (the clients sampled a round), plain or secure, rounds, final / best /
mean-of-the-last-5-evaluations accuracy, the gap to the plain run of the same algorithm and cohort (final and last-5,
against the plain run's evaluations of the same rounds, so a run still going is compared with the plain run so far),
the tensor bytes up per replying client and round (median over rounds; every protocol message included, as the run's
ledger counts it) and its ratio to the plain run's, and the round's wall time (median and mean) with the ratio of the
medians. Every figure comes from the runs' config.json, summary.json and metrics.jsonl.

Usage: .venv/bin/python experiments/secagg_table.py RUN_DIR...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fedge.accounting.markdown import markdown_table


def _run(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_round = {line["round"]: line["accuracy"] for line in lines if line.get("accuracy") is not None}
    accuracies = list(by_round.values())
    if not accuracies:
        raise SystemExit(f"{path}: no evaluated round in metrics.jsonl yet (leave it out)")
    bytes_up = [line["tensor_bytes_up"] / len(line["replied"]) for line in lines if line["replied"]]
    return {
        "path": path,
        "algorithm": config["algorithm"],
        "cohort": round(config["num_clients"] * config["client_fraction"]),
        "secure": bool(config["secure_aggregation"]),
        "rounds": lines[-1]["round"],
        "final": accuracies[-1],
        "best": max(accuracies),
        "last5": statistics.fmean(accuracies[-5:]),
        "by_round": by_round,
        "bytes_up": statistics.median(bytes_up),
        "wall_median": statistics.median(line["wall_s"] for line in lines),
        "wall_mean": statistics.fmean(line["wall_s"] for line in lines),
        "finished": (path / "summary.json").is_file(),
    }


def _ratio(value: float, base: dict[str, Any] | None, key: str, digits: int) -> str:
    return f"{value / base[key]:.{digits}f}x" if base is not None else "-"


def table(paths: list[Path]) -> str:
    runs = sorted((_run(p) for p in paths), key=lambda r: (r["cohort"], r["algorithm"], r["secure"]))
    plain = {(r["algorithm"], r["cohort"]): r for r in runs if not r["secure"]}
    header = ["run", "algorithm", "cohort", "secure", "rounds", "final %", "best %", "last-5 mean %"]
    header += ["gap to plain (final / last-5, pt)", "tensor bytes up per client and round (median)", "x plain"]
    header += ["round wall s (median / mean)", "x plain (medians)"]
    rows = []
    for r in runs:
        base = plain.get((r["algorithm"], r["cohort"])) if r["secure"] else None
        gap = "-"
        if base is not None:  # against the plain run's evaluations of the same rounds (a running run: so far)
            same = [base["by_round"][n] for n in r["by_round"] if n in base["by_round"]]
            if len(same) == len(r["by_round"]):
                final, last5 = r["final"] - same[-1], r["last5"] - statistics.fmean(same[-5:])
                gap = f"{100 * final:+.2f} / {100 * last5:+.2f}"
        rows.append(
            [
                f"`{r['path'].name}`" + ("" if r["finished"] else " (running)"),
                r["algorithm"],
                str(r["cohort"]),
                "yes" if r["secure"] else "no",
                str(r["rounds"]),
                f"{100 * r['final']:.2f}",
                f"{100 * r['best']:.2f}",
                f"{100 * r['last5']:.2f}",
                gap,
                f"{r['bytes_up']:,.0f}",
                _ratio(r["bytes_up"], base, "bytes_up", 5),
                f"{r['wall_median']:.2f} / {r['wall_mean']:.2f}",
                _ratio(r["wall_median"], base, "wall_median", 2),
            ]
        )
    return markdown_table(header, rows, align="llrlrrrrrrrrr")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    print(table([Path(p) for p in sys.argv[1:]]))
