"""Runs inside ``.venv-ort-training`` for ``test_ort_training.py``: train with ONNX Runtime training, write the results.

``python ort_training_worker.py CASES.json OUT_DIR``. For each case: make the artifacts (through the parity-gated
cache when ``gate`` is set, else directly), run free-running SGD steps (momentum 0.9, weight decay 1e-5) on the
real-looking samples of three data seeds from the seed-0 weights, and write ``OUT_DIR/<id>-<seed>.safetensors`` (the
request's tensors, the start and final weights, eval logits of the final weights) and one JSON line per case. The
test recomputes eager PyTorch from those tensors in its own environment, so the reference does not come from this
one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from edge_client.backends.ort_training import OrtTrainer
from export.gates.drift import RETRY_SEEDS
from export.gates.inputs import drift_request_for_seed
from export.ort_training import cache as cache_module
from export.ort_training.artifacts import generate
from export.ort_training.cache import ArtifactCache
from export.ort_training.check import check_artifacts
from export.ort_training.graph import StatBatchNorm
from fedge.algorithms.catalog import make_objective, terms_from_flags
from fedge.learning.models import exchanged_state
from fedge.programs.spec import ModelSpec, TrainingLoss

SEEDS = (7, *RETRY_SEEDS)  # export.gates.inputs.drift_request's samples, then the parity gate's retries


@contextlib.contextmanager
def gate_reports() -> Iterator[list[str]]:
    """The parity reports the artifact cache logs (one INFO record each) while the block runs."""
    reports: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == "%s":  # a report; the cache's other INFO line says it is making artifacts
                reports.append(record.getMessage())

    logger = logging.getLogger(cache_module.__name__)
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield reports
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_case(case: dict, out: Path) -> dict:
    spec = ModelSpec(case["model"], tuple(case["input_shape"]), 10)
    terms = terms_from_flags(case.get("terms", ()))
    loss = TrainingLoss(make_objective(case["objective"], case.get("params", {})), terms)
    gate: list[str] = []
    if case.get("gate"):
        with gate_reports() as gate:  # the cache's own check, not a second one (it took 20 s on fedavg_cnn)
            directory = ArtifactCache(out / "cache")(spec, loss)  # raises ExportError if the gate refuses
    else:
        directory = generate(spec, loss, out / case["id"])
    start = exchanged_state(spec.build(seed=0))
    trainer = OrtTrainer(directory, threads=1)
    runs = []
    for data_seed in SEEDS:
        request = drift_request_for_seed(spec, loss, batch_size=case["batch"], seed=data_seed, steps=case["steps"])
        tensors: dict[str, torch.Tensor] = {}
        for call in request.terms:  # the terms' round tensors and reference weights, for the eager reference
            for name, per in call.tensors.items():
                tensors.update({f"term.{call.term.kind}.{name}.{k}": v for k, v in per.items()})
            for name, per in call.references.items():
                tensors.update({f"reference.{call.term.kind}.{name}.{k}": v for k, v in per.items()})
        trainer.set_weights(start)
        stats = trainer.train(request)
        got = trainer.get_weights()
        x_eval = spec.example(7, seed=11)
        tensors.update({f"start.{k}": v for k, v in start.items()})
        tensors.update({f"got.{k}": v for k, v in got.items()})
        tensors.update({f"input.{k}": v for k, v in request.inputs.items()})
        tensors.update({"x": request.x, "y": request.y, "x_eval": x_eval, "logits": trainer.logits(x_eval)})
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{case['id']}-{data_seed}.safetensors"))
        runs.append({"data_seed": data_seed, "steps": stats.steps, "batch_seed": request.seed})
    return {"id": case["id"], "runs": runs, "gate": gate}


def perturbed_gate(case: dict, out: Path) -> dict:
    """The parity gate on artifacts made with a batch-norm momentum of 0.12 instead of 0.1 (everything else right)."""
    spec = ModelSpec(case["model"], tuple(case["input_shape"]), 10)
    loss = TrainingLoss(make_objective(case["objective"]))
    original = StatBatchNorm.__init__

    def wrong_momentum(self: StatBatchNorm, bn: torch.nn.modules.batchnorm._BatchNorm) -> None:
        original(self, bn)
        self.momentum = 0.12

    StatBatchNorm.__init__ = wrong_momentum  # type: ignore[method-assign]
    try:
        directory = generate(spec, loss, out / case["id"])
    finally:
        StatBatchNorm.__init__ = original  # type: ignore[method-assign]
    reports = check_artifacts(directory)
    return {"id": case["id"], "gate": [str(r) for r in reports], "passed": [r.passed for r in reports]}


def main() -> None:
    torch.set_num_threads(1)
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for case in cases:
        print(json.dumps(perturbed_gate(case, out) if case.get("perturbed") else run_case(case, out)), flush=True)


if __name__ == "__main__":
    main()
