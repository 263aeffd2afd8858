"""Do two versions of fedge give the same final global model, bit for bit, for every algorithm with a server step?

A check for refactors of the server step (issue 54), run against an older checkout::

    git worktree add /tmp/old <base-commit>
    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/server_step_parity.py run /tmp/parity/old
    .venv/bin/python benchmarks/server_step_parity.py run /tmp/parity/new
    .venv/bin/python benchmarks/server_step_parity.py compare /tmp/parity/old /tmp/parity/new

``run`` trains each case in process (digits, tiny_mlp, 3 clients, 3 rounds) with the fedge found on the path (it says
which) and saves the final global model; a case the version does not know (a new setting) is skipped and said so.
``compare`` prints, per case, the largest absolute difference between the two models and whether they are equal bit
for bit. Simulated training on the CPU: the result does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _cases() -> dict[str, Callable[[], Any]]:
    """Case name -> a function building its RunConfig (imports deferred: the fedge on the path decides)."""
    from fedge.config import RunConfig, TrainConfig

    def run(algorithm: str, settings: Callable[[], Any] | None = None, **extra: Any) -> Callable[[], Any]:
        def build() -> Any:
            algo = {"algo": settings()} if settings is not None else {}
            return RunConfig(
                algorithm=algorithm,
                dataset="digits",
                model="tiny_mlp",
                num_clients=3,
                rounds=3,
                train=TrainConfig(local_epochs=1),
                **algo,
                **extra,
            )

        return build

    def fedadam(**kw: Any) -> Callable[[], Any]:
        from fedge.algorithms.fedadam import FedAdamSettings

        return lambda: FedAdamSettings(**kw)

    def scaffold(**kw: Any) -> Callable[[], Any]:
        from fedge.algorithms.scaffold import ScaffoldSettings

        return lambda: ScaffoldSettings(**kw)

    def fedavg(**kw: Any) -> Callable[[], Any]:
        from fedge.algorithms.fedavg import FedAvgSettings

        return lambda: FedAvgSettings(**kw)

    return {
        "fedavg": run("fedavg"),
        "fedavg uniform": run("fedavg", fedavg(weighting="uniform")),
        "fedavg median": run("fedavg", fedavg(robust="median")),
        "fedadam adam": run("fedadam", fedadam(server_optimizer="adam")),
        "fedadam yogi": run("fedadam", fedadam(server_optimizer="yogi")),
        "fedadam adagrad": run("fedadam", fedadam(server_optimizer="adagrad")),
        "fedadam momentum": run("fedadam", fedadam(server_optimizer="momentum", server_opt_lr=1.0)),
        "scaffold": run("scaffold"),
        "scaffold lr_g=0.5": run("scaffold", scaffold(server_lr=0.5)),
        "feddyn": run("feddyn"),
        "fednova": run("fednova"),
        "fedprox": run("fedprox"),
        "fedcurv": run("fedcurv"),
        "fedbuff (fedavg)": run(
            "fedavg",
            aggregation="fedbuff",
            buffer_size=2,
            client_profiles="lognormal:sigma=1,compute=1ms",
            link="lte",
        ),
    }


def run_cases(out: Path) -> None:
    import fedge
    from fedge.errors import ConfigError
    from sim.run import run_inprocess

    print(f"fedge from {Path(fedge.__file__).parent}")
    out.mkdir(parents=True, exist_ok=True)
    for name, build in _cases().items():
        try:
            config = build()
        except (ConfigError, TypeError, ValueError) as exc:
            print(f"{name}: skipped, this version does not know it ({exc})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = run_inprocess(config, Path(tmp) / "run")
            model = load_file(result.path / "global_model.safetensors")
        save_file(model, out / f"{name}.safetensors")
        print(f"{name}: done")


def compare(a: Path, b: Path) -> None:
    print(f"| case | {a.name} | {b.name} | max abs difference | bit for bit |")
    print("|---|---|---|---|---|")
    names = sorted({p.stem for p in a.glob("*.safetensors")} | {p.stem for p in b.glob("*.safetensors")})
    for name in names:
        fa, fb = a / f"{name}.safetensors", b / f"{name}.safetensors"
        if not (fa.exists() and fb.exists()):
            print(f"| {name} | {'yes' if fa.exists() else '-'} | {'yes' if fb.exists() else '-'} | - | - |")
            continue
        ma, mb = load_file(fa), load_file(fb)
        assert ma.keys() == mb.keys(), name
        diff = max(float((ma[k].double() - mb[k].double()).abs().max()) for k in ma)
        same = all(torch.equal(ma[k], mb[k]) for k in ma)
        print(f"| {name} | yes | yes | {diff:.3g} | {'yes' if same else 'NO'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run_cases(args.out)
    else:
        compare(args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
