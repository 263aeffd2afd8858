"""Every algorithm's whole registry entry, and every local objective and local term by its kind, as the algorithms
declare them.

:mod:`fedge.registry` names the algorithms and gives the layers below them (config, cost tables) a few plain facts
of each (:class:`fedge.registry.AlgorithmFacts`); what needs the whole :class:`~fedge.algorithms.base.Algorithm` (its
server and client halves, hooks, traffic model, objectives and terms) reads it here, above the algorithms, typed.
An algorithm module defines the losses it trains with and names them in its ``ALGORITHM``
(:attr:`fedge.algorithms.base.Algorithm.objectives` and ``terms``); nothing fills a table on import, and
:mod:`fedge.learning` names no algorithm: what a program file, an export command or a task spells by kind is looked
up here, at the layer that knows the algorithms.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from fedge import registry
from fedge.algorithms.base import Algorithm
from fedge.errors import ConfigError
from fedge.learning.objectives import Objective, objective_from_params
from fedge.learning.terms import LocalTerm, term_from_params

__all__ = [
    "ALGORITHMS",
    "get_algorithm",
    "make_objective",
    "make_term",
    "objective_classes",
    "objective_kinds",
    "parse_term",
    "term_classes",
    "term_kinds",
    "terms_from_flags",
]


class _Entries(Mapping[str, Algorithm[Any]]):
    """Name -> the whole registry entry, in the registry's order; an entry that is not an
    :class:`~fedge.algorithms.base.Algorithm` is a ConfigError naming its module."""

    def __getitem__(self, name: str) -> Algorithm[Any]:
        spec = registry.ALGORITHMS[name]  # KeyError for an unknown name, as a dict
        if not isinstance(spec, Algorithm):
            raise ConfigError(
                f"{registry.MODULES[name]}.ALGORITHM is a {type(spec).__name__}, not a fedge.algorithms.base.Algorithm"
            )
        return spec

    def __iter__(self) -> Iterator[str]:
        return iter(registry.ALGORITHMS)

    def __len__(self) -> int:
        return len(registry.ALGORITHMS)

    def __contains__(self, name: object) -> bool:
        return name in registry.ALGORITHMS


ALGORITHMS: Mapping[str, Algorithm[Any]] = _Entries()
"""Every algorithm's whole entry by its config name, in the order of :data:`fedge.registry.MODULES`."""


def get_algorithm(name: str) -> Algorithm[Any]:
    """The whole registry entry ``name``; a ConfigError listing the known ones otherwise."""
    registry.get_algorithm(name)  # the ConfigError for an unknown name
    return ALGORITHMS[name]


def objective_classes() -> Mapping[str, type[Objective]]:
    """Kind -> objective class, from every algorithm's declaration; ConfigError when two classes claim one kind."""
    return _by_kind("objective", [cls for spec in ALGORITHMS.values() for cls in spec.objectives])


def term_classes() -> Mapping[str, type[LocalTerm]]:
    """Kind -> local term class, from every algorithm's declaration; ConfigError when two classes claim one kind."""
    return _by_kind("local term", [cls for spec in ALGORITHMS.values() for cls in spec.terms])


_Class = TypeVar("_Class", type[Objective], type[LocalTerm])


def _by_kind(what: str, classes: Sequence[_Class]) -> dict[str, _Class]:
    out: dict[str, _Class] = {}
    for cls in classes:
        if out.get(cls.kind, cls) is not cls:
            raise ConfigError(f"{what} kind {cls.kind!r} is declared by two classes, {out[cls.kind]} and {cls}")
        out[cls.kind] = cls
    return dict(sorted(out.items()))


def objective_kinds() -> tuple[str, ...]:
    """The declared objective kinds, sorted."""
    return tuple(objective_classes())


def term_kinds() -> tuple[str, ...]:
    """The declared local term kinds, sorted."""
    return tuple(term_classes())


def make_objective(kind: str, params: Mapping[str, str] | None = None) -> Objective:
    """The objective ``kind`` with hyperparameters parsed from strings (defaults for absent ones)."""
    classes = objective_classes()
    if kind not in classes:
        raise ConfigError(f"unknown objective {kind!r}; choose one of {', '.join(classes)}")
    return objective_from_params(classes[kind], params or {})


def make_term(kind: str, params: Mapping[str, str] | None = None) -> LocalTerm:
    """The local term ``kind`` with hyperparameters parsed from strings (defaults for absent ones)."""
    classes = term_classes()
    if kind not in classes:
        raise ConfigError(f"unknown local term {kind!r}; choose one of {', '.join(classes)}")
    return term_from_params(classes[kind], params or {})


def parse_term(text: str) -> LocalTerm:
    """A term from its command-line spelling ``KIND`` or ``KIND:name=value,...`` (e.g. ``prox:mu=0.1``), the
    spelling :func:`fedge.learning.terms.term_flag` writes."""
    kind, _, rest = text.partition(":")
    params: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        name, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"a local term is KIND or KIND:name=value,..., got {text!r}")
        params[name.strip()] = value.strip()
    return make_term(kind.strip(), params)


def terms_from_flags(texts: Sequence[str], prox_mu: float = 0.0) -> tuple[LocalTerm, ...]:
    """The terms of an export command: each ``--term`` spelling (:func:`parse_term`), and ``--prox-mu`` > 0 as
    FedProx's term ``prox:mu=...`` (a shorthand kept for the FedProx programs' commands)."""
    terms = [parse_term(t) for t in texts]
    if prox_mu > 0:
        terms.append(make_term("prox", {"mu": repr(float(prox_mu))}))
    return tuple(terms)
