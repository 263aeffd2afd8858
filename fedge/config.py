"""Run configuration: frozen dataclasses, validated on construction, serializable to JSON.

Defaults follow the papers: FedNTD Appendix B.3-B.4 (momentum SGD, lr 0.01, decay 0.99 per round, weight decay 1e-5).
Each algorithm's own settings are a frozen dataclass in its module (:mod:`fedge.algorithms`); ``RunConfig.algo`` holds
the one of ``RunConfig.algorithm``, and its JSON form is the ``algo`` section of ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedge.data.augment import PRESETS
from fedge.errors import ConfigError
from fedge.registry import ALGORITHMS, AlgorithmSettings, get_algorithm

if TYPE_CHECKING:
    from fedge.compression.strategy import Compression

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Local optimization, identical on every client."""

    lr: float = 0.01  # FedNTD B.3 (DS-FL 4.1 uses 0.1 with plain SGD)
    momentum: float = 0.9  # local only: momentum buffers never leave the client
    weight_decay: float = 1e-5
    lr_decay: float = 0.99  # per round: lr_r = lr * lr_decay ** (r - 1), sent in each task
    local_epochs: int = 3
    batch_size: int = 50
    augment: str = (
        "none"  # none | paper: FedNTD's random crop, flip and Cutout of training batches (fedge.data.augment)
    )

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 < self.lr_decay <= 1, f"lr_decay must be in (0, 1], got {self.lr_decay}")
        _check(self.local_epochs >= 0, f"local_epochs must be >= 0, got {self.local_epochs}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.augment in PRESETS, f"augment must be one of {', '.join(PRESETS)}, got {self.augment!r}")

    def lr_at(self, rnd: int) -> float:
        """Learning rate of round ``rnd`` (1-based)."""
        return self.lr * self.lr_decay ** (rnd - 1)


DP_INITIAL_CLIP = 0.1
"""Adaptive clipping's starting clip (Andrew et al. 2021, Sec. 4: C0 = 0.1); the geometric update moves it by a factor
of up to exp(lr) a round."""

SECAGG_CLIP = 5.0
"""The default L2 bound of one client's update under secure aggregation (see docs/secure_aggregation.md for how it
was chosen)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run; two runs with equal configs produce the same global model."""

    algorithm: str = "fedntd"
    dataset: str = "digits"
    data_dir: str | None = None
    model: str | None = None  # None: the default model for the dataset
    num_clients: int = 10
    client_fraction: float = 1.0  # share of clients sampled each round
    rounds: int = 10
    partition: str = "shards"  # iid | shards | dirichlet
    shards_per_client: int = 2
    dirichlet_alpha: float = 0.1
    min_client_size: int = 10
    train_size: int = 0  # a seeded subset of the training set (FedNTD B.2: 50,000 for MNIST); 0 = all of it
    seed: int = 0
    min_replies: float = 1.0  # quorum: share of the sampled clients whose replies are needed to aggregate
    # The cohort floor: a round aggregates no fewer replies than this (capped at the clients sampled per round), so a
    # round after drops never becomes one client's model. docs/deployment.md#the-cohort-floor says why 2.
    min_cohort: int = field(
        default=2,
        metadata={
            "help": "cohort floor: a round aggregates at least this many replies, whatever --min-replies' share of "
            "the sampled (capped at the clients per round; DP-FedAvg runs, whose noise is sized to the expected "
            "cohort, are exempt and refuse another value, as do FedBuff runs, whose steps take --buffer-size updates) "
            "(default: 2)"
        },
    )
    eval_every: int = 1
    eval_samples: int = 0  # 0 = the whole test set
    # DS-FL's open/private split of the training set (DS-FL 4.1); other algorithms given a private_size train on the
    # same private set, so FL and DS-FL runs with one seed compare on identical client data.
    open_size: int = 20_000  # I^o, unlabeled open set carved out of the training data (DS-FL only)
    private_size: int = 0  # I^p, 0 = everything not in the open set
    # Compression of what travels (fedge.compression.strategy): NAME[:OPTION,...], e.g. int8:row,offset or
    # topk:density=0.01.
    upload_codec: str = "float32"
    broadcast_codec: str = "float32"
    # Secure aggregation (fedge.secagg, docs/secure_aggregation.md): the server learns the sum of the round's updates,
    # never one of them; in fedge sim and over MQTT.
    secure_aggregation: bool = field(
        default=False,
        metadata={
            "help": "SecAgg+: the server learns only the sum of the round's updates (FedAvg family, SCAFFOLD, FedNova, "
            "FedDyn; turns the server's update-norm check, max_update_ratio, off: each client clips its own update "
            "instead) (default: off)"
        },
    )
    secagg_clip: float = field(
        default=SECAGG_CLIP,
        metadata={
            "help": "with --secure-aggregation: each client clips its update (new weights - broadcast weights) to this "
            "L2 norm before masking, and each further part of its input (SCAFFOLD's control delta, FedDyn's second "
            "copy) to it on its own; it is also the fixed-point ring's bound per value"
        },
    )
    secagg_degree: int = field(
        default=0,
        metadata={"help": "with --secure-aggregation: neighbours per client (0: min(N-1, 2 ceil(log2 N) + 1))"},
    )
    secagg_threshold: int = field(
        default=0,
        metadata={"help": "with --secure-aggregation: shares that recover a secret (0: floor(degree / 2) + 1)"},
    )
    simulate_dropouts: float = field(
        default=0.0,
        metadata={
            "help": "with --secure-aggregation: this share of each round's sampled clients vanishes at a random "
            "protocol stage (before sharing keys, before uploading, or while unmasking), seeded by the run's seed"
        },
    )
    # Client-level differential privacy (fedge.privacy, docs/privacy.md): DP-FedAvg with Poisson sampling, clipping,
    # Gaussian noise on the sum and an accountant. In process only (fedge sim) for now.
    dp_noise_multiplier: float = field(
        default=0.0,
        metadata={
            "help": "DP-FedAvg (McMahan et al. 2018): Gaussian noise of std Z * clip on the sum of the clipped "
            "updates; Z > 0 turns client-level differential privacy on (FedAvg family; in process only; Poisson "
            "sampling at rate --client-fraction, clients weighed uniformly) (default: 0, off)"
        },
    )
    dp_clip: str = field(
        default="adaptive",
        metadata={
            "help": "with --dp-noise-multiplier: the L2 bound C of each client's update (new weights - broadcast "
            "weights), a number, or adaptive[:C0] (Andrew et al. 2021: C follows the --dp-target-quantile of the "
            f"update norms, from C0 = {DP_INITIAL_CLIP:g} unless given)"
        },
    )
    dp_target_quantile: float = field(
        default=0.5,
        metadata={"help": "with --dp-clip adaptive: the share of updates the clip should leave unclipped"},
    )
    dp_clip_lr: float = field(
        default=0.2,
        metadata={"help": "with --dp-clip adaptive: the learning rate of the clip's geometric update"},
    )
    dp_delta: float = field(
        default=0.0,
        metadata={"help": "with --dp-noise-multiplier: the delta epsilon is reported at (0: 1 / num_clients^1.1)"},
    )
    dp_epsilon_budget: float = field(
        default=0.0,
        metadata={
            "help": "with --dp-noise-multiplier: stop before the round whose epsilon would exceed this (0: no budget)"
        },
    )
    dp_accountant: str = field(
        default="rdp",
        metadata={"help": "with --dp-noise-multiplier: rdp (Renyi DP) or pld (privacy loss distributions, tighter)"},
    )
    dp_noise_seed: int | None = field(
        default=None,
        metadata={
            "help": "with --dp-noise-multiplier: seed the noise, for reproducible simulations only (refused by fedge "
            "coordinator) (default: none, the noise is seeded from os.urandom each round)"
        },
    )
    # Simulated time (docs/simulated_time.md): each client's compute speed, link and availability give every round a
    # simulated duration from the bytes it exchanged. In process only (fedge sim).
    client_profiles: str = field(
        default="",
        metadata={
            "help": "simulated time: every client's compute, link and availability: uniform, "
            "tail:fraction=0.1,slowdown=10, lognormal:sigma=1 (each with compute=SECONDS per sample-step or "
            "measure, and optional period=SECONDS,duty=F availability), or a .csv/.json file with a row per client "
            "(docs/simulated_time.md) (default: none; uniform when only --link is given)"
        },
    )
    link: str = field(
        default="",
        metadata={
            "help": "simulated time: every client's link (unless its profile row names its own): ethernet "
            "(1000/1000 Mbit/s, 0.5 ms), wifi (50 up/100 down Mbit/s, 5 ms), lte (10/30 Mbit/s, 50 ms), "
            "cellular-edge (1/5 Mbit/s, 120 ms), PRESET:latency=80ms, or up=1Mbit,down=10Mbit,latency=80ms; "
            "nominal figures, assumed (default: wifi when --client-profiles is given)"
        },
    )
    sim_deadline: float = field(
        default=0.0,
        metadata={
            "help": "simulated time: a sampled client whose simulated round (transfers, compute, latency) exceeds this "
            "many seconds is dropped from the round, as a coordinator's round timeout drops it (default: 0, none)"
        },
    )
    # Buffered asynchronous aggregation (FedBuff, Nguyen et al. AISTATS 2022; docs/simulated_time.md): clients train on
    # the model they last received and the server steps every buffer_size updates. In fedge sim on the simulated
    # clock, in fedge coordinator (and fedge sim --transport mqtt) on the real one.
    aggregation: str = field(
        default="sync",
        metadata={
            "help": "sync (rounds wait for their sampled clients) or fedbuff (buffered asynchronous: the server steps "
            "every --buffer-size updates, whatever model version they trained on; FedAvg family; in process it "
            "needs the simulated clock, --client-profiles or --link; over MQTT it runs on the real one) (with "
            "--algorithm dsfl the flag sets "
            "DS-FL's own soft-label aggregation, era or sa, instead)"
        },
    )
    buffer_size: int = field(
        default=0,
        metadata={"help": "with --aggregation fedbuff: updates per server step, K (default: 0, the cohort size)"},
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "with --aggregation fedbuff: drop an update trained on a model more than this many server steps "
            "old (default: none, no update is dropped for its age)"
        },
    )
    staleness_weight: str = field(
        default="constant",
        metadata={
            "help": "with --aggregation fedbuff: an update s steps old counts weight(s) x its data size: constant "
            "(1), sqrt (1/(1+sqrt(s)), FedBuff's), or poly:A (1/(1+s)^A)"
        },
    )
    concurrency: int = field(
        default=0,
        metadata={"help": "with --aggregation fedbuff: clients training at once (default: 0, the cohort size)"},
    )
    server_lr: float = field(
        default=1.0,
        metadata={
            "help": "with --aggregation fedbuff: the server step w <- w + server_lr x the buffer's mean update "
            "(with --algorithm scaffold the flag sets SCAFFOLD's own global step size lr_g instead)"
        },
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgorithmSettings = field(default_factory=AlgorithmSettings)  # the settings of ``algorithm``; the base: its
    # defaults

    def __post_init__(self) -> None:
        spec = get_algorithm(self.algorithm)
        if self.algo is None or type(self.algo) is AlgorithmSettings:
            object.__setattr__(self, "algo", spec.settings())
        _check(
            type(self.algo) is spec.settings,
            f"algo settings of type {type(self.algo).__name__} do not belong to {self.algorithm!r}",
        )
        _check(self.num_clients >= 1, f"num_clients must be >= 1, got {self.num_clients}")
        _check(0 < self.client_fraction <= 1, f"client_fraction must be in (0, 1], got {self.client_fraction}")
        _check(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        _check(0 < self.min_replies <= 1, f"min_replies must be in (0, 1], got {self.min_replies}")
        _check(self.min_cohort >= 1, f"min_cohort must be >= 1, got {self.min_cohort}")
        _check(self.eval_every >= 1, "eval_every must be >= 1")
        _check(self.eval_samples >= 0, "eval_samples must be >= 0")
        _check(self.train_size >= 0, f"train_size must be >= 0, got {self.train_size}")
        _check(self.open_size >= 0 and self.private_size >= 0, "open_size and private_size must be >= 0")
        _ = self.compression  # ConfigError for a scheme that does not parse or does not fit the algorithm
        _check(
            math.isfinite(self.secagg_clip) and self.secagg_clip > 0,
            f"secagg_clip must be a positive number, got {self.secagg_clip}",
        )
        _check(self.secagg_degree >= 0, f"secagg_degree must be >= 0 (0: the default), got {self.secagg_degree}")
        _check(
            self.secagg_threshold >= 0, f"secagg_threshold must be >= 0 (0: the default), got {self.secagg_threshold}"
        )
        _check(0 <= self.simulate_dropouts < 1, f"simulate_dropouts must be in [0, 1), got {self.simulate_dropouts}")
        if self.simulate_dropouts > 0:
            _check(
                self.secure_aggregation,
                "--simulate-dropouts drops clients out of secure aggregation's protocol: it needs --secure-aggregation",
            )
        if self.secure_aggregation:
            self._fit_secure_aggregation()
        self._check_differential_privacy()
        self._check_simulated_time()
        self._check_buffered()

    @property
    def compression(self) -> Compression:
        """The schemes of what travels (``upload_codec``, ``broadcast_codec``), as they fit the algorithm's exchange;
        ConfigError for one that does not parse or does not fit."""
        from fedge.compression.strategy import Compression  # on use: it imports torch, which `fedge --help` need not

        weights = get_algorithm(self.algorithm).exchange == "weights"
        return Compression.parse(self.upload_codec, self.broadcast_codec, weights=weights)

    @property
    def simulated_time(self) -> bool:
        """Whether ``fedge sim`` keeps a simulated clock (``client_profiles`` or ``link`` given)."""
        return bool(self.client_profiles or self.link)

    def _check_simulated_time(self) -> None:
        """ConfigError for a profiles or link SPEC that does not parse (a profiles file is read when the run starts)."""
        from fedge.profiles import parse_link, parse_profiles

        if self.link:
            parse_link(self.link)
        if self.client_profiles:
            parse_profiles(self.client_profiles)
        _check(
            math.isfinite(self.sim_deadline) and self.sim_deadline >= 0,
            f"sim_deadline must be >= 0 s, got {self.sim_deadline}",
        )
        _check(
            self.sim_deadline == 0 or self.simulated_time,
            "--sim-deadline acts on simulated time: give --client-profiles or --link too",
        )

    @property
    def buffered(self) -> bool:
        """Whether the run aggregates asynchronously (FedBuff, ``aggregation == "fedbuff"``)."""
        return self.aggregation == "fedbuff"

    @property
    def fedbuff_buffer_size(self) -> int:
        """FedBuff's K: ``buffer_size``, or the cohort size when it is 0."""
        return self.buffer_size or self.clients_per_round

    @property
    def fedbuff_concurrency(self) -> int:
        """FedBuff's clients training at once: ``concurrency``, or the cohort size when it is 0."""
        return self.concurrency or self.clients_per_round

    def _check_buffered(self) -> None:
        """ConfigError for a FedBuff option out of range, given without ``--aggregation fedbuff``, or for what FedBuff
        cannot run with (one line naming the conflict). The algorithm family is checked where the run starts
        (``coordinator.fedbuff.check_algorithm``): only a plain mean of returned weights can be stepped from a buffer;
        the clock (simulated in ``fedge sim``, real over MQTT) where the run's transport is known."""
        from fedge.aggregation.fedbuff import StalenessWeight

        _check(
            self.aggregation in ("sync", "fedbuff"), f"aggregation must be sync or fedbuff, not {self.aggregation!r}"
        )
        StalenessWeight.parse(self.staleness_weight)
        _check(self.buffer_size >= 0, f"buffer_size must be >= 1 (0: the cohort size), got {self.buffer_size}")
        _check(self.concurrency >= 0, f"concurrency must be >= 1 (0: the cohort size), got {self.concurrency}")
        _check(
            self.max_staleness is None or self.max_staleness >= 0,
            f"max_staleness must be >= 0 server steps, got {self.max_staleness}",
        )
        _check(math.isfinite(self.server_lr) and self.server_lr > 0, f"server_lr must be > 0, got {self.server_lr}")
        if not self.buffered:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            changed = [
                name
                for name in ("buffer_size", "max_staleness", "staleness_weight", "concurrency", "server_lr")
                if getattr(self, name) != defaults[name]
            ]
            _check(
                not changed,
                f"--{changed[0].replace('_', '-') if changed else ''} is a FedBuff setting: add --aggregation fedbuff",
            )
            return
        _check(
            self.fedbuff_buffer_size <= self.num_clients,
            f"--buffer-size {self.fedbuff_buffer_size} exceeds the {self.num_clients} clients: a client trains at most "
            "once on each model version, so the buffer would never fill; lower --buffer-size",
        )
        _check(
            self.fedbuff_concurrency <= self.num_clients,
            f"--concurrency {self.fedbuff_concurrency} exceeds the {self.num_clients} clients: lower it",
        )
        min_cohort_default = next(f.default for f in dataclasses.fields(self) if f.name == "min_cohort")
        for given, why in (
            (self.sim_deadline == 0, "--sim-deadline times out a synchronous round; FedBuff has no round to wait "
             "for: bound the age of updates with --max-staleness instead"),
            (self.min_replies == 1.0, "--min-replies is a synchronous round's quorum; a FedBuff step always has "
             "--buffer-size updates: leave it at 1"),
            (self.min_cohort == min_cohort_default, "--min-cohort is a synchronous round's cohort floor, which FedBuff "
             "ignores (a step always takes --buffer-size updates): set --buffer-size instead"),
            (not self.secure_aggregation, "--secure-aggregation masks one round's cohort together; a FedBuff buffer "
             "mixes updates of several model versions (not built)"),
            (not self.differential_privacy, "--dp-noise-multiplier's accountant assumes synchronous Poisson-sampled "
             "rounds (not built for FedBuff)"),
            (self.upload_codec == "float32" and self.broadcast_codec == "float32", "--upload-codec/--broadcast-codec: "
             "FedBuff's delta is taken against the exact model version a client received; compressed exchanges "
             "are not supported with it yet: use float32"),
        ):  # fmt: skip
            _check(given, f"--aggregation fedbuff: {why}")
        algo = self.algo
        for name, plain in (("robust", "mean"), ("clip_factor", 0.0), ("noise_factor", 0.0)):
            value = getattr(algo, name, plain)
            _check(
                value == plain,
                f"--aggregation fedbuff with --{name.replace('_', '-')} {value}: FedBuff's server step is a weighted "
                f"mean of the buffered updates; robust rules, clipping and noise are not built for it: use "
                f"--{name.replace('_', '-')} {plain}",
            )

    def _fit_secure_aggregation(self) -> None:
        """ConfigError naming what secure aggregation cannot run with: it hands the server the sum of the round's
        updates only, so whatever needs one update in the clear is refused. The server's update-norm check at its
        default is turned off (each client's clip to ``secagg_clip`` bounds an update instead); another value is
        refused."""
        spec = get_algorithm(self.algorithm)
        if spec.secagg_gap:
            supported = ", ".join(name for name, a in ALGORITHMS.items() if not a.secagg_gap)
            raise ConfigError(
                f"--secure-aggregation cannot run --algorithm {self.algorithm} yet: {spec.secagg_gap}. It runs the "
                f"algorithms whose server needs only sums of the returned weights (and SCAFFOLD's control deltas): "
                f"{supported}"
            )
        algo = self.algo
        robust = getattr(algo, "robust", "mean")
        _check(
            robust == "mean",
            f"--robust {robust} needs every client's update in the clear, but secure aggregation shows the server "
            "only their sum; use --robust mean (each client clips its own update to --secagg-clip instead)",
        )
        clip_factor = getattr(algo, "clip_factor", 0.0)
        _check(
            clip_factor == 0,
            f"--clip-factor {clip_factor:g} clips each update against the round's median update norm, which needs "
            "every update in the clear; under secure aggregation each client clips its own update to --secagg-clip "
            "before masking: set --clip-factor 0",
        )
        noise = getattr(algo, "noise_factor", 0.0)
        _check(
            noise == 0,
            f"--noise-factor {noise:g} scales the server's noise by the round's median update norm, which needs every "
            "update in the clear; under secure aggregation set --noise-factor 0",
        )
        ratio = getattr(algo, "max_update_ratio", 0.0)
        if ratio > 0:
            default = next(f.default for f in dataclasses.fields(algo) if f.name == "max_update_ratio")
            _check(
                ratio == default,
                f"--max-update-ratio {ratio:g} refuses an update by its norm, which needs every update in the clear; "
                "under secure aggregation each client clips its own update to --secagg-clip before masking, which "
                "bounds it instead: leave --max-update-ratio at its default (secure aggregation turns it off) or 0",
            )
            object.__setattr__(self, "algo", dataclasses.replace(algo, **{"max_update_ratio": 0.0}))
        _check(
            self.upload_codec == "float32",
            f"--upload-codec {self.upload_codec}: under secure aggregation an upload is masked uint32 ring elements "
            "(4 bytes a value, as float32); upload codecs do not apply to it yet",
        )
        _check(
            self.clients_per_round >= 2,
            f"secure aggregation needs at least 2 clients per round, this run samples {self.clients_per_round}: raise "
            "--client-fraction or --num-clients",
        )
        _check(
            self.secagg_threshold == 0 or self.secagg_degree == 0 or self.secagg_threshold <= self.secagg_degree,
            f"secagg_threshold ({self.secagg_threshold}) cannot exceed secagg_degree ({self.secagg_degree})",
        )

    @property
    def differential_privacy(self) -> bool:
        """Whether the run is DP-FedAvg (``dp_noise_multiplier > 0``)."""
        return self.dp_noise_multiplier > 0

    @property
    def dp_fixed_clip(self) -> float | None:
        """The fixed clip of ``dp_clip``; None when it is adaptive."""
        return None if self.dp_clip.startswith("adaptive") else float(self.dp_clip)

    @property
    def dp_initial_clip(self) -> float:
        """The clip of round 1: the fixed clip, or adaptive clipping's C0."""
        fixed = self.dp_fixed_clip
        if fixed is not None:
            return fixed
        _, _, given = self.dp_clip.partition(":")
        return float(given) if given else DP_INITIAL_CLIP

    @property
    def dp_delta_used(self) -> float:
        """``dp_delta``, or ``1 / num_clients^1.1`` when it is 0."""
        return self.dp_delta or 1.0 / self.num_clients**1.1

    def _check_differential_privacy(self) -> None:
        """ConfigError for a DP setting out of range, or one DP-FedAvg cannot run with (one line naming the
        conflict)."""
        _check(
            math.isfinite(self.dp_noise_multiplier) and self.dp_noise_multiplier >= 0,
            f"dp_noise_multiplier must be >= 0 (0: off), got {self.dp_noise_multiplier}",
        )
        try:
            clip = self.dp_initial_clip
        except ValueError:
            raise ConfigError(f"dp_clip must be a positive number or adaptive[:C0], got {self.dp_clip!r}") from None
        _check(math.isfinite(clip) and clip > 0, f"dp_clip must be positive, got {self.dp_clip!r}")
        _check(0 < self.dp_target_quantile < 1, f"dp_target_quantile must be in (0, 1), got {self.dp_target_quantile}")
        _check(self.dp_clip_lr > 0, f"dp_clip_lr must be > 0, got {self.dp_clip_lr}")
        _check(0 <= self.dp_delta < 1, f"dp_delta must be in [0, 1) (0: 1 / num_clients^1.1), got {self.dp_delta}")
        _check(self.dp_epsilon_budget >= 0, f"dp_epsilon_budget must be >= 0 (0: none), got {self.dp_epsilon_budget}")
        _check(self.dp_accountant in ("rdp", "pld"), f"dp_accountant must be rdp or pld, got {self.dp_accountant!r}")
        if not self.differential_privacy:
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("dp_") and f.name != "dp_noise_multiplier" and getattr(self, f.name) != f.default
            ]
            _check(not changed, f"--{changed[0].replace('_', '-') if changed else ''} needs --dp-noise-multiplier > 0")
            return
        spec = get_algorithm(self.algorithm)
        if spec.name in ("dsfl", "fd"):
            raise ConfigError(
                f"--dp-noise-multiplier cannot run --algorithm {self.algorithm}: it uploads outputs (logits) on shared "
                "inputs, not weights; DP for them would clip and noise those outputs, which is not built "
                "(docs/privacy.md)"
            )
        if spec.dp_refusal:
            supported = ", ".join(name for name, a in ALGORITHMS.items() if not a.dp_refusal)
            raise ConfigError(
                f"--dp-noise-multiplier cannot run --algorithm {self.algorithm}: DP-FedAvg bounds each client's whole "
                f"contribution to the sums its server releases by one clip, and {spec.dp_refusal}. It runs: {supported}"
            )
        algo = self.algo
        robust = getattr(algo, "robust", "mean")
        _check(
            robust == "mean",
            f"--robust {robust} with --dp-noise-multiplier: DP-FedAvg bounds each client's part of a noised mean; a "
            "robust rule's output can move with one client by more than the clip: use --robust mean",
        )
        min_cohort_default = next(f.default for f in dataclasses.fields(self) if f.name == "min_cohort")
        _check(
            self.min_cohort == min_cohort_default,
            f"--min-cohort {self.min_cohort} with --dp-noise-multiplier: DP-FedAvg divides by the expected cohort, so "
            "any number of replies makes a valid round (a floor would void rounds the accountant counts): leave "
            "--min-cohort at its default, which DP ignores",
        )
        clip_factor = getattr(algo, "clip_factor", 0.0)
        _check(
            clip_factor == 0,
            f"--clip-factor {clip_factor:g} with --dp-noise-multiplier: clipping against the round's median norm makes "
            "one client's bound depend on the others; DP-FedAvg clips to --dp-clip: set --clip-factor 0",
        )
        ratio = getattr(algo, "max_update_ratio", 0.0)
        if ratio > 0:
            default = next(f.default for f in dataclasses.fields(algo) if f.name == "max_update_ratio")
            _check(
                ratio == default,
                f"--max-update-ratio {ratio:g} with --dp-noise-multiplier: its reference is the recent noised global "
                "updates, against which clean client updates look huge; DP-FedAvg's clip to --dp-clip bounds each "
                "update instead: leave --max-update-ratio at its default (DP turns it off) or 0",
            )
            algo = dataclasses.replace(algo, **{"max_update_ratio": 0.0})
            object.__setattr__(self, "algo", algo)
        _check(
            self.upload_codec == "float32" and self.broadcast_codec == "float32",
            "--upload-codec/--broadcast-codec with --dp-noise-multiplier: DP-FedAvg clips the exact delta from the "
            "broadcast weights; compressed exchanges are not supported with it yet: use float32",
        )
        weighting = getattr(algo, "weighting", "uniform")
        if weighting != "uniform":
            # User-level DP bounds each client's contribution by the clip; a weight by data size would let one
            # client's grow with its data. Uniform is DP-FedAvg's estimator (McMahan et al. 2018, w_k = 1).
            log.info("differential privacy weighs every client alike: --weighting uniform (was %s)", weighting)
            object.__setattr__(self, "algo", dataclasses.replace(algo, **{"weighting": "uniform"}))
        if self.secure_aggregation:
            _check(
                self.secagg_clip == SECAGG_CLIP,
                "--secagg-clip with --dp-noise-multiplier: each client clips its update to --dp-clip, not "
                "--secagg-clip; leave --secagg-clip at its default",
            )

    @property
    def clients_per_round(self) -> int:
        return max(1, round(self.client_fraction * self.num_clients))

    @property
    def cohort_floor(self) -> int:
        """The fewest replies a round aggregates: ``min_cohort``, capped at the clients sampled per round."""
        return min(self.min_cohort, self.clients_per_round)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # algo becomes its settings' dict

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Build from a dict such as a saved ``config.json``; unknown keys are an error, not silently dropped.

        The ``algo`` section is read with the settings of ``algorithm``. Settings that belong to another algorithm
        (a config written before settings were per algorithm) are ignored with a warning.
        """
        for section in ("train", "algo"):
            if not isinstance(raw.get(section) or {}, dict):
                raise ConfigError(f"{section} must be a JSON object of settings, got {json.dumps(raw[section])[:80]}")
        raw = dict(raw)
        raw.pop("fedge", None)  # which fedge wrote a run's config.json (fedge_io.provenance): a record, not a setting
        train = _sub(TrainConfig, raw.pop("train", {}) or {}, "train")
        algo_raw = dict(raw.pop("algo", {}) or {})
        for moved in ("open_size", "private_size"):  # run settings now; older configs kept them under algo
            if moved in algo_raw:
                raw.setdefault(moved, algo_raw.pop(moved))
        spec = get_algorithm(str(raw.get("algorithm", cls.algorithm)))
        own = {f.name for f in dataclasses.fields(spec.settings)}
        foreign = sorted(k for k in algo_raw if k not in own and k in _all_setting_names())
        if foreign:
            log.info("ignoring settings of other algorithms for %s: %s", spec.name, ", ".join(foreign))
        algo = _sub(spec.settings, {k: v for k, v in algo_raw.items() if k not in foreign}, f"algo ({spec.name})")
        return _sub(cls, {**raw, "train": train, "algo": algo}, "run")

    @classmethod
    def from_json_file(cls, path: str | Path) -> RunConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a JSON object of settings, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None


def _all_setting_names() -> set[str]:

    return {f.name for spec in ALGORITHMS.values() for f in dataclasses.fields(spec.settings)}


def _sub(kind: Any, raw: dict[str, Any], section: str) -> Any:
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown {section} setting(s) {unknown}; known: {sorted(known)}")
    hints = typing.get_type_hints(kind)
    for name, value in raw.items():
        _check_type(value, hints[name], f"{section} setting {name!r}")
    return kind(**raw)


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "null"}


def _check_type(value: Any, hint: Any, what: str) -> None:
    """A ConfigError naming the setting when a JSON value has the wrong type ("lr": "0.01x"), not a TypeError later.

    JSON numbers: an integer is a valid float; true/false are neither (bool is an int subclass in Python)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if hint is Any or any(dataclasses.is_dataclass(t) for t in allowed):
        return

    def fits(t: Any) -> bool:
        if t is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if t is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if t is type(None):
            return value is None
        return isinstance(value, t)

    if not any(fits(t) for t in allowed):
        wanted = " or ".join(_TYPE_NAMES.get(t, getattr(t, "__name__", str(t))) for t in allowed)
        raise ConfigError(f"{what} must be {wanted}, got {json.dumps(value)[:80]}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
