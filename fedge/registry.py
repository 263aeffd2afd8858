"""The algorithm registry: every algorithm's name, the module that defines it, and the facts the core reads by name.

Adding an algorithm is one new module under ``fedge/algorithms/`` that defines ``ALGORITHM``
(:class:`fedge.algorithms.base.Algorithm`) and one line in :data:`MODULES`. The run configuration
(:mod:`fedge.config`) and the cost tables (:mod:`fedge.accounting`) sit below the algorithms, so they read an entry
through :class:`AlgorithmFacts`, the few plain facts they need (its settings class, what it exchanges, what secure
aggregation and DP-FedAvg cannot run), and never see a strategy or a client half: nothing here names a type of
:mod:`fedge.algorithms`, and the circle config -> registry -> algorithms -> config is not there even in the types.
Whatever needs the whole entry (its server and client halves, hooks, traffic model) asks
:mod:`fedge.algorithms.catalog`, above the algorithms. An entry's module is imported on first use (as entry points
are), so ``fedge --help`` lists the names without importing torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module
from typing import Literal, Protocol, runtime_checkable

from fedge.errors import ConfigError

MODULES: dict[str, str] = {
    "fedavg": "fedge.algorithms.fedavg",
    "fedntd": "fedge.algorithms.fedntd",
    "fedlsd": "fedge.algorithms.fedlsd",
    "fedcad": "fedge.algorithms.fedcad",
    "fedprox": "fedge.algorithms.fedprox",
    "scaffold": "fedge.algorithms.scaffold",
    "fedadam": "fedge.algorithms.fedadam",
    "fednova": "fedge.algorithms.fednova",
    "feddyn": "fedge.algorithms.feddyn",
    "fedcurv": "fedge.algorithms.fedcurv",
    "moon": "fedge.algorithms.moon",
    "feddecorr": "fedge.algorithms.feddecorr",
    "fd": "fedge.algorithms.fd",
    "dsfl": "fedge.algorithms.dsfl",
}
"""Every algorithm's config name -> the module defining its ``ALGORITHM``, in the order the CLI and reports list
them."""


@dataclass(frozen=True)
class AlgorithmSettings:
    """Base of every algorithm's settings (a frozen dataclass in its module). Fields marked
    :func:`fedge.wire.fields.server_only` never leave the coordinator; the others travel in each task, converted by
    :mod:`fedge.wire.fields`. An instance of this base itself stands for "the defaults of the run's algorithm"."""


@runtime_checkable
class AlgorithmFacts(Protocol):
    """What the layers below the algorithms read of a registry entry (:class:`fedge.algorithms.base.Algorithm` has
    them all; an entry without one is refused when its module loads)."""

    @property
    def name(self) -> str:
        """The config/CLI value, e.g. ``"fedntd"``."""

    @property
    def label(self) -> str:
        """The display name, e.g. ``"FedNTD"``."""

    @property
    def settings(self) -> type[AlgorithmSettings]:
        """Its settings class (the run's ``algo`` section)."""

    @property
    def exchange(self) -> Literal["weights", "outputs"]:
        """What its clients upload: model weights, or outputs on shared inputs."""

    @property
    def secagg_gap(self) -> str:
        """Why secure aggregation cannot run it; "" when it can."""

    @property
    def dp_refusal(self) -> str:
        """Why DP-FedAvg cannot run it; "" when it can."""


class _Registry(Mapping[str, AlgorithmFacts]):
    """Name -> the entry's facts; names need no import, an entry imports its module once."""

    def __init__(self) -> None:
        self._loaded: dict[str, AlgorithmFacts] = {}

    def __getitem__(self, name: str) -> AlgorithmFacts:
        if name not in self._loaded:
            spec = import_module(MODULES[name]).ALGORITHM  # KeyError for an unknown name, as a dict
            if not isinstance(spec, AlgorithmFacts):
                raise ConfigError(f"{MODULES[name]}.ALGORITHM lacks what the registry reads of an algorithm")
            if spec.name != name:
                raise ConfigError(f"{MODULES[name]} defines algorithm {spec.name!r}, registered as {name!r}")
            self._loaded[name] = spec
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(MODULES)

    def __len__(self) -> int:
        return len(MODULES)

    def __contains__(self, name: object) -> bool:
        return name in MODULES


ALGORITHMS: Mapping[str, AlgorithmFacts] = _Registry()
"""Every algorithm's facts by its config name, in the order of :data:`MODULES`."""


def get_algorithm(name: str) -> AlgorithmFacts:
    """The facts of the registry entry ``name``; a ConfigError listing the known ones otherwise."""
    if name not in MODULES:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(MODULES)}")
    return ALGORITHMS[name]
