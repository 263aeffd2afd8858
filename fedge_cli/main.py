"""The ``fedge`` command: one entry point, a subcommand per role.

The top layer: the only package that reaches into every role (``sim``, ``coordinator``, ``edge_client``,
``export``). It imports them lazily, so a coordinator-only or client-only install needs only its own role. The
flags are built from the algorithm registry, whose modules import torch: ``fedge --help`` pays torch's import
(~2-3 s on a laptop CPU); keeping each algorithm's settings beside its code was worth more than a faster help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Union, cast, get_args, get_origin, get_type_hints

from fedge.errors import ConfigError, FedgeError
from fedge.registry import ALGORITHMS
from fedge_io.signals import Terminated

# Imported where used, not here: `fedge --help` and `fedge --version` answer without loading torch (2-7 s).
if TYPE_CHECKING:
    from fedge.config import RunConfig
    from fedge.programs.spec import ModelSpec
    from fedge_io.rundir import RunInterrupted

DEPLOYMENT_MIN_REPLIES = 0.5
"""The quorum of ``fedge coordinator`` and the laptop runner over a broker: half the sampled clients, so a refused or
missing reply (an attacker's, a flaky device's) does not skip the round; ``fedge sim`` waits for every client."""

_HELP = {
    "algorithm": f"one of {', '.join(ALGORITHMS)}",
    "dataset": "digits (bundled with scikit-learn, no download), synthetic, mnist, fashion_mnist, cifar10, or a "
    "plugin's (--plugin)",
    "data_dir": "directory with the dataset files (e.g. ../shared/data/mnist)",
    "model": "fedavg_cnn, dsfl_mnist_cnn, dsfl_fmnist_cnn, reuters_mlp, imdb_lstm, tiny_mlp, or a plugin's "
    "(default: per dataset)",
    "num_clients": "clients the training data is split among",
    "rounds": "communication rounds",
    "shards_per_client": "shards partition: label-sorted shards per client",
    "dirichlet_alpha": "dirichlet partition: concentration (smaller is more skewed)",
    "min_client_size": "dirichlet partition: redraw until every client holds at least this many samples",
    "train_size": "train on a seeded subset of this many training samples (0 = all)",
    "seed": "seed of the partition, sampling, model initialization and batch order",
    "eval_every": "evaluate the global model every this many rounds",
    "lr": "local learning rate",
    "momentum": "local SGD momentum (its buffers never leave the client)",
    "weight_decay": "local SGD weight decay",
    "lr_decay": "per-round learning-rate decay: round r trains at lr * lr_decay^(r-1)",
    "local_epochs": "local epochs per round",
    "batch_size": "local mini-batch size",
    "augment": "none, or paper: FedNTD's random crop, flip and Cutout of training batches",
    "client_fraction": "share of clients sampled per round",
    "partition": "iid, shards or dirichlet",
    "min_replies": "quorum: share of sampled clients that must reply for the round to be aggregated",
    "eval_samples": "evaluate on this many test samples (0 = all)",
    "open_size": "DS-FL unlabeled open set size I^o",
    "private_size": "labeled private set size I^p (0 = the rest; also for FL runs to compare with DS-FL)",
    "upload_codec": "compression of client uploads: float32, float16, int8[:row|block=N,offset,stochastic], "
    "topk:k=N|density=F (weights travel as deltas; top-k keeps error feedback)",
    "broadcast_codec": "compression of the broadcast: float32, float16 (weights); also int8 / topk (soft labels)",
}


def _algo_fields() -> dict[str, tuple[dataclasses.Field[Any], Any, list[str]]]:
    """Every algorithm setting by name: (field, type hint, the algorithms that have it)."""
    out: dict[str, tuple[dataclasses.Field[Any], Any, list[str]]] = {}
    for spec in ALGORITHMS.values():
        hints = get_type_hints(spec.settings)
        for f in dataclasses.fields(spec.settings):
            if f.name in out:
                out[f.name][2].append(spec.name)
            else:
                out[f.name] = (f, hints[f.name], [spec.name])
    return out


def _add_flag(group: argparse._ArgumentGroup, dest: str, f: dataclasses.Field[Any], hint: Any, extra: str = "") -> None:
    typ = _scalar_type(hint)
    default = f.default if f.default is not dataclasses.MISSING else None
    flag = "--" + f.name.replace("_", "-")
    described = _HELP.get(f.name) or f.metadata.get("help", "")
    # The setting's own default; the flag's (None: "keep the config's value") is never shown (see _HelpFormatter).
    shown = f"(default: {default})" if default is not None and "(default" not in described else ""
    help_text = " ".join(x for x in (described, extra, shown) if x)
    if typ is bool:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    else:
        group.add_argument(flag, dest=dest, type=typ, default=None, metavar=f.name.upper(), help=help_text)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field and per algorithm setting, typed from its default; unset flags keep the
    config's value."""
    parser.add_argument("--config", type=Path, help="JSON config to start from (e.g. a run's config.json)")
    from fedge.config import RunConfig, TrainConfig

    for section, kind in (("run", RunConfig), ("train", TrainConfig)):
        group = parser.add_argument_group(f"{section} settings")
        hints = get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if f.name in ("train", "algo"):
                continue
            _add_flag(group, f"{section}.{f.name}", f, hints[f.name])
    group = parser.add_argument_group("algorithm settings (each applies to the algorithms named)")
    for name, (f, hint, owners) in _algo_fields().items():
        if name not in _shared_flags():  # the run's flag serves (config_from_args routes it by algorithm)
            _add_flag(group, f"algo.{name}", f, hint, f"[{', '.join(owners)}]")


