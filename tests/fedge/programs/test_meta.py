"""A program's embedded description (fedge.programs.spec.ProgramMeta) read back; damaged ones refused in one line."""

from __future__ import annotations

import json

import pytest

from fedge.errors import ExportError
from fedge.learning.objectives import make_objective
from fedge.learning.terms import make_term
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
