"""``fedge export``: export a model to ONNX / ExecuTorch, check parity, refuse what fails; ``fedge export check``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from export.onnx import DEFAULT_OPSET, MIN_OPSET, ONNXRUNTIME_RELEASES, onnx_target
from fedge.algorithms.catalog import objective_kinds
from fedge.errors import ConfigError, ExportError
from fedge.types import StateDict
from fedge_io import manifest

if TYPE_CHECKING:
    from cryptography.x509 import Certificate
    from torch import nn

    from fedge.programs.spec import ModelSpec, TrainingLoss

log = logging.getLogger(__name__)

FORMATS = ("onnx", "pte", "pte-train")
_FORMAT_LABELS = {"onnx": "ONNX", "pte": "ExecuTorch inference", "pte-train": "ExecuTorch training"}
WEIGHTS_FILE = "weights.safetensors"
"""The reference weights written beside the exports of one ``fedge export`` call (read back by ``check``)."""


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fedge export`` and its ``check`` subcommand."""
    p.add_argument(
        "--model", help="model name (fedavg_cnn, dsfl_mnist_cnn, dsfl_fmnist_cnn, reuters_mlp, imdb_lstm, ...)"
    )
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 1,28,28 (none: the paper's)")
    p.add_argument("--num-classes", type=int, default=10, help="classes of the model's output")
    p.add_argument(
        "--weights", type=Path, default=None, help="exchanged state to export (.safetensors, e.g. a run's global_model)"
    )
    p.add_argument("--seed", type=int, default=0, help="initialization seed when no --weights are given")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=["onnx", "pte"], help="what to export")
    p.add_argument(
        "--objective",
        nargs="+",
        choices=objective_kinds(),
        default=["ntd"],
        help="losses of the training programs (--format pte-train), one program each: ce (FedAvg, FD round 1, "
        "DS-FL), ntd (FedNTD), lsd (FedLSD and FedCAD), soft (DS-FL distillation), fd (FD distillation)",
    )
    p.add_argument("--tau", type=float, default=1.0, help="distillation temperature baked into ntd/lsd programs")
    p.add_argument("--beta", type=float, default=1.0, help="distillation weight baked into ntd programs")
    p.add_argument("--gamma", type=float, default=1.0, help="FD regularizer weight baked into fd programs")
    p.add_argument("--prox-mu", type=float, default=0.0, help="FedProx: bake the proximal term mu into the programs")
    p.add_argument(
        "--term",
        action="append",
        default=[],
        metavar="KIND[:name=value,...]",
        help="a local term baked into every training program, e.g. prox:mu=0.1, correction, moon:mu=1,tau=0.5, "
        "decorr:beta=0.1 (repeat for several; the order is the loss's)",
    )
    p.add_argument(
        "--max-batch",
        nargs="+",
        type=int,
        default=list(default_batch_bounds()),
        help="batch bounds of the .pte programs (recorded in each file; ExecuTorch plans memory for them). pte-train "
        "writes one program per bound and loss; clients look up the bound of their batch size, the next power of "
        "two and at least 64, so the default covers local training (batch 50 -> 64) and DS-FL distillation (batch "
        "100 -> 128). The inference .pte takes the largest; runners split larger batches",
    )
    p.add_argument(
        "--opset",
        type=int,
        default=DEFAULT_OPSET,
        help="ONNX opset of the .onnx file: the newest the oldest onnxruntime you deploy implements. The file "
        "declares the IR version that runtime loads: "
        + "; ".join(
            f"{t.opset}: IR {t.ir_version} (onnxruntime {t.min_onnxruntime}+)" for t in map(onnx_target, _opsets())
        )
        + ". The default loads on JetPack 5/6's onnxruntime 1.16 and 1.17, which refuse IR 10",
    )
    p.add_argument("--no-xnnpack", action="store_true", help="inference .pte on portable kernels only")
    p.add_argument("--out", type=Path, default=Path("exports"), help="output directory")
    p.add_argument(
        "--sign-key",
        type=Path,
        default=None,
        metavar="PATH",
        help="sign the output directory's manifest with this private key (PEM), or with the CA key of the fleet kit "
        "at PATH (ca/ca.key), so devices started with --trust-ca can check who produced the programs",
    )
    sub = p.add_subparsers(dest="export_command", metavar="check | sign")
    c = sub.add_parser("check", help="re-run the parity checks of existing exports")
    c.add_argument("files", nargs="+", type=Path, help=".onnx / .pte files")
    c.add_argument(
        "--weights",
        dest="check_weights",
        type=Path,
        default=None,
        help=f"reference weights (none: {WEIGHTS_FILE} beside each file, if present)",
    )
    c.add_argument(
        "--trust-ca",
        type=Path,
        default=None,
        metavar="PATH",
        help="accept only files whose manifest is signed by this CA certificate (PEM, or a kit bundle's ca.crt)",
    )
    s = sub.add_parser(
        "sign", help="sign the manifests of existing export directories (e.g. ONNX Runtime training artifacts)"
    )
    s.add_argument("directories", nargs="+", type=Path, help="directories holding a manifest.json")
    s.add_argument(
        "--sign-key", dest="sign_with", type=Path, required=True, metavar="PATH", help="as fedge export --sign-key"
    )