def _shared_flags() -> set[str]:
    """Names that are both a run setting and some algorithms' setting (``aggregation``: FedBuff's mode and DS-FL's
    soft-label rule; ``server_lr``: FedBuff's and SCAFFOLD's step size): one flag, the algorithm's setting when the
    run's algorithm has it (those algorithms cannot run FedBuff), else the run's."""
    from fedge.config import RunConfig

    return {f.name for f in dataclasses.fields(RunConfig)} & set(_algo_fields())


def _scalar_type(hint: Any) -> type:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint if hint in (int, float, str, bool) else str


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None, *, deployment: bool = False) -> RunConfig:
    """``base`` (or ``--config``, or the defaults) with every flag the user gave applied on top.

    Algorithm settings apply to the run's algorithm; one that belongs only to other algorithms is an error that
    names them. ``deployment`` (a coordinator over a broker, where any admitted client may be hostile): what neither
    ``base``, ``--config`` nor a flag sets takes the deployment's defaults instead of the papers' plain mean: for an
    algorithm that exchanges weights, the rule :data:`fedge.aggregation.robust.DEPLOYMENT_RULE` and the clipping
    :data:`fedge.aggregation.robust.DEPLOYMENT_CLIP_FACTOR`; for one that exchanges soft labels (DS-FL),
    :data:`fedge.aggregation.robust.DEPLOYMENT_SOFT_LABEL_RULE`; and a quorum of :data:`DEPLOYMENT_MIN_REPLIES`
    instead of every sampled client (one refused reply must not skip a round).
    """
    from fedge.aggregation.robust import DEPLOYMENT_CLIP_FACTOR, DEPLOYMENT_RULE, DEPLOYMENT_SOFT_LABEL_RULE
    from fedge.config import RunConfig

    chosen_clip = chosen_quorum = chosen_rule = base is not None  # a resumed run keeps what its config.json says
    config = base or (RunConfig.from_json_file(args.config) if getattr(args, "config", None) else RunConfig())
    if getattr(args, "config", None):
        raw = json.loads(Path(args.config).read_text())  # valid: from_json_file read it (one-line errors)
        chosen_clip, chosen_quorum = "clip_factor" in (raw.get("algo") or {}), "min_replies" in raw
        chosen_rule = "robust" in (raw.get("algo") or {})
    changes: dict[str, dict[str, Any]] = {"run": {}, "train": {}, "algo": {}}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            changes[section][name] = value
    algorithm = changes["run"].get("algorithm", config.algorithm)
    spec = ALGORITHMS.get(algorithm)
    if spec is None:
        raise ConfigError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    owners = _algo_fields()
    own = {f.name for f in dataclasses.fields(spec.settings)}
    for name in _shared_flags() & own & set(changes["run"]):  # e.g. --aggregation sa of DS-FL
        changes["algo"][name] = changes["run"].pop(name)
    for name in changes["algo"]:
        if name not in own:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is a setting of {', '.join(owners[name][2])}, not of {algorithm}")
    base_algo = config.algo if algorithm == config.algorithm else spec.settings()
    # Secure aggregation refuses a server-side clip (it needs the plaintext), and over a broker it is refused whole.
    secure = changes["run"].get("secure_aggregation", config.secure_aggregation)
    # DP-FedAvg refuses robust rules and a server-side clip too: its own clip bounds each update.
    private = changes["run"].get("dp_noise_multiplier", getattr(config, "dp_noise_multiplier", 0.0)) > 0
    if deployment and not chosen_rule and "robust" in own and not (secure or private):
        rule = DEPLOYMENT_RULE if "clip_factor" in own else DEPLOYMENT_SOFT_LABEL_RULE
        base_algo = dataclasses.replace(base_algo, **{"robust": rule})
    if deployment and not chosen_clip and "clip_factor" in own and not (secure or private):
        base_algo = dataclasses.replace(base_algo, **{"clip_factor": DEPLOYMENT_CLIP_FACTOR})
    if deployment and changes["run"].get("aggregation", config.aggregation) == "fedbuff":
        raise ConfigError(
            "--aggregation fedbuff runs in fedge sim, in process, on the simulated clock: FedBuff over MQTT (fedge "
            "coordinator, --transport mqtt) is not built"
        )
    if deployment and not chosen_quorum:
        config = dataclasses.replace(config, min_replies=DEPLOYMENT_MIN_REPLIES)
    algo = dataclasses.replace(base_algo, **changes["algo"])
    train = dataclasses.replace(config.train, **changes["train"])
    return dataclasses.replace(config, **changes["run"], train=train, algo=algo)


