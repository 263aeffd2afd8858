"""The algorithm registry: every algorithm's name and the module that defines it, imported on first use.

Adding an algorithm is one new module under ``fedge/algorithms/`` that defines ``ALGORITHM``
(:class:`fedge.algorithms.base.Algorithm`) and one line in :data:`MODULES`. Config, CLI, reports, cost tables and the
roles look algorithms up here; the registry itself imports none of them until one is asked for (as entry points do),
so everything below the algorithms can name them without an import circle, and ``fedge --help`` lists them without
importing torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import TYPE_CHECKING

from fedge.errors import ConfigError

if TYPE_CHECKING:
    from fedge.algorithms.base import Algorithm

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


class _Registry(Mapping[str, "Algorithm"]):
    """Name -> :class:`~fedge.algorithms.base.Algorithm`; names need no import, an entry imports its module once."""

    def __init__(self) -> None:
        self._loaded: dict[str, Algorithm] = {}

    def __getitem__(self, name: str) -> Algorithm:
        if name not in self._loaded:
            spec: Algorithm = import_module(MODULES[name]).ALGORITHM  # KeyError for an unknown name, as a dict
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


ALGORITHMS: Mapping[str, Algorithm] = _Registry()
"""Every algorithm by its config name, in the order of :data:`MODULES`."""


def get_algorithm(name: str) -> Algorithm:
    """The registry entry for ``name``; a ConfigError listing the known ones otherwise."""
    if name not in MODULES:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(MODULES)}")
    return ALGORITHMS[name]
