"""``fedge demo``: the story of fedge in a few minutes on a laptop, on scikit-learn's bundled digits (no download).

FedAvg, FedNTD and DS-FL (ERA) on the same non-IID split (Dirichlet alpha = 0.3 over 10 clients), each run as a
coordinator and 10 client processes over the embedded MQTT broker (secured by a generated fleet kit), then one
comparison report (accuracy vs round and vs cumulative bytes, ComU@x) and a short table on the console: the
weight-sharing algorithms and the distillation one reach similar accuracy, at very different communication costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from fedge.accounting.records import RoundRecord
from fedge.accounting.units import format_bytes
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import AlgorithmSettings, RunConfig, TrainConfig
from fedge_io.rundir import RunResult, new_run_dir

# One non-IID split for all three, steady enough to read: moderate momentum, no lr decay over a short run.
BASE = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    num_clients=10,
    rounds=15,
    partition="dirichlet",
    dirichlet_alpha=0.3,
    open_size=500,  # DS-FL's unlabeled open set; every run trains on the same 800 private samples
    private_size=800,
    train=TrainConfig(lr=0.05, momentum=0.5, lr_decay=1.0, local_epochs=2),
)
DSFL = DSFLSettings(open_per_round=500, distill_epochs=5, distill_lr=0.1, distill_batch_size=50)


def demo_configs(rounds: int = BASE.rounds) -> dict[str, RunConfig]:
    """The three runs of the demo."""
    base = dataclasses.replace(BASE, rounds=rounds)
    return {
        "fedavg": dataclasses.replace(base, algorithm="fedavg", algo=AlgorithmSettings()),
        "fedntd": dataclasses.replace(base, algorithm="fedntd", algo=AlgorithmSettings()),
        "dsfl": dataclasses.replace(base, algorithm="dsfl", algo=DSFL),
    }


def run_demo(
    out: Path,
    *,
    rounds: int = BASE.rounds,
    transport: str = "mqtt",
    on_round: Callable[[RoundRecord], None] | None = None,
    executor: str = "auto",
) -> tuple[list[RunResult], Path]:
    """Run the three algorithms (over MQTT, or in process on ``executor``) and write their comparison report into
    ``out``."""
    from sim.report import write_report

    results = []
    for config in demo_configs(rounds).values():
        run_dir = new_run_dir(out, config, "demo")
        if transport == "mqtt":
            from sim.laptop import run_over_mqtt

            results.append(run_over_mqtt(config, run_dir, broker=None, round_timeout=120, on_round=on_round))
        else:
            from sim.run import run_inprocess

            results.append(run_inprocess(config, run_dir, on_round=on_round, executor=executor))
    report = write_report([r.path for r in results], out / "report")
    return results, report


def summary_table(results: list[RunResult]) -> str:
    """The printed comparison: accuracy, bytes per round and in all, and bytes to first reach 80% (ComU@0.8)."""
    rows = [("algorithm", "final acc", "best acc", "bytes/round", "total bytes", "to reach 80%")]
    for r in results:
        s, last = r.summary, r.rounds[-1].bytes
        comu = s.get("comu_at", {}).get("multicast", {}).get("0.8")
        rows.append(
            (
                r.config.algorithm,
                f"{100 * (s['final_accuracy'] or 0):.1f}%",
                f"{100 * (s['best_accuracy'] or 0):.1f}%",
                format_bytes(last.tensor["multicast"]),
                format_bytes(last.cum_tensor["multicast"]),
                format_bytes(comu) if comu is not None else "not reached",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