def _run_config(args: argparse.Namespace, *, deployment: bool = False) -> RunConfig:
    """The run's config from the flags; with ``--resume RUN_DIR`` (and no ``--config``) on top of RUN_DIR's own.
    With ``--previous-journal``, RUN_DIR's journal of the round before (verified) becomes current first."""
    from fedge.config import RunConfig

    resume = getattr(args, "resume", None)
    previous = bool(getattr(args, "previous_journal", False))
    if previous and resume is None:
        raise ConfigError("--previous-journal goes with --resume RUN_DIR")
    if resume is not None and not getattr(args, "config", None):
        if not (resume / "config.json").is_file():
            raise ConfigError(f"--resume {resume}: not a run directory (it has no config.json)")
        config = config_from_args(args, RunConfig.from_json_file(resume / "config.json"))
    else:
        config = config_from_args(args, deployment=deployment)
    if previous and resume is not None:
        from fedge_io.journal import roll_back_journal

        roll_back_journal(resume, config)
    return config


def add_previous_journal_flag(parser: argparse.ArgumentParser) -> None:
    """``--previous-journal``, for the commands that take ``--resume``."""
    parser.add_argument(
        "--previous-journal",
        action="store_true",
        help="with --resume: continue from the journal of the round before the last (when the last is damaged)",
    )


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugin``, for the commands that build a model or load a dataset by name."""
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="import your own models and datasets from this Python module or .py file (repeat for more; also "
        "FEDGE_PLUGINS=a,b; see docs/custom_models.md)",
    )


def use_plugins(entries: Sequence[str]) -> None:
    """Import ``--plugin``'s entries now (a bad one fails before anything starts) and add them to ``FEDGE_PLUGINS``,
    which the processes fedge starts (clients over a broker, executor workers) inherit and import in turn."""
    from fedge import plugins

    given = resolved_plugins(entries)
    plugins.load_plugins(given)
    known = plugins.plugin_entries(os.environ.get(plugins.ENV))
    os.environ[plugins.ENV] = ",".join([*known, *(e for e in given if e not in known)])


def resolved_plugins(entries: Sequence[str]) -> list[str]:
    """``--plugin`` entries as fedge imports them: a ``.py`` file (or any path) by absolute path, a module by name."""
    return [str(Path(e).resolve()) if e.endswith(".py") or os.sep in e else e for e in entries]


def _packet_limit(text: str) -> Any:
    from fedge_io.connection import packet_limit_arg  # imported on use: the MQTT client is not needed to parse

    return packet_limit_arg(text)


def _packet_size(text: str) -> int:
    limit = _packet_limit(text)
    if not isinstance(limit, int):
        raise argparse.ArgumentTypeError(f"{text!r}: give the broker's limit in bytes, e.g. 1MB")
    return limit


def _cmd_sim(args: argparse.Namespace) -> int:
    from sim.cli import run_sim

    return run_sim(args, _run_config(args, deployment=args.transport == "mqtt"))  # over a broker: a deployment


def _cmd_demo(args: argparse.Namespace) -> int:
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


def _cmd_cost(args: argparse.Namespace) -> int:
    from sim.cli import run_cost

    return run_cost(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from sim.cli import run_report

    return run_report(args)


def _cmd_coordinator(args: argparse.Namespace) -> int:
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

    config = _run_config(args, deployment=True)
    refuse_noise_seed(config)  # a deployment's noise must be unpredictable
    return run_coordinator_cli(args, config, on_finish=report)


def _cmd_client(args: argparse.Namespace) -> int:
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


def _cmd_provision(args: argparse.Namespace) -> int:
    from fedge_io.experiment import prepare
    from sim.provision import provision

    if args.fleet_broker:
        # Imported before anything is written: an installation without the kit's packages (the coordinator extra) is
        # refused in one line naming the extra (MISSING_EXTRA), instead of a traceback halfway through the kit.
        from coordinator.broker_setup import broker_plan, hand_over
        from coordinator.kit.services import device_plugins, plugin_flags
        from coordinator.run import provision_fleet

    plugins = resolved_plugins(args.plugin)
    config = config_from_args(args, deployment=True)
    if config.dp_noise_seed is not None:  # the coordinator would refuse it: refused before anything is written
        from coordinator.run import refuse_noise_seed

        refuse_noise_seed(config)
    exp = prepare(config)  # its config.json is what the coordinator will run
    files = provision(exp, args.out, plugins=plugins)
    print(f"wrote {len(files)} client data files and config.json to {args.out}")
    if args.fleet_broker:
        kit_dir = args.out.absolute() / "kit"
        plan = broker_plan(kit_dir / "broker", run=args.run, conf_dir=args.fleet_broker_dir)
        kit = provision_fleet(
            exp,
            kit_dir,
            run=args.run,
            broker_hosts=args.fleet_broker,
            port=args.fleet_port or (8883 if not args.no_tls else 1883),
            tls=not args.no_tls,
            client_certificates=args.client_certificates,
            signed_programs=args.signed_programs,
            broker_config_dir=plan.conf_dir,
            max_packet_size=args.fleet_max_packet_size,
            bind_address=args.fleet_bind,
        )
        hand_over(kit.root, kit.broker_dir)
        print(f"wrote the fleet kit to {kit.root} ({kit.root / 'README.txt'} says what goes where).")
        if plan.note:
            print(f"note: {plan.note}")
        print("start the broker on this machine with:")
        for command in plan.commands:
            print(f"    {command}")
        out = args.out.absolute()
        coordinator = ["fedge", "coordinator", "--bundle", str(kit.coordinator_dir)]
        coordinator += ["--config", str(out / "config.json"), "--run-dir", str(out / "runs" / args.run)]
        coordinator += plugin_flags(plugins)
        print("then the coordinator (the same command continues the run after a stop):")
        print(f"    {shlex.join(coordinator)}")
        # A plugin file goes to each device beside its data file; the device's command names it there.
        copied = "".join(f", {Path(p).name}" for p in plugins if device_plugins([p]) != [p])
        shared = " (and shared.safetensors, if written)"
        print(f"each client, on its device, with clients/<id>/, <id>.safetensors{copied}{shared}:")
        flags = "".join(f" {shlex.quote(w)}" for w in plugin_flags(device_plugins(plugins)))
        print(f"    fedge client --bundle clients/<id> --data <id>.safetensors --device auto{flags}")
        print("and watch the run (read-only login):")
        print(f"    {shlex.join(['fedge', 'status', '--bundle', str(kit.root / 'monitor')])}")
        print(f"keep {kit.root / 'ca'} offline: it only serves to issue new certificates")
        _write_services(args, kit.root, kit.coordinator_dir, plan.conf_dir, plugins, exp.config.secure_aggregation)
    return 0


def _write_services(
    args: argparse.Namespace,
    kit_root: Path,
    coordinator_bundle: Path,
    broker_conf_dir: Path,
    plugins: Sequence[str],
    secure_aggregation: bool,
) -> None:
    """The kit's systemd units (coordinator.kit.services), with this machine's fedge and mosquitto."""
    from coordinator.broker_setup import mosquitto_command
    from coordinator.kit.services import install_commands, write_units

    script = Path(sys.executable).with_name("fedge")
    fedge = [str(script)] if script.is_file() else [sys.executable, "-m", "fedge_cli.main"]
    out = args.out.absolute()
    write_units(
        kit_root / "systemd",
        args.run,
        mosquitto=Path(mosquitto_command()),
        broker_conf_dir=broker_conf_dir,
        fedge=fedge,
        coordinator_bundle=coordinator_bundle,
        config=out / "config.json",
        run_dir=out / "runs" / args.run,
        device_root=args.fleet_device_root,
        plugins=plugins,
        secure_aggregation=secure_aggregation,
    )
    print(f"or run them all as services: {kit_root / 'systemd'}")
    steps = install_commands(
        args.run, args.fleet_device_root, plugins, coordinator_bundle=coordinator_bundle, runs=out / "runs"
    )
    for line in steps[1:]:
        print(f"  {line}")


def _cmd_status(args: argparse.Namespace) -> int:
    from fedge_io.monitor import run_status_cli

    return run_status_cli(args)


def _cmd_kit(args: argparse.Namespace) -> int:
    from coordinator.kit.cli import run_kit_cli

    return run_kit_cli(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from export.cli import run_export_cli

    return run_export_cli(args)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default said once: argparse's "(default: X)" only where the text does not say it already and the
    default means something (not None, "not given", and not an off switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text


class _VersionAction(argparse.Action):
    """``--version``: fedge's version and, from a git checkout, its commit (what run directories record)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from fedge_io.provenance import version_text

        print(version_text())
        parser.exit()


