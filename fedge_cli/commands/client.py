"""``fedge client``: an edge client over an MQTT broker; on a workstation it exports a missing program first."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fedge_cli.flags import HelpFormatter, add_plugin_flag

if TYPE_CHECKING:
    from fedge.programs.spec import ModelSpec

HELP = "an edge client: join a run over an MQTT broker and train on a local data file"
"""The one-line help of ``fedge client`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``client`` subcommand and its flags."""
    from edge_client.cli import add_client_arguments

    p = sub.add_parser(
        "client",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    add_client_arguments(p)
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge client``: its exit status."""
    from edge_client.cli import requires_signed_programs, run_client

    if args.runtime == "torch" or requires_signed_programs(args):  # a device that needs signatures makes no program
        return run_client(args)
    if args.runtime == "onnxruntime-training":  # in .venv-ort-training: makes (and checks) artifacts before the hello
        from export.ort_training.cache import ArtifactCache

        return run_client(args, ort_artifacts=ArtifactCache(args.program_cache))
    # On a workstation the exporters are installed: a missing program is exported (and parity-checked) first.
    from export.cache import ExportingSource, onnx_model

    def model(spec: ModelSpec) -> tuple[bytes, str]:
        data = onnx_model(spec, args.model_file, args.program_cache, unverified=args.unverified_programs)
        return data, str(args.model_file or "exported ONNX model")

    return run_client(args, programs=ExportingSource(args.program_cache), onnx_model=model)
