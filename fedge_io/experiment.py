"""Turn a RunConfig into data, partitions, clients and a strategy: the set-up every kind of run shares."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from fedge.algorithms import make_strategy
from fedge.algorithms.base import ClientData, ServerContext, Strategy, derive_seed
from fedge.algorithms.catalog import get_algorithm
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig
from fedge.data.augment import preset as augment_preset
from fedge.data.datasets import Dataset, load_dataset
from fedge.data.partition import class_counts, open_private_split, partition
from fedge.errors import ConfigError
from fedge.learning.models import MODELS, build_model, default_model_for
from fedge.learning.training import REPRESENTATION
from fedge.plugins import check_model_on
from fedge.types import ClientId

log = logging.getLogger(__name__)


def client_ids(num_clients: int) -> list[ClientId]:
    """Stable ids ``c000``, ``c001``, ... (they sort in numeric order)."""
    width = max(3, len(str(num_clients - 1)))
    return [f"c{i:0{width}d}" for i in range(num_clients)]


@dataclass
class Experiment:
    """A run's data, split among clients as the config says."""

    config: RunConfig
    model: str
    train: Dataset
    test: Dataset
    parts: dict[ClientId, np.ndarray]  # indices into ``train``
    open_indices: np.ndarray | None  # DS-FL's unlabeled open set, indices into ``train``
    eval_indices: np.ndarray  # indices into ``test`` used for evaluation
    _test: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train.input_shape

    def open_x(self) -> torch.Tensor | None:
        if self.open_indices is None:
            return None
        return torch.from_numpy(self.train.x[self.open_indices])

    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluation set, built once and shared: every FD client holds it, and 1,000 copies of MNIST's test set
        would take 31 GB."""
        if self._test is None:
            self._test = (
                torch.from_numpy(self.test.x[self.eval_indices]),
                torch.from_numpy(self.test.y[self.eval_indices]),
            )
        return self._test

    def client_data(self, client: ClientId, open_x: torch.Tensor | None = None) -> ClientData:
        idx = self.parts[client]
        data = ClientData(
            x=torch.from_numpy(self.train.x[idx]),
            y=torch.from_numpy(self.train.y[idx]),
            num_classes=self.num_classes,
            open_x=open_x,
        )
        if not get_algorithm(self.config.algorithm).has_global_model:  # FD: clients measure their own accuracy
            data.eval_x, data.eval_y = self.test_tensors()
        return data

    def model_factory(self) -> torch.nn.Module:
        return build_model(
            self.model,
            input_shape=self.input_shape,
            num_classes=self.num_classes,
            seed=derive_seed(self.config.seed, "model"),
        )

    def strategy(self, run_id: str = "", *, evaluation_device: str = "cpu") -> Strategy:
        context = ServerContext(
            self.model_factory,
            self.num_classes,
            run_id=run_id,
            open_x=self.open_x(),
            evaluation_device=evaluation_device,
        )
        return make_strategy(self.config, context)

    def partition_summary(self) -> dict[str, object]:
        """Class counts per client, saved with every run."""
        ids = sorted(self.parts)
        counts = class_counts(self.train.y, [self.parts[c] for c in ids], self.num_classes)
        return {
            "scheme": self.config.partition,
            "clients": {c: counts[i].tolist() for i, c in enumerate(ids)},
            "open_set_size": 0 if self.open_indices is None else len(self.open_indices),
        }

    def initial_bytes(self) -> dict[str, int]:
        """ComU@I: distributing DS-FL's open set once as float32 (DS-FL Table III), per accounting model."""
        if self.open_indices is None:
            return {}
        once = len(self.open_indices) * int(np.prod(self.input_shape)) * 4
        return {"multicast": once, "unicast": once * self.config.num_clients}


def prepare(config: RunConfig) -> Experiment:
    """Load the dataset and split it as ``config`` says; deterministic given ``config.seed``."""
    train, test = load_dataset(config.dataset, config.data_dir, seed=config.seed)
    model = config.model or default_model_for(config.dataset)
    if model not in MODELS:  # a plugin's model: a dry run on two training samples before any client trains it
        net = build_model(model, input_shape=train.input_shape, num_classes=train.num_classes, seed=0)
        check_model_on(model, net, train.x[:2], train.num_classes)
        if REPRESENTATION in get_algorithm(config.algorithm).hooks and not (
            callable(getattr(net, "representation", None)) and callable(getattr(net, "head", None))
        ):  # MOON compares representations: say so now, not in every client's first round
            raise ConfigError(
                f"{config.algorithm} compares the model's representations, but model {model!r} has no "
                "representation(x) / head(z) methods (head(representation(x)) must equal forward(x)); add them"
            )
    augment_preset(config.train.augment, train.input_shape)  # ConfigError now, not in every client's first round
    rng = np.random.default_rng(derive_seed(config.seed, "partition"))
    pool = np.arange(len(train))
    if config.train_size:
        # FedNTD B.2 trains on 50,000 of MNIST's 60,000 images: a seeded subset, the rest unused.
        if config.train_size > len(train):
            raise ConfigError(
                f"train_size {config.train_size} exceeds the {len(train)} training samples of {train.name}"
            )
        subset_rng = np.random.default_rng(derive_seed(config.seed, "train_size"))
        pool = np.sort(subset_rng.choice(len(train), config.train_size, replace=False))
    open_indices = None
    needs_open_set = get_algorithm(config.algorithm).needs_open_set
    if needs_open_set or config.private_size:
        # DS-FL's open/private split (sec. 4.1). Other algorithms given a private_size train on the same private set,
        # so that FL and DS-FL runs with one seed are compared on identical client data.
        config = _fit_open_set(config, len(pool))
        open_part, private_part = open_private_split(len(pool), config.open_size, config.private_size, rng)
        open_indices, pool = pool[open_part], pool[private_part]
        if not needs_open_set:
            open_indices = None
    labels = train.y[pool]
    local = partition(
        labels,
        config.num_clients,
        scheme=config.partition,
        rng=rng,
        shards_per_client=config.shards_per_client,
        alpha=config.dirichlet_alpha,
        min_size=config.min_client_size,
    )
    parts = {c: np.sort(pool[idx]) for c, idx in zip(client_ids(config.num_clients), local, strict=True)}
    eval_indices = np.arange(len(test))
    if config.eval_samples and config.eval_samples < len(test):
        eval_indices = np.sort(
            np.random.default_rng(derive_seed(config.seed, "eval")).choice(
                len(test), config.eval_samples, replace=False
            )
        )
    return Experiment(config, model, train, test, parts, open_indices, eval_indices)


def _fit_open_set(config: RunConfig, num_train: int) -> RunConfig:
    """Resolve DS-FL's open/private sizes for this dataset; shrink defaults that do not fit, and say so."""
    open_size = config.open_size
    if open_size == 0 or open_size > num_train // 2:
        open_size = num_train // 2
        log.warning(
            "open set of %d samples does not fit %d training samples: using %d", config.open_size, num_train, open_size
        )
    private = config.private_size or num_train - open_size
    if open_size + private > num_train:
        raise ConfigError(f"open_size + private_size = {open_size + private} exceeds the {num_train} training samples")
    algo = config.algo
    if isinstance(algo, DSFLSettings) and algo.open_per_round > open_size:
        log.warning("open_per_round %d exceeds the open set: using %d", algo.open_per_round, open_size)
        algo = dataclasses.replace(algo, open_per_round=open_size)
    return dataclasses.replace(config, open_size=open_size, private_size=private, algo=algo)