COMMANDS = {
    "sim": "run an algorithm in one process and write a run directory with a report",
    "demo": "FedAvg, FedNTD and DS-FL on non-IID digits over the embedded MQTT broker, with a comparison report",
    "cost": "per-round communication of FL, FD and DS-FL (default: DS-FL Tables I and II)",
    "report": "Markdown tables and PNG plots for one or more run directories",
    "coordinator": "run rounds over an MQTT broker for clients started elsewhere; writes a run directory",
    "client": "an edge client: join a run over an MQTT broker and train on a local data file",
    "provision": "write each client's data file (and the run's config.json) for a deployment",
    "status": "watch a run live: round, phase, deadline, clients, accuracy, bytes (e.g. --bundle KIT/monitor)",
    "export": "export a model to ONNX / ExecuTorch (.pte, training programs) and check parity; `export check FILE...`",
    "kit": "devices come and go in a live fleet: `kit add-client ID`, `kit revoke ID` (--kit OUT/kit)",
}
"""Every subcommand and its one-line help, in the order `fedge --help` lists them."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" names the flag meant: a mistyped ``--join-timout`` gets
    "did you mean --join-timeout?" from the flags of the command given (and fedge's own). Python 3.14's
    ``suggest_on_error`` suggests command and choice names only."""

    _words: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's three overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._words = list(sys.argv[1:] if args is None else args)  # for error(): which command was given
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unrecognized = "unrecognized arguments: "
        if message.startswith(unrecognized):
            flags = set(self._option_string_actions)
            commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
            given = next((commands[w] for w in self._words if isinstance(commands, dict) and w in commands), None)
            flags |= set(given._option_string_actions) if given is not None else set()
            for word in message.removeprefix(unrecognized).split():
                flag = word.split("=", 1)[0]
                meant = difflib.get_close_matches(flag, flags, n=1) if flag.startswith("--") else []
                message += f"; {flag}: did you mean {meant[0]}?" if meant else ""
        super().error(message)


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = _Parser(
        prog="fedge",
        description="Federated learning for edge devices: " + ", ".join(ALGORITHMS) + ", "
        "simulated in one process or deployed over MQTT, with every byte accounted for.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument(
        "--version", action=_VersionAction, nargs=0, help="print fedge's version (and git commit) and exit"
    )
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", required=True)


