"""The flags several commands share, and the run config they make: one ``--flag`` per config field and per algorithm
setting (generated from :class:`fedge.config.RunConfig`, :class:`fedge.config.TrainConfig` and the algorithm registry),
``--plugin``, ``--previous-journal``, the packet-size types, and the help formatter every command's parser uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

from fedge.errors import ConfigError
from fedge.registry import ALGORITHMS

# Imported where used, not here: `fedge --help` and `fedge --version` answer without loading torch (2-7 s).
if TYPE_CHECKING:
    from fedge.config import RunConfig

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
    # The setting's own default; the flag's (None: "keep the config's value") is never shown (see HelpFormatter).
    shown = f"(default: {default})" if default is not None and "(default" not in described else ""
    help_text = " ".join(x for x in (described, extra, shown) if x)
    if typ is bool:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    else:
        group.add_argument(flag, dest=dest, type=typ, default=None, metavar=f.name.upper(), help=help_text)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
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
    :data:`fedge.aggregation.robust.DEPLOYMENT_CLIP_FACTOR` and the update bound
    :data:`fedge.aggregation.robust.DEPLOYMENT_MAX_UPDATE_RATIO`; for one that exchanges soft labels (DS-FL),
    :data:`fedge.aggregation.robust.DEPLOYMENT_SOFT_LABEL_RULE`; and a quorum of :data:`DEPLOYMENT_MIN_REPLIES`
    instead of every sampled client (one refused reply must not skip a round).
    """
    from fedge.aggregation.robust import (
        DEPLOYMENT_CLIP_FACTOR,
        DEPLOYMENT_MAX_UPDATE_RATIO,
        DEPLOYMENT_RULE,
        DEPLOYMENT_SOFT_LABEL_RULE,
    )
    from fedge.config import RunConfig

    # A resumed run keeps what its config.json says.
    chosen_clip = chosen_quorum = chosen_rule = chosen_bound = base is not None
    config = base or (RunConfig.from_json_file(args.config) if getattr(args, "config", None) else RunConfig())
    if getattr(args, "config", None):
        raw = json.loads(Path(args.config).read_text())  # valid: from_json_file read it (one-line errors)
        chosen_clip, chosen_quorum = "clip_factor" in (raw.get("algo") or {}), "min_replies" in raw
        chosen_rule = "robust" in (raw.get("algo") or {})
        chosen_bound = "max_update_ratio" in (raw.get("algo") or {})
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
    # FedBuff's step is a weighted mean of buffered moves (robust rules, clipping and a round's quorum are refused
    # with it): a FedBuff deployment keeps the papers' defaults, and says so when it starts (coordinator/run.py).
    buffered = changes["run"].get("aggregation", config.aggregation) == "fedbuff"
    if deployment and not chosen_rule and "robust" in own and not (secure or private or buffered):
        rule = DEPLOYMENT_RULE if "clip_factor" in own else DEPLOYMENT_SOFT_LABEL_RULE
        base_algo = dataclasses.replace(base_algo, **{"robust": rule})
    if deployment and not chosen_clip and "clip_factor" in own and not (secure or private or buffered):
        base_algo = dataclasses.replace(base_algo, **{"clip_factor": DEPLOYMENT_CLIP_FACTOR})
    if deployment and not chosen_bound and "max_update_ratio" in own and not (secure or private or buffered):
        base_algo = dataclasses.replace(base_algo, **{"max_update_ratio": DEPLOYMENT_MAX_UPDATE_RATIO})
    if deployment and not chosen_quorum and not buffered:
        config = dataclasses.replace(config, min_replies=DEPLOYMENT_MIN_REPLIES)
    algo = dataclasses.replace(base_algo, **changes["algo"])
    train = dataclasses.replace(config.train, **changes["train"])
    return dataclasses.replace(config, **changes["run"], train=train, algo=algo)


def run_config(args: argparse.Namespace, *, deployment: bool = False) -> RunConfig:
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


def packet_limit(text: str) -> Any:
    from fedge_io.connection import packet_limit_arg  # imported on use: the MQTT client is not needed to parse

    return packet_limit_arg(text)


def packet_size(text: str) -> int:
    limit = packet_limit(text)
    if not isinstance(limit, int):
        raise argparse.ArgumentTypeError(f"{text!r}: give the broker's limit in bytes, e.g. 1MB")
    return limit


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default said once: argparse's "(default: X)" only where the text does not say it already and the
    default means something (not None, "not given", and not an off switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action) or text
