"""The catalog of objectives and local terms: read from the algorithms' declarations, nothing filled on import."""

import subprocess
import sys
from dataclasses import dataclass

import pytest

from fedge.algorithms import catalog
from fedge.algorithms.catalog import make_objective, make_term, objective_classes, parse_term, term_classes
from fedge.algorithms.fedprox import Proximal
from fedge.errors import ConfigError
from fedge.learning.objectives import Objective
from fedge.learning.terms import term_flag
from fedge.registry import ALGORITHMS


def test_every_declared_class_is_found_by_its_kind_and_nothing_else() -> None:
    declared = {cls for spec in ALGORITHMS.values() for cls in (*spec.objectives, *spec.terms)}
    found = {*objective_classes().values(), *term_classes().values()}
    assert found == declared
    assert all(kind == cls.kind for kind, cls in {**objective_classes(), **term_classes()}.items())
    assert {"ce", "ntd"} <= set(objective_classes()) and {"prox", "correction"} <= set(term_classes())


def test_kinds_parse_with_their_hyperparameters_and_refuse_what_is_unknown() -> None:
    assert make_objective("ntd", {"tau": "2.0"}).tau == 2.0  # type: ignore[attr-defined]
    prox = make_term("prox", {"mu": "0.25"})
    assert prox == Proximal(mu=0.25) and parse_term(term_flag(prox)) == prox
    with pytest.raises(ConfigError, match="unknown objective 'nope'; choose one of ce, "):
        make_objective("nope")
    with pytest.raises(ConfigError, match="unknown local term 'nope'"):
        make_term("nope")
    with pytest.raises(ConfigError, match="local term 'prox'"):
        make_term("prox", {"mu": "many"})
    with pytest.raises(ConfigError, match="KIND:name=value"):
        parse_term("prox:mu")


def test_two_classes_of_one_kind_are_refused() -> None:
    @dataclass(frozen=True)
    class Other(Objective):
        kind = "ce"

        def loss(self, logits, y, inputs):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    with pytest.raises(ConfigError, match="objective kind 'ce' is declared by two classes"):
        catalog._by_kind("objective", [*objective_classes().values(), Other])


def test_the_learning_package_imports_no_algorithm() -> None:
    code = (
        "import sys, fedge.learning.objectives, fedge.learning.terms, fedge.learning.training; "
        "print(sorted(m for m in sys.modules if m.startswith(('fedge.algorithms', 'fedge.registry'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