def overview_parser() -> argparse.ArgumentParser:
    """The parser of a command line naming no subcommand (`fedge --help`, `fedge --version`, `fedge`): the commands
    and their one-line help, without importing what the commands need (torch, the algorithms)."""
    parser, sub = _top_parser()
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text)
    return parser


def _add_status_command(sub: argparse._SubParsersAction) -> None:
    from fedge_io.monitor import add_status_arguments

    p = sub.add_parser(
        "status",
        help=COMMANDS["status"],
        description="Show the run status the coordinator keeps on the broker, redrawn as it changes; --once prints "
        "one snapshot. With a fleet kit, log in with its read-only monitor/ bundle.",
    )
    add_status_arguments(p)
    p.set_defaults(func=_cmd_status)


def status_parser() -> argparse.ArgumentParser:
    """The parser of `fedge status ...` alone: an operator's watch command starts without torch (seconds on a
    laptop, more on a small board), since the monitor reads metadata-only messages."""
    parser, sub = _top_parser()
    _add_status_command(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from fedge_io.console import add_skipped_rounds_flag
    from fedge_io.tensorboard import add_tensorboard_flag

    parser, sub = _top_parser()

    p = sub.add_parser(
        "sim",
        help=COMMANDS["sim"],
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent directory of the run directory")
    p.add_argument("--name", default="", help="label appended to the run directory's name")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument(
        "--transport",
        choices=["inprocess", "mqtt"],
        default="inprocess",
        help="inprocess: all clients in this process; mqtt: a coordinator and client processes over a broker",
    )
    p.add_argument(
        "--executor",
        choices=["auto", "sequential", "processes", "ray", "batched"],
        default="auto",
        help="who runs the clients' steps in process: auto (processes when two or more workers fit the cores), "
        "sequential, processes (a worker pool), ray (a Ray cluster: pip install 'fedge[ray]'); same model either way; "
        "batched (the round's clients as one stacked model, for a GPU: same model up to float round-off)",
    )
    p.add_argument("--workers", type=int, default=0, help="executor workers (0: one per core, at most the clients)")
    p.add_argument(
        "--threads-per-worker", type=int, default=1, help="torch threads of every client step (results depend on it)"
    )
    p.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="evaluate each round while the next round's clients train in the executor's worker processes (on), or "
        "before the next round starts (off); auto: on only where a core is left over for the evaluation beside the "
        "workers (on 2 cores with 2 workers it would compete with them); same results either way",
    )
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off", help="the same as --overlap off")
    p.add_argument(
        "--broker",
        default=None,
        help="with --transport mqtt: mqtt://HOST:PORT of an existing broker (default: an embedded broker on loopback)",
    )
    p.add_argument(
        "--max-packet-size",
        type=_packet_limit,
        default="auto",
        metavar="auto|off|BYTES",
        help="with --transport mqtt: the largest MQTT packet the coordinator and clients publish; larger messages "
        "travel as chunks (auto: the broker's announced limit, else none; off: never chunk)",
    )
    p.add_argument("--no-report", action="store_true", help="skip the Markdown report and plots")
    add_tensorboard_flag(p)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no per-round lines and no progress bar (the bar is drawn only when stderr is a terminal)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the killed run in RUN_DIR after its last completed round, from its journal (its config.json)",
    )
    add_previous_journal_flag(p)
    add_skipped_rounds_flag(p)
    _add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_sim)

    p = sub.add_parser(
        "demo",
        help=COMMANDS["demo"],
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the three runs and the report go")
    p.add_argument("--rounds", type=int, default=15, help="rounds of each of the three runs")
    p.add_argument(
        "--transport",
        choices=["mqtt", "inprocess"],
        default="mqtt",
        help="mqtt: 10 client processes per run over the embedded broker; inprocess: all in this process",
    )
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "cost",
        help=COMMANDS["cost"],
        formatter_class=_HelpFormatter,
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
    p.add_argument("--markdown", type=Path, help="also write the table(s) to this Markdown file")
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_cost)

    p = sub.add_parser("report", help=COMMANDS["report"], formatter_class=_HelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories (written by fedge sim or fedge coordinator)")
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: the run directory if one, else ./report)"
    )
    p.add_argument(
        "--accounting",
        choices=["multicast", "unicast"],
        default="multicast",
        help="bytes of a broadcast counted once (multicast, as the papers do) or once per recipient (unicast)",
    )
    p.set_defaults(func=_cmd_report)

    from coordinator.cli import add_coordinator_arguments
    from edge_client.cli import add_client_arguments

    p = sub.add_parser(
        "coordinator",
        help=COMMANDS["coordinator"],
        formatter_class=_HelpFormatter,
    )
    add_coordinator_arguments(p)
    add_previous_journal_flag(p)
    add_skipped_rounds_flag(p)
    p.add_argument("--no-report", action="store_true", help="skip the Markdown report and plots")
    _add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_coordinator)

    p = sub.add_parser(
        "client",
        help=COMMANDS["client"],
        formatter_class=_HelpFormatter,
    )
    add_client_arguments(p)
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_client)

    p = sub.add_parser(
        "provision",
        help=COMMANDS["provision"],
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="directory for <client>.safetensors, shared and config")
    p.add_argument(
        "--fleet-broker",
        action="append",
        default=[],
        metavar="HOST",
        help="also write a secure fleet kit to OUT/kit for a broker that devices reach as HOST (repeat for more "
        "names): per-device passwords, ACL, mosquitto.conf with TLS, a private CA; one bundle per device",
    )
    p.add_argument("--run", default="default", help="the run (federation) name the kit is for")
    p.add_argument("--fleet-port", type=int, default=0, help="the broker's port (default: 8883, or 1883 with --no-tls)")
    p.add_argument(
        "--client-certificates",
        action="store_true",
        help="mutual TLS: a certificate for every device, and the broker takes its login from the certificate",
    )
    p.add_argument(
        "--signed-programs",
        action="store_true",
        help="device bundles require on-device programs signed by the kit's CA (fedge export --sign-key KIT); "
        "such a client never exports programs itself",
    )
    p.add_argument(
        "--fleet-bind",
        default=None,
        metavar="ADDRESS",
        help="the one address the kit's broker listens on, e.g. 127.0.0.1 or a LAN address (default: every interface)",
    )
    p.add_argument(
        "--fleet-broker-dir",
        type=Path,
        default=None,
        help="where kit/broker/ will be on the broker host (mosquitto.conf names its files by absolute path)",
    )
    p.add_argument(
        "--fleet-device-root",
        type=Path,
        default=Path("/opt/fedge"),
        metavar="DIR",
        help="where the kit's systemd client unit expects fedge (DIR/venv) and each device's files (DIR/<run>/<id>/)",
    )
    p.add_argument("--no-tls", action="store_true", help="passwords and ACL without TLS (a loopback laptop run only)")
    p.add_argument(
        "--fleet-max-packet-size",
        type=_packet_size,
        default=None,
        metavar="BYTES",
        help="the broker's max_packet_size (e.g. 1MB); the coordinator and clients learn it from the broker and send "
        "larger messages as chunks (default: sized to the run's largest message, nothing chunked)",
    )
    _add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_provision)

    _add_status_command(sub)

    from export.cli import add_export_arguments

    p = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        formatter_class=_HelpFormatter,
    )
    add_export_arguments(p)
    add_plugin_flag(p)
    p.set_defaults(func=_cmd_export)

    from coordinator.kit.cli import add_kit_arguments

    p = sub.add_parser("kit", help=COMMANDS["kit"], formatter_class=_HelpFormatter)
    add_kit_arguments(p)
    p.set_defaults(func=_cmd_kit)
    return parser


