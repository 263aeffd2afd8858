"""Print the DP experiment's table (experiments/results/dp-mnist/README.md) from run directories.

One row per run: model, algorithm, noise multiplier Z, clip (adaptive or the fixed C), epsilon at the run's delta
after its last round, final / best / mean-of-the-last-5-evaluations accuracy, the gap to the non-private run of the
same model and algorithm (mean of the last 5 evaluations against the same), and the adaptive clip's value at rounds
50, 100, 150 and 200. Every figure comes from the runs' config.json, summary.json and metrics.jsonl.

Usage: .venv/bin/python experiments/dp_table.py RUN_DIR...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fedge.accounting.markdown import markdown_table

CLIP_ROUNDS = (50, 100, 150, 200)


def _run(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    lines = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracies = [line["accuracy"] for line in lines if line.get("accuracy") is not None]
    if not accuracies:
        raise SystemExit(f"{path}: no evaluated round in metrics.jsonl yet (leave it out)")
    z = config["dp_noise_multiplier"]
    return {
        "path": path,
        "model": config["model"],
        "algorithm": config["algorithm"],
        "z": z,
        "clip": config["dp_clip"] if z else "-",
        "epsilon": lines[-1].get("dp_epsilon"),
        "rounds": lines[-1]["round"],
        "final": accuracies[-1],
        "best": max(accuracies),
        "last5": statistics.fmean(accuracies[-5:]),
        "clips": {line["round"]: line["dp_clip"] for line in lines if "dp_clip" in line},
        "finished": (path / "summary.json").is_file(),
    }


def table(paths: list[Path]) -> str:
    runs = sorted((_run(p) for p in paths), key=lambda r: (r["model"], r["algorithm"], r["z"] != 0, r["z"]))
    private = {(r["model"], r["algorithm"]): r["last5"] for r in runs if not r["z"]}
    header = ["run", "model", "algorithm", "Z", "clip", "epsilon (delta 1e-5)", "rounds", "final %", "best %"]
    header += ["last-5 mean %", "gap to no DP (last-5, pt)", "clip at " + "/".join(map(str, CLIP_ROUNDS))]
    rows = []
    for r in runs:
        base = private.get((r["model"], r["algorithm"]))
        gap = f"{100 * (r['last5'] - base):+.2f}" if r["z"] and base is not None else "-"
        clips = "/".join(f"{r['clips'][n]:.3g}" for n in CLIP_ROUNDS if n in r["clips"]) if r["z"] else "-"
        rows.append(
            [
                f"`{r['path'].name}`" + ("" if r["finished"] else " (running)"),
                r["model"],
                r["algorithm"],
                f"{r['z']:g}" if r["z"] else "no DP",
                str(r["clip"]),
                f"{r['epsilon']:.2f}" if r["epsilon"] is not None else "-",
                str(r["rounds"]),
                f"{100 * r['final']:.2f}",
                f"{100 * r['best']:.2f}",
                f"{100 * r['last5']:.2f}",
                gap,
                clips,
            ]
        )
    return markdown_table(header, rows, align="lllrlrrrrrrr")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    print(table([Path(p) for p in sys.argv[1:]]))
