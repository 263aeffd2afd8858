"""``fedge client``: one edge client process (a Jetson board, another machine, or one of many on a laptop)."""

from __future__ import annotations

import argparse
import copy
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from edge_client.state import ClientStateFiles
from fedge.errors import ConfigError
from fedge.programs.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from cryptography.x509 import Certificate

    from edge_client.backends.executorch import ProgramSource
    from edge_client.backends.ort_training import ArtifactSource
    from edge_client.data import ClientDataInfo
    from fedge.algorithms.base import ClientData
    from fedge.learning.backend import TorchBackend
    from fedge.privacy.shares import NoiseFloor
    from fedge_io.credentials import Bundle

from fedge_io.connection import add_connection_arguments, connection_from_args

log = logging.getLogger(__name__)


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fedge client``."""
    add_connection_arguments(p)
    p.add_argument(
        "--client-id", default=None, help="this client's id, e.g. c003 (unique in the run; default: the bundle's)"
    )
    p.add_argument("--data", required=True, help="client data file (.safetensors, see edge_client/data.py)")
    p.add_argument(
        "--run-config",
        type=Path,
        default=None,
        help="the run's config.json, from which an on-device runtime prepares its training programs before the "
        "hello (default: config.json beside --data, as `fedge provision` writes it)",
    )
    p.add_argument(
        "--run",
        default=None,
        help="the run (federation) name, the coordinator's (default: the bundle's, else 'default')",
    )
    p.add_argument(
        "--announce-host", action="store_true", help="put this machine's host name and process id in the hello"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present: the Jetson path), cpu or cuda[:N]")
    p.add_argument(
        "--runtime",
        default="torch",
        choices=["torch", "executorch", "onnxruntime", "onnxruntime-training"],
        help="torch, executorch (training programs), onnxruntime (inference only) or onnxruntime-training (its own "
        "venv: make ort-training); see docs/on_device.md",
    )
    p.add_argument(
        "--program-cache",
        type=Path,
        default=None,
        help="executorch/onnxruntime: directory of exported programs "
        "(default: $FEDGE_PROGRAM_CACHE, else ~/.cache/fedge/programs)",
    )
    p.add_argument("--model-file", type=Path, default=None, help="onnxruntime: the deployed .onnx model to serve")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the client keeps its algorithm state after each round (SCAFFOLD's control variate, FD and DS-FL "
        "models), so a restarted client or a resumed coordinator continues from it (default: state/ beside --data)",
    )
    p.add_argument(
        "--no-state",
        action="store_true",
        help="keep the algorithm state in memory only: a restart or a resumed run starts this client from nothing",
    )
    p.add_argument(
        "--unverified-programs",
        action="store_true",
        help="load exported programs (--model-file, the program directory's .pte files and ONNX Runtime training "
        "artifacts) that have no manifest.json beside them; by default each file must match the SHA-256 that "
        "`fedge export` recorded, since a damaged program can crash the runtime or serve wrong logits",
    )
    p.add_argument(
        "--trust-ca",
        type=Path,
        default=None,
        metavar="PATH",
        help="load only programs whose export manifest is signed by this CA (PEM certificate, or a kit bundle "
        "directory's ca.crt; `fedge export --sign-key`); such a client never exports programs itself. Default: "
        "the bundle's CA when its signed_programs is true, else no signature is required",
    )
    p.add_argument(
        "--predict-only",
        action="store_true",
        help="onnxruntime: skip local training, upload the deployed model's outputs (FD, DS-FL)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default; 1 when many clients share a laptop)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to keep trying to reach the broker at start"
    )
    p.add_argument(
        "--idle-warning",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="warn (with the run name and the topic this client listens on) when no task came for this long, then "
        "after twice as long, and so on; 0: never",
    )
    p.add_argument("--fail-at-round", type=int, default=None, help=argparse.SUPPRESS)  # fault injection for tests
    # Fault injection for tests, with --fail-at-round: vanish when that secure-aggregation stage opens.
    p.add_argument("--fail-at-stage", choices=("share", "upload", "unmask"), default=None, help=argparse.SUPPRESS)


def run_client(
    args: argparse.Namespace,
    *,
    programs: ProgramSource | None = None,
    onnx_model: Callable[[ModelSpec], tuple[bytes, str]] | None = None,
    ort_artifacts: ArtifactSource | None = None,
) -> int:
    """Load the data, build the runtime, serve until SIGTERM/SIGINT.

    ``programs`` (executorch) and ``onnx_model`` (onnxruntime: the model bytes and where they came from) are given by
    the CLI, which may export what is missing; without them the client reads the program directory and --model-file.
    """
    # Imported here so that building the `fedge` parser does not load torch.
    import torch

    from edge_client.backends import make_backend
    from edge_client.client import EdgeClient
    from edge_client.data import load_client_data
    from edge_client.mqtt import MqttEdgeClient
    from fedge.learning.backend import TorchBackend
    from fedge.wire.protocol import check_name

    connection = connection_from_args(args)
    bundle = connection.bundle
    if bundle is not None:
        if bundle.role != "client":
            raise ConfigError(f"{args.bundle} is the {bundle.role}'s bundle; a client needs its own clients/<id>/")
        for flag, given, own in (("--client-id", args.client_id, bundle.client_id), ("--run", args.run, bundle.run)):
            if given not in (None, own):
                raise ConfigError(f"{flag} {given} differs from the bundle's {own!r}")
        args.client_id, args.run = bundle.client_id, bundle.run
    if args.client_id is None:
        raise ConfigError("say which client this is: --client-id ID, or --bundle DIR from a fleet kit")
    args.run = args.run or "default"
    check_name(args.client_id, "client id")
    if not args.idle_warning >= 0:  # also refuses nan
        raise ConfigError(f"--idle-warning must be >= 0 seconds, got {args.idle_warning}")
    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    unrunnable = unrunnable_algorithm(args)  # before any program is built for a run this runtime cannot serve
    if unrunnable is not None:
        log.error("%s", unrunnable)
        print(f"fedge: {unrunnable}", file=sys.stderr)
        return 3  # a restart cannot cure it (the service does not restart on 3)
    data, info = load_client_data(args.data)
    if info.client and info.client != args.client_id:
        log.warning("data file %s was written for client %r, serving it as %r", args.data, info.client, args.client_id)
    spec = ModelSpec(info.model, info.input_shape, info.num_classes)
    trust = program_signer(args, bundle)
    if trust is not None and (programs is not None or onnx_model is not None or ort_artifacts is not None):
        raise ConfigError("a client that requires signed programs (--trust-ca) loads them; it never makes its own")
    if trust is not None and args.runtime == "onnxruntime" and args.model_file is None:
        raise ConfigError("--trust-ca with --runtime onnxruntime needs --model-file (a signed export's .onnx)")
    model_bytes, model_source = None, "ONNX model"
    if args.runtime == "onnxruntime":
        if onnx_model is not None:
            model_bytes, model_source = onnx_model(spec)
        elif args.model_file is not None:
            from fedge_io.manifest import verified_read

            model_bytes = verified_read(args.model_file, required=not args.unverified_programs, trust=trust)
            model_source = str(args.model_file)
    if args.runtime == "executorch" and programs is None:
        from edge_client.backends.executorch import ProgramDirectory

        programs = ProgramDirectory(args.program_cache, unverified=args.unverified_programs, trust=trust)
    if args.runtime == "onnxruntime-training" and ort_artifacts is None:
        from edge_client.backends.ort_training import ArtifactDirectory

        ort_artifacts = ArtifactDirectory(args.program_cache, unverified=args.unverified_programs, trust=trust)
    backend = make_backend(
        args.runtime,
        info.model,
        info.input_shape,
        info.num_classes,
        device=args.device if args.runtime == "torch" else "cpu",
        programs=programs,
        onnx_model=model_bytes,
        onnx_source=model_source,
        predict_only=args.predict_only,
        threads=args.threads,
        ort_artifacts=ort_artifacts,
    )
    device = str(getattr(backend, "device", "cpu"))
    log.info(
        "client %s: %d samples, model %s on %s (%s runtime)",
        args.client_id,
        len(data),
        info.model,
        device,
        args.runtime,
    )
    if isinstance(backend, TorchBackend):
        _warm_up(backend, data.x, data.y)
    else:  # load (on first use: export and check) the programs before the hello, not in a round
        _prepare_programs(backend, args, data, info)
        backend.logits(data.x[:2])
    server = MqttEdgeClient(
        EdgeClient(args.client_id, data, backend),
        info,
        connection.address,
        args.run,
        device=device,
        runtime=args.runtime,
        fail_at_round=args.fail_at_round,
        fail_at_stage=args.fail_at_stage,
        announce_host=args.announce_host,
        capabilities=runtime_capabilities(args.runtime, args.predict_only),
        max_packet_size=connection.max_packet_size,
        state=state_files(args),
        idle_warning_s=args.idle_warning,
        noise_floor=provisioned_noise_floor(args),
    )

    signals: list[int] = []

    def _stop(signum: int, frame: FrameType | None) -> None:
        # No logging here: a signal that lands while the main thread writes a log line to stderr would make the
        # handler's write a reentrant call (RuntimeError and a traceback on a plain SIGTERM). Logged after serve.
        signals.append(signum)
        server.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.serve(connect_timeout=args.connect_timeout)
    if signals:
        log.info("signal %d: left", signals[0])
    if server.refused is not None:  # the coordinator said why; the error line is logged: exit non-zero for a service
        print(f"fedge: refused by the coordinator of run {args.run}: {server.refused}", file=sys.stderr)
        return 3
    if server.cancelled is not None:  # a service restarts it (not exit 3): it then waits for the next coordinator
        print(f"fedge: run {args.run} cannot start: {server.cancelled}", file=sys.stderr)
        return CANCELLED_EXIT
    return 0


CANCELLED_EXIT = 4
"""``fedge client``'s exit status when the coordinator gave up before round 1 and said why (too few clients can
join). Not 3: the fault may be another device's or the coordinator's, and the client service restarts on it to wait
for the next coordinator."""


def unrunnable_algorithm(args: argparse.Namespace) -> str | None:
    """Why this client's runtime cannot run the algorithm of the run's config.json (``--run-config``, else beside
    ``--data``), or None (it can, or there is no config to read: the coordinator then refuses it at its hello)."""
    from fedge.config import RunConfig

    path = args.run_config or Path(args.data).with_name("config.json")
    if not path.is_file():
        return None
    algorithm = RunConfig.from_json_file(path).algorithm
    if algorithm in runtime_capabilities(args.runtime, args.predict_only):
        return None
    mode = " (predict-only)" if args.predict_only else ""
    able = [r for r in ("torch", "executorch", "onnxruntime-training") if algorithm in runtime_capabilities(r, False)]
    return (
        f"the {args.runtime} runtime{mode} cannot run {algorithm!r}, the algorithm of {path}; start this client with "
        f"--runtime {' or '.join(able) or 'torch'} (docs/on_device.md says what each runtime runs)"
    )


def provisioned_noise_floor(args: argparse.Namespace) -> NoiseFloor | None:
    """The least DP noise this client adds under secure aggregation, from the run's config.json (``--run-config``,
    else beside ``--data``); None without DP or without a config (the broadcast's noise is then taken as asked)."""
    from fedge.config import RunConfig
    from fedge.privacy.shares import NoiseFloor

    path = args.run_config or Path(args.data).with_name("config.json")
    if not path.is_file():
        return None
    return NoiseFloor.of_config(RunConfig.from_json_file(path))


def requires_signed_programs(args: argparse.Namespace) -> bool:
    """Whether this client accepts only signed programs (--trust-ca, or its bundle's signed_programs)."""
    if args.trust_ca is not None:
        return True
    if getattr(args, "bundle", None) is None:
        return False
    from fedge_io.credentials import load_bundle

    return load_bundle(args.bundle).program_ca is not None


def program_signer(args: argparse.Namespace, bundle: Bundle | None) -> Certificate | None:
    """The CA whose signature every program's manifest must carry: --trust-ca, else the bundle's (None: none)."""
    if args.trust_ca is not None:
        path = args.trust_ca
    elif bundle is not None and bundle.program_ca is not None:
        path = Path(bundle.program_ca)
    else:
        return None  # a device that checks no signatures needs no cryptography package
    try:
        from fedge_io.signing import load_trusted_ca
    except ImportError as exc:
        raise ConfigError(
            f"checking signed programs needs the cryptography package ({exc}): pip install cryptography"
        ) from None
    return load_trusted_ca(path)


def state_files(args: argparse.Namespace) -> ClientStateFiles | None:
    """Where this client keeps its algorithm state (``--state-dir``, default ``state/`` beside ``--data``), or None
    with ``--no-state``. ``args.run`` and ``args.client_id`` are resolved (a bundle's) by then."""
    if args.no_state:
        return None
    return ClientStateFiles(args.state_dir or Path(args.data).parent / "state", args.run, args.client_id)


def _prepare_programs(backend: Any, args: argparse.Namespace, data: ClientData, info: ClientDataInfo) -> None:
    """Make or load every training program the run will need (:mod:`fedge.programs.planning`), from the run's config."""
    import time

    from fedge.config import RunConfig
    from fedge.programs.planning import planned_trainings

    path = args.run_config or Path(args.data).with_name("config.json")
    prepare = getattr(backend, "prepare", None)
    if prepare is None or args.predict_only:
        return
    if not path.is_file():
        if args.run_config is not None:
            raise ConfigError(f"--run-config {path} does not exist")
        log.warning(
            "no run config beside %s: training programs will be made when the first task needs them (in a round); "
            "pass --run-config CONFIG.json to prepare them before the hello",
            args.data,
        )
        return
    config = RunConfig.from_json_file(path)
    if config.algorithm not in runtime_capabilities(args.runtime, args.predict_only):
        return  # this runtime cannot run it: the coordinator refuses the client at its hello, saying why
    started = time.perf_counter()
    plans = planned_trainings(config, args.client_id, data, info.model, info.input_shape)
    for plan in plans:
        prepare([plan.loss], plan.batch_size)
    log.info(
        "prepared %d training program(s) for %s in %.1f s, before the hello",
        len(plans),
        config.algorithm,
        time.perf_counter() - started,
    )


def runtime_capabilities(runtime: str, predict_only: bool) -> tuple[str, ...]:
    """The algorithms a client on ``runtime`` can really run, for its hello: those whose training hooks the runtime
    runs (:data:`edge_client.backends.RUNTIME_HOOKS`); an ONNX Runtime client cannot train, so it runs none, or,
    predict-only, the output-sharing ones (FD and DS-FL) that it can serve from its deployed model."""
    from edge_client.backends import RUNTIME_HOOKS
    from fedge.algorithms.catalog import ALGORITHMS

    if runtime != "onnxruntime":
        return tuple(name for name, spec in ALGORITHMS.items() if spec.hooks <= RUNTIME_HOOKS[runtime])
    return tuple(name for name, spec in ALGORITHMS.items() if spec.exchange == "outputs") if predict_only else ()


def _warm_up(backend: TorchBackend, x: torch.Tensor, y: torch.Tensor) -> None:
    """Two throw-away training steps on a copy of the model, before the hello.

    The first training call of a process pays for kernel and library initialization (seconds on a CPU,
    more for a CUDA context on a Jetson); paying it here keeps it out of round 1's deadline and timing. The real
    model and the client's state are untouched, so results do not change.
    """
    from fedge.algorithms.fedavg import CrossEntropy
    from fedge.learning.training import SGDSettings, TrainRequest, predict_logits, train

    model = copy.deepcopy(backend.model)
    n = min(len(x), 64)
    train(model, TrainRequest(x[:n], y[:n], CrossEntropy(), SGDSettings(lr=1e-3, momentum=0.9), 1, 32, 0))
    predict_logits(model, x[:n])