RESUME_FLAGS = {
    "sim": (
        "transport",
        "broker",
        "max_packet_size",
        "executor",
        "workers",
        "threads_per_worker",
        "overlap",
        "device",
        "tensorboard",
    ),
    "coordinator": (
        "bundle",
        "broker",
        "username",
        "password_file",
        "ca_file",
        "cert_file",
        "key_file",
        "allow_plaintext",
        "max_packet_size",
        "run",
        "min_clients",
        "round_timeout",
        "join_timeout",
        "rejoin_grace",
        "broker_counters",
        "tensorboard",
    ),
}
"""The flags a resume command repeats when they were given: how the run reaches its broker and clients and where it
runs. The run's settings come from its config.json, so no config flag is repeated."""

COMMON_RESUME_FLAGS = ("no_report", "allow_skipped_rounds", "quiet", "plugin")


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command line that continues the interrupted run in ``run_dir`` as ``args`` started it; a broker login
    never goes into it (the password comes from the same file or environment variable as before)."""
    from fedge.wire.protocol import BrokerAddress

    defaults = vars(build_parser().parse_args([args.command]))
    words = ["fedge", args.command, "--resume", str(run_dir)]
    for dest in (*RESUME_FLAGS[args.command], *COMMON_RESUME_FLAGS):
        value = getattr(args, dest, None)
        if dest not in defaults or value == defaults[dest]:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):  # a repeatable flag
            for item in value:
                words += [flag, str(item)]
        elif dest == "broker":
            address = BrokerAddress.parse(str(value))
            words += [flag, address.url]
            if address.username and not args.username:
                words += ["--username", address.username]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _terminate(signum: int, frame: types.FrameType | None) -> None:
    # Imports nothing: it runs wherever the main thread is, in the middle of an import too (see fedge_io.signals).
    raise Terminated()


# The packages outside fedge's base (pyproject.toml) by the extra that installs them: a client-only install
# (`pip install fedge[client]`) that runs another role's command is told what to install, not shown a traceback.
MISSING_EXTRA = {
    "pwdlib": "coordinator",
    "argon2": "coordinator",
    "matplotlib": "coordinator",
    "sklearn": "coordinator",
    "amqtt": "sim",
    "tqdm": "sim",
    "ray": "ray",
    "onnxruntime": "client-onnx",
    "onnx": "client-onnx",
    "onnxscript": "export",
    "executorch": "client-executorch",
    "tensorboard": "tensorboard",
}


def _parser_for(words: Sequence[str]) -> argparse.ArgumentParser:
    """Only as much parser as the command line needs: `fedge status` and `fedge --help` import no torch."""
    if next((word for word in words if not word.startswith("-")), None) == "status":
        return status_parser()
    return build_parser() if any(word in COMMANDS for word in words) else overview_parser()


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parser_for(words).parse_args(words)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # SIGTERM (systemd, docker stop, kill) stops a run as Ctrl-C does: cleanup, then a resume hint and status 143.
    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        if getattr(args, "plugin", None):
            use_plugins(args.plugin)
        return int(args.func(args) or 0)
    except FedgeError as exc:
        print(f"fedge: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = MISSING_EXTRA.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        if args.command == "export":  # the exporters need the whole export extra (onnxscript, executorch, ...)
            extra = "export"
        print(
            f"fedge: error: `fedge {args.command}` needs the package {exc.name!r}, which this installation lacks; "
            f"install it with fedge's '{extra}' extra: pip install 'fedge[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as exc:
        # A RunInterrupted comes from fedge_io.rundir: where it was never imported (fedge status), none was raised,
        # and a stop is no time to import torch.
        rundir = sys.modules.get("fedge_io.rundir")
        run = cast("RunInterrupted", exc) if rundir is not None and isinstance(exc, rundir.RunInterrupted) else None
        terminated = isinstance(exc, Terminated) or (run is not None and run.terminated)
        print(f"fedge: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        if run is not None:
            if run.run_dir is None:
                print("fedge: no round had completed, so there is nothing to resume", file=sys.stderr)
            else:
                print(f"fedge: continue the run with: {resume_command(args, run.run_dir)}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
