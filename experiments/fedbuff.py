"""FedAvg vs FedBuff on MNIST in simulated time (issue 53): 100 clients, shards s = 2, fedavg_cnn, an LTE-like link,
and two compute profiles (a slow tail, a lognormal spread). Resumable: a killed run continues from its journal.

    .venv/bin/python experiments/fedbuff.py run fedavg-tail fedbuff-tail ...   # the named runs (all by default)
    .venv/bin/python experiments/fedbuff.py table                               # the results table (Markdown)

Runs go to $FEDBUFF_OUT (default runs/fedbuff), one directory per run name. Settings: FedNTD's MNIST setup (Appendix
B: 10% of clients a round, 3 local epochs, batch 50, momentum SGD lr 0.01 decaying 0.99 per round); FedBuff with
K = 10 (the synchronous cohort), 20 clients training at once, staleness weight 1/(1+sqrt(s)), server lr 1, no
staleness cut. The reference compute is fixed (``compute=1ms`` per sample-step, fedavg_cnn measured at 0.83-0.93 ms
on this machine with ``sim.clock.measure_compute``), so every clock here is reproducible.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from fedge.config import RunConfig, TrainConfig
from fedge.registry import get_algorithm
from sim.run import run_inprocess

OUT = Path(os.environ.get("FEDBUFF_OUT", "runs/fedbuff"))
DATA = os.environ.get("FEDGE_DATA", "../shared/data/mnist")
COMPUTE = os.environ.get("COMPUTE", "1ms")
# SCALE=full: the setting, fedavg_cnn (1,663,370 parameters, 6.65 MB a copy) over `lte` (10/30 Mbit/s, 50 ms).
# SCALE=tiny (what ran on the 2-core machine, see the results README): tiny_mlp (25,450 parameters, 65.36x fewer)
# over LTE's bandwidths divided by that ratio, so that a copy takes as long to cross the link as fedavg_cnn's does over
# LTE, with the same compute per sample-step: each client's simulated time is the full setting's, only the model
# that learns is smaller.
SCALE = os.environ.get("SCALE", "tiny")
MODEL, LINK = {
    "full": ("fedavg_cnn", "lte"),
    "tiny": ("tiny_mlp", "up=153kbit,down=459kbit,latency=50ms"),
}[SCALE]
LR_DECAY = float(os.environ.get("LR_DECAY", "0.99"))  # per round, or per server step under FedBuff
SYNC_ROUNDS = int(os.environ.get("SYNC_ROUNDS", "150" if SCALE == "tiny" else "40"))
STEPS = int(os.environ.get("FEDBUFF_STEPS", "200" if SCALE == "tiny" else "60"))
PROFILES = {
    "tail": f"tail:fraction=0.1,slowdown=10,compute={COMPUTE}",
    "lognormal": f"lognormal:sigma=1,compute={COMPUTE}",
}
FEDBUFF: dict[str, Any] = dict(aggregation="fedbuff", buffer_size=10, max_staleness=None)
THRESHOLDS = ("0.8", "0.9", "0.95")


# run kind -> (algorithm, staleness weight (None: synchronous), concurrency, server lr)
KINDS: dict[str, tuple[str, str | None, int, float]] = {
    "fedavg": ("fedavg", None, 0, 1.0),
    "fedntd": ("fedntd", None, 0, 1.0),
    "fedbuff": ("fedavg", "sqrt", 20, 1.0),  # FedBuff's own weight, 1/(1+sqrt(s))
    "fedbuffc": ("fedavg", "constant", 20, 1.0),  # every update counts fully, whatever its age
    "fedbuff10": ("fedavg", "sqrt", 10, 1.0),  # as many training at once as the buffer holds: less staleness
    "fedbufflr2": ("fedavg", "sqrt", 20, 2.0),  # a server step twice as long: makes up for the staleness discount
    "fedbuff15": ("fedavg", "sqrt", 15, 1.0),  # between: the throughput 2.5x needs, half fedbuff's staleness
    "fedbuff15c": ("fedavg", "constant", 15, 1.0),  # the same, every update at full weight
    "fedbuff_fedntd": ("fedntd", "sqrt", 20, 1.0),
    "fedbuffc_fedntd": ("fedntd", "constant", 20, 1.0),
}


def config(name: str) -> RunConfig:
    """The run called ``KIND-PROFILE`` (:data:`KINDS`, :data:`PROFILES`), e.g. ``fedbuff-tail``: FedAvg under FedBuff
    with the sqrt staleness weight and the slow-tail profile."""
    kind, profile = name.rsplit("-", 1)
    algorithm, weight, concurrency, server_lr = KINDS[kind]
    buffered = weight is not None
    return RunConfig(
        algorithm=algorithm,
        dataset="mnist",
        data_dir=DATA,
        model=MODEL,
        num_clients=100,
        client_fraction=0.1,
        partition="shards",
        shards_per_client=2,
        rounds=STEPS if buffered else SYNC_ROUNDS,
        seed=0,
        train=TrainConfig(lr=0.01, momentum=0.9, local_epochs=3, batch_size=50, lr_decay=LR_DECAY),
        client_profiles=PROFILES[profile],
        link=LINK,
        **(
            {**FEDBUFF, "staleness_weight": weight, "concurrency": concurrency, "server_lr": server_lr}
            if buffered
            else {}
        ),
        algo=get_algorithm(algorithm).settings(),
    )


NAMES = [f"{kind}-{profile}" for profile in PROFILES for kind in KINDS]


def run(name: str) -> None:
    run_dir = OUT / name
    if (run_dir / "summary.json").is_file():
        print(f"{name}: done already", flush=True)
        return
    resume = (run_dir / "journal.json").is_file()
    print(f"{name}: {'resuming' if resume else 'starting'}", flush=True)
    result = run_inprocess(config(name), run_dir, resume=resume, executor="sequential")
    s = result.summary
    print(f"{name}: final accuracy {s['final_accuracy']:.4f}, time_to {s['time_to']}", flush=True)


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _bytes_to(lines: list[dict[str, Any]], threshold: float) -> int | None:
    """Cumulative tensor bytes (unicast: every copy counted, as comu_at.unicast) when the accuracy first reaches it."""
    for line in lines:
        if line.get("accuracy") is not None and line["accuracy"] >= threshold:
            return int(line["cum_tensor_bytes_unicast"])
    return None


def table() -> str:
    """One row per finished (or partial) run, and FedBuff's ratios against the synchronous run of its profile."""
    rows = []
    found: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        run_dir = OUT / name
        if not (run_dir / "metrics.jsonl").is_file():
            continue
        lines = _lines(run_dir)
        if not lines:  # started, no round yet
            continue
        last = lines[-1]
        accs = [line["accuracy"] for line in lines if line.get("accuracy") is not None]
        info = {
            "rounds": len(lines),
            "clock": last["sim_clock_s"],
            "final": accs[-1],
            "best": max(accs),
            "last10": sum(accs[-10:]) / len(accs[-10:]),  # the curves swing by points from one evaluation to the next
            "time": {t: next((x["sim_clock_s"] for x in lines if x.get("accuracy", 0) >= float(t)), None)
                     for t in THRESHOLDS},
            "bytes": {t: _bytes_to(lines, float(t)) for t in THRESHOLDS},
            "stale": [x.get("staleness_mean") for x in lines if "staleness_mean" in x],
            "curve": [(x["sim_clock_s"], x["accuracy"]) for x in lines if x.get("accuracy") is not None],
            "done": (run_dir / "summary.json").is_file(),
        }  # fmt: skip
        found[name] = info
    for name, info in found.items():
        kind, profile = name.rsplit("-", 1)
        sync = found.get(f"{KINDS[kind][0]}-{profile}")
        cells = [name, f"{info['rounds']}{'' if info['done'] else ' (running)'}", f"{info['clock']:,.0f}"]
        for t in THRESHOLDS:
            sec, b = info["time"][t], info["bytes"][t]
            cells.append("-" if sec is None else f"{sec:,.0f}")
            cells.append("-" if b is None else f"{b / 1e6:,.1f}")
        cells += [f"{100 * info['final']:.2f}", f"{100 * info['last10']:.2f}", f"{100 * info['best']:.2f}"]
        stale = info["stale"]
        cells.append(f"{sum(stale) / len(stale):.2f}" if stale else "-")
        ratios = []
        if kind.startswith("fedbuff") and sync is not None:
            for t in THRESHOLDS:
                a, b = sync["time"][t], info["time"][t]
                ba, bb = sync["bytes"][t], info["bytes"][t]
                speed = f"{a / b:.2f}x" if a and b else "-"
                more = f"{bb / ba:.2f}x" if ba and bb else "-"
                ratios.append(f"{t}: {speed} faster, {more} bytes")
            ratios.append(
                f"final {100 * (info['final'] - sync['final']):+.2f} pt, "
                f"last-10 mean {100 * (info['last10'] - sync['last10']):+.2f} pt"
            )
            # The synchronous run when the FedBuff run ended: the mean of its last 10 evaluations by then.
            by_then = [a for t, a in sync["curve"] if t <= info["clock"]][-10:]
            if by_then:
                mean = 100 * sum(by_then) / len(by_then)
                ratios.append(f"sync by {info['clock']:,.0f} s: {mean:.2f}% (last-10 mean)")
        cells.append("; ".join(ratios) or "-")
        rows.append(cells)
    header = ["Run", "Rounds/steps", "Sim. time (s)"]
    for t in THRESHOLDS:
        header += [f"Time to {100 * float(t):g}% (s)", f"Bytes to {100 * float(t):g}% (MB)"]
    header += ["Final acc. (%)", "Last-10 mean (%)", "Best acc. (%)", "Mean staleness", "FedBuff vs sync"]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    command, *names = sys.argv[1:] or ["run"]
    if command == "run":
        for name in names or NAMES:
            run(name)
    elif command == "table":
        print(table())
    else:
        sys.exit(f"usage: {sys.argv[0]} run [NAME...] | table")
