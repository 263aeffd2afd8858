"""``fedge export``: exports for device runtimes and their parity checks (:mod:`export.cli`)."""

from __future__ import annotations

import argparse

from fedge_cli.flags import HelpFormatter, add_plugin_flag

HELP = "export a model to ONNX / ExecuTorch (.pte, training programs) and check parity; `export check FILE...`"
"""The one-line help of ``fedge export`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``export`` subcommand and its flags."""
    from export.cli import add_export_arguments

    p = sub.add_parser(
        "export",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    add_export_arguments(p)
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge export``: its exit status."""
    from export.cli import run_export_cli

    return run_export_cli(args)