def _opsets() -> range:
    return range(MIN_OPSET, ONNXRUNTIME_RELEASES[-1][1] + 1)


def default_batch_bounds() -> tuple[int, ...]:
    """The program batch bounds clients look up for the default batch sizes: local training and DS-FL distillation."""
    from edge_client.backends.executorch import batch_bound
    from fedge.algorithms.dsfl import DSFLSettings
    from fedge.config import TrainConfig

    sizes = (TrainConfig().batch_size, DSFLSettings().distill_batch_size)
    return tuple(sorted({batch_bound(b) for b in sizes}))


def run_export_cli(args: argparse.Namespace) -> int:
    """Dispatch ``fedge export`` / ``fedge export check``."""
    if args.export_command == "check":
        trust = None if args.trust_ca is None else _signing().load_trusted_ca(args.trust_ca)
        return _check(args.files, args.check_weights, trust)
    if args.export_command == "sign":
        key = _signing().load_signing_key(args.sign_with)
        for directory in args.directories:
            print(f"signed {manifest.sign(directory, key)}")
        return 0
    return _export(args)


def _signing() -> ModuleType:
    """fedge_io.signing, imported only to sign or check signatures: it needs the cryptography package, which a
    client-only device that does neither may not have."""
    try:
        from fedge_io import signing
    except ImportError as exc:
        raise ConfigError(
            f"signing and checking signatures need the cryptography package ({exc}): pip install cryptography"
        ) from None
    return signing


def _load_weights(path: Path) -> StateDict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return dict(load_file(str(path)))
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"cannot read weights {path}: {exc}") from exc


