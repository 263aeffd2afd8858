"""Issue 28's table: what a fault costs a fleet run over mosquitto started from fedge's own fleet kit.

Every row is a fresh kit (TLS, passwords, ACL), three ``fedge client`` processes with the kit's bundles and one
coordinator run: FedNTD on digits (tiny_mlp, 1 local epoch, batch 32, seed 0), the same setting in every row.

- undisturbed;
- mosquitto stopped (SIGTERM) as soon as round 1 is recorded, for 3 s, then started again (60 s round deadline);
- the same for 20 s, longer than the round's 12 s deadline;
- c002 behind a flapping link (:class:`sim.faults.FlakyProxy`: each connection cut after 1 s, FIN and RST in turn,
  every chunk held 20 ms); the run starts after its first cut.

Printed per row: rounds skipped, c002's rounds (replied / sampled), the largest weight difference to the in-process
run of the same setting (which the undisturbed run equals bit for bit), the wall time of the rounds (the sum of
``wall_s``, without the wait for the clients to join), what the fault added to it against the undisturbed run, and
the whole coordinator call (with the wait for the clients to start and join).

Run: ``python experiments/faults.py [--rounds 6] [--out DIR]`` (about 2 minutes on 2 cores; needs mosquitto).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from coordinator.run import provision_fleet, run_coordinator
from fedge.accounting.markdown import markdown_table
from fedge.config import RunConfig, TrainConfig
from fedge_io.credentials import load_bundle
from fedge_io.experiment import Experiment, prepare
from sim.brokers import fleet_mosquitto, free_port
from sim.faults import BrokerOutage, FlakyProxy
from sim.laptop import client_processes
from sim.provision import write_client_files
from sim.run import run_inprocess

RUN = "faults"
FLAKY = "c002"


@dataclass(frozen=True)
class Row:
    fault: str
    skipped: tuple[int, ...]
    flaky_replied: int
    flaky_sampled: int
    model_diff: float
    rounds_wall_s: float
    run_wall_s: float


def experiment(rounds: int) -> Experiment:
    return prepare(
        RunConfig(
            algorithm="fedntd",
            dataset="digits",
            model="tiny_mlp",
            num_clients=3,
            rounds=rounds,
            train=TrainConfig(local_epochs=1, batch_size=32),
        )
    )


@contextlib.contextmanager
def broker_for(fault: str, broker_dir: Path, run_dir: Path) -> Iterator[tuple[str, str | None, FlakyProxy | None]]:
    """The URL the steady clients use, the one c002 uses (None: the same) and the proxy, for one row's fault."""
    if fault.startswith("outage"):
        with BrokerOutage(broker_dir, run_dir, seconds=float(fault.removeprefix("outage"))) as outage:
            yield outage.url, None, None
            if outage.error is not None:
                raise outage.error
        return
    with fleet_mosquitto(broker_dir) as url:
        if fault != "flaky":
            yield url, None, None
            return
        with FlakyProxy(int(url.rsplit(":", 1)[1]), cut_after=1.0, delay=0.02) as proxy:
            yield url, f"mqtts://127.0.0.1:{proxy.port}", proxy


def run_row(fault: str, root: Path, exp: Experiment, reference: Mapping[str, torch.Tensor]) -> Row:
    files = write_client_files(exp, root / "data")
    kit = provision_fleet(exp, root / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port())
    bundle = load_bundle(kit.root / "coordinator")
    bundles = {c: kit.root / "clients" / c for c in files}
    run_dir = root / "run"
    with broker_for(fault, kit.broker_dir, run_dir) as (url, flaky_url, proxy):
        groups = {c: p for c, p in files.items() if flaky_url is None or c != FLAKY}
        with contextlib.ExitStack() as stack:
            stack.enter_context(client_processes(groups, url, RUN, log_dir=root / "logs", bundles=bundles))
            if flaky_url is not None and proxy is not None:
                stack.enter_context(
                    client_processes({FLAKY: files[FLAKY]}, flaky_url, RUN, log_dir=root / "logs", bundles=bundles)
                )
                if not proxy.first_cut.wait(120):
                    raise RuntimeError("the flaky client never connected through the proxy")
            started = time.monotonic()
            result = run_coordinator(
                exp.config,
                run_dir,
                broker=bundle.address,
                run=bundle.run,
                provisioned=bundle.clients,
                experiment=exp,
                round_timeout=12 if fault == "outage20" else 60,
                join_timeout=120,
            )
            run_wall = time.monotonic() - started
    weights = load_file(run_dir / "global_model.safetensors")
    diff = max(float((weights[k] - reference[k]).abs().max()) for k in weights)
    return Row(
        fault=fault,
        skipped=tuple(r.round for r in result.rounds if not r.aggregated),
        flaky_replied=sum(FLAKY in r.replied for r in result.rounds),
        flaky_sampled=sum(FLAKY in r.sampled for r in result.rounds),
        model_diff=diff,
        rounds_wall_s=sum(r.wall_s for r in result.rounds),
        run_wall_s=run_wall,
    )


DESCRIPTIONS = {
    "none": "undisturbed",
    "outage3": "mosquitto stopped for 3 s after round 1 (60 s deadline)",
    "outage20": "mosquitto stopped for 20 s after round 1 (12 s deadline)",
    "flaky": f"{FLAKY} behind a flapping link (cut every 1 s, FIN/RST in turn, 20 ms per chunk)",
}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds of every run")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    exp = experiment(args.rounds)
    with contextlib.ExitStack() as stack:
        root = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedge-faults-")))
        run_inprocess(exp.config, root / "inprocess", experiment=exp)
        reference = dict(load_file(root / "inprocess" / "global_model.safetensors"))
        rows = []
        for fault in DESCRIPTIONS:
            rows.append(run_row(fault, root / fault, exp, reference))
            print(f"{fault}: done ({rows[-1].rounds_wall_s:.1f} s of rounds)", flush=True)
    base = rows[0].rounds_wall_s
    load = os.getloadavg()
    print(
        f"\nFedNTD, digits, tiny_mlp, 3 client processes over the kit's mosquitto (TLS), {args.rounds} rounds; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n"
    )
    header = ["fault", "rounds skipped", "c002 replied / sampled", "max abs weight difference to in-process"]
    header += ["rounds wall (s)", "cost (s)", "coordinator wall (s)"]
    table = [
        [
            DESCRIPTIONS[r.fault],
            ", ".join(map(str, r.skipped)) or "none",
            f"{r.flaky_replied} / {r.flaky_sampled}",
            f"{r.model_diff:.3g}",
            f"{r.rounds_wall_s:.1f}",
            f"{r.rounds_wall_s - base:+.1f}",
            f"{r.run_wall_s:.1f}",
        ]
        for r in rows
    ]
    print(markdown_table(header, table), end="")


if __name__ == "__main__":
    main()
