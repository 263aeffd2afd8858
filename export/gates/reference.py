"""The eager references a training program is measured against: the float64 model and its steps (optionally with
each layer's result rounded once, :mod:`export.gates.jitter`, or with some ties decided the other way,
:mod:`export.ties`), and eager float32 under each layout and thread count fedge trains with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from export import ties
from export.gates.jitter import add_jitter
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.terms import TermCall
from fedge.learning.training import TrainRequest
from fedge.learning.training import train as fedge_train
from fedge.programs.spec import ModelSpec
from fedge.types import StateDict


def reference_model(spec: ModelSpec, weights: Mapping[str, torch.Tensor] | None) -> nn.Module:
    """The eager model of ``spec`` holding ``weights`` (or the seed-0 initialization)."""
    model = spec.build(seed=0)
    if weights is not None:
        load_exchanged_state(model, weights)
    return model


def as_float64(request: TrainRequest) -> TrainRequest:
    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.is_floating_point() else t

    return dataclasses.replace(
        request,
        x=widen(request.x),
        inputs={k: widen(v) for k, v in request.inputs.items()},
        terms=tuple(
            TermCall(
                c.term,
                {n: {k: widen(v) for k, v in per.items()} for n, per in c.tensors.items()},
                {n: {k: widen(v) for k, v in per.items()} for n, per in c.references.items()},
            )
            for c in request.terms
        ),
    )


def float64_run(
    spec: ModelSpec,
    begin: Mapping[str, torch.Tensor],
    request: TrainRequest,
    *,
    jitter: torch.Generator | None = None,
    push: float | str | None = None,
    flips: Sequence[ties.Tie] = (),
) -> nn.Module:
    """The eager float64 model after ``request`` from ``begin``, on one intra-op thread (see
    :func:`export.gates.drift.drift_parity`).

    With ``jitter``, every layer's output on the way forward, every gradient on the way back through a layer and every
    parameter's gradient moves by up to eps32 of itself plus eps32 of its tensor's mean magnitude (uniform, drawn from
    ``jitter``): a float32 computation that rounds each layer's result once and is exact within it (see
    :func:`export.gates.stepwise.stepwise_parity`). A linear or convolution output also moves by eps32 of the sum of its
    terms' magnitudes (``|W| |x| + |b|``), where float32 rounds a sum that cancels: ``push`` +1 or -1 moves every such
    output that far up or down (so a pre-activation float32 cannot tell from zero lands on either side in one of the
    runs), None by a uniform draw within it, ``"ties"`` only the outputs within that distance of zero, each up or down
    at random (:data:`export.gates.stepwise.TIE_RUNS`). The tie runs also move every batch-norm output by its own
    rounding (:func:`export.gates.jitter._normalized_terms`), up or down at random: behind a batch norm the ties are
    between normalized outputs. A linear or convolution bias's gradient, one sum over n samples and positions, moves by
    up to sqrt(n) eps32 of its terms' magnitudes (pushed as the sums are, else a uniform draw): a long sum's rounding
    (:func:`export.gates.jitter.add_jitter`). With ``flips``, each of those decisions is made the other way
    (:func:`export.ties.add_flips`).
    """
    model = float64_model(spec, begin)
    handles = add_jitter(model, jitter, push) if jitter is not None else []
    handles += ties.add_flips(model, flips)
    try:
        with torch_threads(1):
            fedge_train(model, as_float64(request))
    finally:
        for h in handles:
            h.remove()
    return model


def float64_model(spec: ModelSpec, begin: Mapping[str, torch.Tensor]) -> nn.Module:
    model = reference_model(spec, {k: v.float() for k, v in begin.items()}).double()
    load_exchanged_state(model, {k: v.double() for k, v in begin.items()})
    return model


def float32_runs(
    spec: ModelSpec,
    start: Mapping[str, torch.Tensor],
    request: TrainRequest,
    *,
    layouts: Sequence[torch.memory_format] | None = None,
) -> list[StateDict]:
    """Eager float32 weights after ``request`` under each layout and thread count fedge trains with.

    fedge's PyTorch client trains convolutional models channels-last on the CPU (fedge.learning.backend) and the
    simulator's workers run on one thread or the process's; each is a correct float32 computation of the same steps.
    """
    if layouts is None:
        layouts = [torch.contiguous_format, *([torch.channels_last] if len(spec.input_shape) == 3 else [])]
    threads = sorted({1, max(1, torch.get_num_threads())})
    runs = []
    for layout in layouts:
        for n in threads:
            model = reference_model(spec, start).to(memory_format=layout)  # type: ignore[call-overload]
            r = (
                request
                if layout == torch.contiguous_format
                else dataclasses.replace(request, x=request.x.contiguous(memory_format=torch.channels_last))
            )
            with torch_threads(n):
                fedge_train(model, r)
            runs.append(exchanged_state(model))
    return runs


class torch_threads:
    """Run a block on ``n`` intra-op threads, restoring the process's count after."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)
