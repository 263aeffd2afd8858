"""``fedge cost``: per-round communication of FL, FD and DS-FL, computed, not measured."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge_cli.flags import HelpFormatter, add_plugin_flag

HELP = "per-round communication of FL, FD and DS-FL (default: DS-FL Tables I and II)"
"""The one-line help of ``fedge cost`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``cost`` subcommand and its flags."""
    p = sub.add_parser(
        "cost",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", help="a model name: print the costs for these settings instead of the paper tables")
    p.add_argument("--input-shape", default=None, help="comma-separated input shape for --model, e.g. 1,28,28")
    p.add_argument("--num-classes", type=int, default=10, help="classes of --model's output")
    p.add_argument("--num-clients", type=int, default=100, help="clients per round (K)")
    p.add_argument(
        "--open-per-round",
        type=int,
        default=1000,
        help="DS-FL: open samples per round (|o_r|) whose soft labels travel",
    )
    p.add_argument(
        "--accounting",
        choices=["multicast", "unicast", "both"],
        default="multicast",
        help="multicast: a broadcast counted once (the papers' Tables I-II); unicast: once per recipient",
    )
    p.add_argument(
        "--compress",
        nargs="+",
        metavar="SCHEME",
        help="also price the paper tables with uploads and broadcast compressed by each scheme, e.g. "
        "float16 int8:row,offset topk:k=1 (see --upload-codec of fedge sim)",
    )
    p.add_argument(
        "--secure-aggregation",
        action="store_true",
        help="with --model: price each upload as secure aggregation masks it (FD's also carries its C per-class "
        "holds); the protocol's keys and shares are not counted",
    )
    p.add_argument("--markdown", type=Path, help="also write the table(s) to this Markdown file")
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge cost``: its exit status."""
    from sim.cli import run_cost

    return run_cost(args)
