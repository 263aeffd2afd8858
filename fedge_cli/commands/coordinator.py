"""``fedge coordinator``: rounds over an MQTT broker for clients started elsewhere."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge_cli.flags import HelpFormatter, add_config_flags, add_plugin_flag, add_previous_journal_flag, run_config

HELP = "run rounds over an MQTT broker for clients started elsewhere; writes a run directory"
"""The one-line help of ``fedge coordinator`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``coordinator`` subcommand and its flags."""
    from coordinator.cli import add_coordinator_arguments
    from fedge_io.console import add_skipped_rounds_flag

    p = sub.add_parser(
        "coordinator",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    add_coordinator_arguments(p)
    add_previous_journal_flag(p)
    add_skipped_rounds_flag(p)
    p.add_argument("--no-report", action="store_true", help="skip the Markdown report and plots")
    add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge coordinator``: its exit status."""
    from coordinator.cli import apply_run_dir, run_coordinator_cli

    finished = apply_run_dir(args)  # before the config: a run to resume brings its own
    if finished is not None:
        print(finished)
        return 0

    def report(path: Path) -> None:
        if args.no_report:
            return
        try:
            from sim.report import write_report
        except ImportError as exc:  # a coordinator-only install without matplotlib still writes its run directory
            print(f"no report ({exc}); run `fedge report {path}` where matplotlib is installed")
            return
        print(f"report: {write_report([path], path)}")

    from coordinator.run import refuse_noise_seed

    config = run_config(args, deployment=True)
    refuse_noise_seed(config)  # a deployment's noise must be unpredictable
    return run_coordinator_cli(args, config, on_finish=report)
