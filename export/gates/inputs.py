"""The deterministic training requests the training gates run: random objective inputs and round tensors for a
quick check, and real-looking samples with a run's SGD settings for the stepwise (:mod:`export.gates.stepwise`) and
drift (:mod:`export.gates.drift`) gates.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fedge.learning.models import exchanged_state
from fedge.learning.terms import TermCall
from fedge.learning.training import SGDSettings, TrainRequest
from fedge.programs.spec import ModelSpec, TrainingLoss

# training_request: the objective inputs and the local terms' tensors of a deterministic training check.
TRAIN_SAMPLES = 30
TRAIN_BATCH = 8
TRAIN_SGD = SGDSettings(lr=0.02, momentum=0.9, weight_decay=5e-4)

# The two training gates (stepwise and free-running drift) run DRIFT_STEPS steps at the batch size the program runs at
# (at most DRIFT_BATCH), on real-looking images, with a run's SGD settings.
DRIFT_STEPS = 8
DRIFT_BATCH = 50  # the local batch size of every algorithm's defaults
DRIFT_SGD = SGDSettings(lr=0.01, momentum=0.9, weight_decay=1e-5)


def training_request(
    spec: ModelSpec, loss: TrainingLoss, *, samples: int = TRAIN_SAMPLES, seed: int = 0
) -> TrainRequest:
    """A deterministic request for a training check: inputs, labels, the objective's inputs and the terms' round
    tensors (:meth:`fedge.learning.terms.LocalTerm.example_tensor` of another model's parameters) and reference models
    (models of other seeds)."""
    gen = torch.Generator().manual_seed(seed)
    c = spec.num_classes
    inputs: dict[str, torch.Tensor] = {}
    for i in loss.objective.inputs:
        shape = i.concrete_shape(c, samples)
        if i.dtype == torch.bool:
            inputs[i.name] = torch.arange(samples) % 3 != 0  # some rows without a target
        elif not i.per_sample:
            inputs[i.name] = torch.rand(shape, generator=gen)
        elif i.name == "teacher":
            inputs[i.name] = 2.0 * torch.randn(shape, generator=gen)  # logits of a confident teacher
        else:
            inputs[i.name] = torch.softmax(2.0 * torch.randn(shape, generator=gen), dim=-1)  # soft targets
    calls = []
    term_gen = torch.Generator().manual_seed(seed + 5)
    for n, term in enumerate(loss.terms):
        params = dict(spec.build(seed=seed + 2).named_parameters())
        tensors = {t: {k: term.example_tensor(t, p, term_gen) for k, p in params.items()} for t in term.tensors}
        references = {r: exchanged_state(spec.build(seed=seed + 3 + n * 7 + j)) for j, r in enumerate(term.references)}
        calls.append(TermCall(term, tensors, references))
    return TrainRequest(
        spec.example(samples, seed=seed + 1),
        torch.randint(0, c, (samples,), generator=gen),
        loss.objective,
        TRAIN_SGD,
        epochs=1,
        batch_size=TRAIN_BATCH,
        seed=0,
        inputs=inputs,
        terms=tuple(calls),
    )


def parity_sample(spec: ModelSpec, samples: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-looking inputs and labels for ``spec``: handwritten digits for image models, the spec's example else.

    Images are scikit-learn's bundled 8x8 digits (no download), resized to the model's input size, copied to every
    channel and standardized with MNIST's mean and std: mostly background with strokes, like the data the models
    train on. Random normal inputs (what logit checks use) hide kernels that lose precision on such skewed batches.
    """
    if len(spec.input_shape) != 3 or spec.input_dtype != torch.float32:
        gen = torch.Generator().manual_seed(seed)
        return spec.example(samples, seed=seed), torch.randint(0, spec.num_classes, (samples,), generator=gen)
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(seed))[:samples]
    images = torch.as_tensor(digits.images, dtype=torch.float32)[order, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
    channels, height, width = spec.input_shape
    images = nn.functional.interpolate(images, size=(height, width), mode="bilinear", align_corners=False)
    x = ((images - 0.1307) / 0.3081).expand(-1, channels, -1, -1).contiguous()
    y = torch.as_tensor(digits.target, dtype=torch.int64)[order] % spec.num_classes
    return x, y


def drift_request(spec: ModelSpec, loss: TrainingLoss, *, batch_size: int, steps: int = DRIFT_STEPS) -> TrainRequest:
    """``steps`` free-running steps of ``batch_size`` real-looking samples with a run's SGD settings."""
    r = training_request(spec, loss, samples=batch_size * steps, seed=7)
    x, y = parity_sample(spec, batch_size * steps, seed=7)
    return dataclasses.replace(r, x=x, y=y, sgd=DRIFT_SGD, batch_size=batch_size)


def drift_request_for_seed(
    spec: ModelSpec, loss: TrainingLoss, *, batch_size: int, seed: int, steps: int | None = None
) -> TrainRequest:
    """:func:`drift_request` (its SGD settings, steps and batch) on the real-looking samples and objective inputs of
    ``seed`` (7 gives ``drift_request``'s own)."""
    base = drift_request(spec, loss, batch_size=batch_size, steps=steps or DRIFT_STEPS)
    other = training_request(spec, loss, samples=len(base.x), seed=seed)
    x, y = parity_sample(spec, len(base.x), seed=seed)
    return dataclasses.replace(base, x=x, y=y, inputs=other.inputs, terms=other.terms)


def one_batch(request: TrainRequest, idx: torch.Tensor, step: int) -> TrainRequest:
    """The request for the one step on the samples ``idx`` (in that order), the ``step``-th (from 0) of ``request``.
    Parity requests are not augmented: the step's inputs are the samples' rows."""
    assert not request.augment.active and not request.step_inputs, "parity steps are compared unaugmented"
    return dataclasses.replace(
        request,
        x=request.x[idx],
        y=request.y[idx],
        inputs={**request.inputs, **request.batch_inputs(idx, step)},
        epochs=1,
        batch_size=len(idx),
        seed=0,
    )