def _input_shape(model: str, text: str | None) -> tuple[int, ...]:
    from fedge.learning.models import example_input

    if text is None:
        return tuple(example_input(model, batch=1).shape[1:])
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise ConfigError(f"--input-shape must be comma-separated integers, got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class ExportJob:
    """One file a ``fedge export`` call writes."""

    format: str  # one of FORMATS
    name: str  # the file name; a training program's is the one clients look up (fedge.programs.spec.program_file_name)
    loss: TrainingLoss | None  # training programs only
    max_batch: int  # batch bound of a .pte (ignored for ONNX, whose batch dimension is unbounded)


def export_jobs(args: argparse.Namespace) -> tuple[ModelSpec, list[ExportJob]]:
    """The model and the files of a ``fedge export`` call, validated and named; nothing is exported."""
    from fedge.algorithms.catalog import make_objective, objective_classes, terms_from_flags
    from fedge.programs.spec import ModelSpec, TrainingLoss, program_file_name

    if not args.model:
        raise ConfigError("fedge export needs --model (or the subcommand `check FILE...`)")
    bounds: list[int] = sorted(set(args.max_batch))
    if bounds[0] < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {bounds[0]}")
    if "onnx" in args.format:
        onnx_target(args.opset)  # refuse an unsupported opset before exporting anything
    spec = ModelSpec(args.model, _input_shape(args.model, args.input_shape), args.num_classes)
    jobs: list[ExportJob] = []
    for fmt in args.format:
        if fmt == "pte-train":
            for kind in args.objective:
                given = {"tau": args.tau, "beta": args.beta, "gamma": args.gamma}
                fields = {f.name for f in dataclasses.fields(objective_classes()[kind])}
                objective = make_objective(kind, {k: repr(float(v)) for k, v in given.items() if k in fields})
                loss = TrainingLoss(objective, terms_from_flags(args.term, float(args.prox_mu)))
                jobs.extend(ExportJob(fmt, program_file_name(spec, loss, bound), loss, bound) for bound in bounds)
        else:
            # One inference file, at the largest bound: it serves every batch size the training programs do.
            jobs.append(ExportJob(fmt, f"{spec.name}.{'onnx' if fmt == 'onnx' else 'pte'}", None, bounds[-1]))
    return spec, jobs


def _export(args: argparse.Namespace) -> int:
    from export.gates.check import check_bytes
    from export.gates.report import require
    from fedge.accounting.units import format_bytes
    from fedge.learning.models import exchanged_state, load_exchanged_state

    spec, jobs = export_jobs(args)
    key = None if args.sign_key is None else _signing().load_signing_key(args.sign_key)  # refused before any work
    model = spec.build(seed=args.seed)
    if args.weights is not None:
        load_exchanged_state(model, _load_weights(args.weights))
    weights = exchanged_state(model)
    out: Path = args.out
    from safetensors.torch import save

    weights_bytes = save({k: v.contiguous() for k, v in weights.items()})
    _refuse_other_weights(out, weights)
    out.mkdir(parents=True, exist_ok=True)
    # Every file goes in atomically with its SHA-256 in manifest.json, which clients verify before loading.
    manifest.write_file(out, WEIGHTS_FILE, weights_bytes, "weights")
    refused = 0
    for job in jobs:
        name = job.name
        try:
            data = _make(job, model, spec, args)
        except ExportError as exc:  # torch.export's pages of trace become one line naming the layer to rewrite
            from export.diagnose import explain_export_failure
            from fedge.learning.models import example_input

            what = f"{_FORMAT_LABELS[job.format]} export of {spec.name}"
            example = example_input(model, batch=2, input_shape=spec.input_shape)
            raise ExportError(explain_export_failure(what, model, example, exc)) from exc
        reports = check_bytes(data, job.format, weights, source=name)
        for r in reports:
            print(f"  {r}")
        try:
            require(reports)
        except ExportError as exc:
            print(f"fedge: refused {name}: {exc}", file=sys.stderr)
            refused += 1
            continue
        manifest.write_file(out, name, data, job.format)
        print(f"{out / name}  {format_bytes(len(data))} ({len(data):,} bytes)")
    if key is not None:  # the whole directory as it is now: the files of earlier exports into it included
        print(f"{manifest.sign(out, key)}  signature of {out / manifest.MANIFEST_FILE}")
    return 1 if refused else 0


def _refuse_other_weights(out: Path, weights: StateDict) -> None:
    """A directory holds the exports of one set of weights: a second export into it with other weights would leave
    its earlier files checked against weights they were not made from. Same weights: the files are added."""
    existing = out / WEIGHTS_FILE
    if not existing.is_file():
        return
    old = _load_weights(existing)
    same = old.keys() == weights.keys() and all(
        old[k].shape == v.shape and old[k].dtype == v.dtype and bool((old[k] == v).all()) for k, v in weights.items()
    )
    if not same:
        raise ConfigError(
            f"{out} already holds exports of other weights ({existing} differs from the weights of this export); "
            "export into a new --out directory, or give the same --weights (or --seed) as the export that made it"
        )


def _make(job: ExportJob, model: nn.Module, spec: ModelSpec, args: argparse.Namespace) -> bytes:
    if job.format == "onnx":
        from export.onnx import export_onnx

        return export_onnx(model, spec, opset=args.opset)
    if job.format == "pte":
        from export.executorch import export_inference

        return export_inference(model, spec, xnnpack=not args.no_xnnpack, max_batch=job.max_batch)
    from export.executorch import export_training

    assert job.loss is not None  # pte-train jobs always carry one
    return export_training(model, spec, job.loss, max_batch=job.max_batch)


def _check(files: list[Path], weights_path: Path | None, trust: Certificate | None = None) -> int:
    from export.gates.check import check_file

    failed = 0
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{path} does not exist")
        # The digests first: a damaged .pte can crash the runtime that loads it, and damaged weights mislead.
        try:
            manifest.verified_read(path, required=False, trust=trust)
            if weights_path is None and (path.parent / WEIGHTS_FILE).is_file():
                manifest.verified_read(path.parent / WEIGHTS_FILE, required=False, trust=trust)
        except manifest.ManifestError as exc:
            print(f"{path}: FAILED: {exc}")
            failed += 1
            continue
        if manifest.read_manifest(path.parent) is None:
            print(f"{path}: no {manifest.MANIFEST_FILE} beside it: its bytes are not verified, only its parity")
        candidate = weights_path or path.parent / WEIGHTS_FILE
        weights = _load_weights(candidate) if candidate.is_file() else None
        reports = check_file(path, weights)
        for r in reports:
            print(r)
        failed += sum(not r.passed for r in reports)
    return 1 if failed else 0
