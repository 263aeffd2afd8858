"""A program's embedded description (fedge.programs.spec.ProgramMeta) read back; damaged ones refused in one line."""

from __future__ import annotations

import json

import pytest

from fedge.algorithms.catalog import make_objective, make_term
from fedge.errors import ExportError
from fedge.programs.spec import FORMAT_VERSION, ModelSpec, ProgramMeta, TrainingLoss


def test_a_description_survives_its_round_trip_and_a_damaged_one_is_an_export_error() -> None:
    loss = TrainingLoss(make_objective("ce", {}), (make_term("prox", {"mu": "0.1"}),))
    meta = ProgramMeta("pte-train", ModelSpec("tiny_mlp", (1, 8, 8), 10), loss=loss, max_batch=16)
    assert ProgramMeta.from_json(meta.to_json()) == meta
    raw = json.loads(meta.to_json())
    damaged = [
        "[]",  # a list where the description is an object
        json.dumps({**raw, "loss": 5}),
        json.dumps({**raw, "loss": {**raw["loss"], "terms": ["prox"]}}),
        json.dumps({**raw, "input_shape": "1,8,8x"}),
        json.dumps({k: v for k, v in raw.items() if k != "format"}),
    ]
    for text in damaged:
        with pytest.raises(ExportError, match="does not carry a valid fedge description"):
            ProgramMeta.from_json(text, source="p.pte")
    with pytest.raises(ExportError, match=f"this fedge reads {FORMAT_VERSION}"):
        ProgramMeta.from_json(json.dumps({**raw, "fedge_format_version": FORMAT_VERSION - 1}))


def test_hyperparameters_that_differ_anywhere_name_different_programs() -> None:
    # A file name is how a device finds its program: ``:g`` alone printed mu 0.1000001 as 0.1, so such a task found
    # the 0.1 program and was refused only at its first step.
    ntd = make_objective("ntd")
    assert ntd.tag == "ntd-tau1-beta1"  # the short form stays where it is exact (programs exported before keep names)
    near = [make_term("prox", {"mu": v}) for v in ("0.1", "0.1000001")]
    tags = {TrainingLoss(ntd, (t,)).tag for t in near}
    assert tags == {"ntd-tau1-beta1-prox-mu0.1", "ntd-tau1-beta1-prox-mu0.1000001"}
