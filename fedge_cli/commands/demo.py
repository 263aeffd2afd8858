"""``fedge demo``: FedAvg, FedNTD and DS-FL on non-IID digits, with a comparison report."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge_cli.flags import HelpFormatter

HELP = "FedAvg, FedNTD and DS-FL on non-IID digits over the embedded MQTT broker, with a comparison report"
"""The one-line help of ``fedge demo`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``demo`` subcommand and its flags."""
    p = sub.add_parser(
        "demo",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the three runs and the report go")
    p.add_argument("--rounds", type=int, default=15, help="rounds of each of the three runs")
    p.add_argument(
        "--transport",
        choices=["mqtt", "inprocess"],
        default="mqtt",
        help="mqtt: 10 client processes per run over the embedded broker; inprocess: all in this process",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge demo``: its exit status."""
    from sim.demo import run_demo, summary_table

    print(
        f"fedge demo: FedAvg, FedNTD and DS-FL (ERA) on non-IID digits, 10 clients, {args.rounds} rounds, over "
        f"{'the embedded MQTT broker (10 client processes per run)' if args.transport == 'mqtt' else 'one process'}"
    )
    from fedge_io.console import round_line

    results, report = run_demo(
        args.out, rounds=args.rounds, transport=args.transport, on_round=lambda r: print(round_line(r), flush=True)
    )
    print()
    print(summary_table(results))
    print()
    print("Bytes are tensor-level, multicast (what the papers count); the report has payload and MQTT wire bytes too.")
    print(f"report: {report}")
    return 0
