"""The catalog of whole registry entries, objectives and local terms: read from the algorithms' declarations,
nothing filled on import."""

import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from fedge import registry
from fedge.algorithms import catalog
from fedge.algorithms.base import Algorithm
from fedge.algorithms.catalog import ALGORITHMS, make_objective, make_term, objective_classes, parse_term, term_classes
from fedge.algorithms.fedprox import Proximal
from fedge.errors import ConfigError
from fedge.learning.objectives import Objective
from fedge.learning.terms import term_flag


def test_the_catalog_gives_every_registered_algorithm_whole_and_the_registry_its_facts() -> None:
    assert list(ALGORITHMS) == list(registry.MODULES) == list(registry.ALGORITHMS)
    for name, spec in ALGORITHMS.items():
        assert isinstance(spec, Algorithm) and spec.name == name
        assert registry.get_algorithm(name) is spec and isinstance(spec, registry.AlgorithmFacts)
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'; choose one of fedavg, "):
        catalog.get_algorithm("nope")


def test_an_entry_short_of_the_facts_or_not_an_algorithm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = types.SimpleNamespace(
        name="plain", label="Plain", settings=object, exchange="weights", secagg_gap="", dp_refusal=""
    )
    for module, entry in (("fake_bare", object()), ("fake_facts", facts)):
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(ALGORITHM=entry))
    monkeypatch.setattr(registry.ALGORITHMS, "_loaded", {})  # the fakes leave no loaded entry behind
    monkeypatch.setitem(registry.MODULES, "bare", "fake_bare")
    monkeypatch.setitem(registry.MODULES, "plain", "fake_facts")
    with pytest.raises(ConfigError, match=r"fake_bare\.ALGORITHM lacks what the registry reads"):
        registry.get_algorithm("bare")
    assert registry.get_algorithm("plain") is facts  # enough for config and cost tables
    with pytest.raises(ConfigError, match=r"fake_facts\.ALGORITHM is a SimpleNamespace, not a fedge\.algorithms\.base"):
        catalog.get_algorithm("plain")


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
