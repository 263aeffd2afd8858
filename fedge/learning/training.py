"""Local optimization shared by every runtime: the training request, the batch order and the eager SGD loop.

One contract for local training: a frozen :class:`TrainRequest` (data, objective, optimizer settings, epochs, batch
size, shuffle seed, the objective's inputs, and the local terms the algorithm adds, :mod:`fedge.learning.terms`),
answered with :class:`TrainStats`. A request may carry an ``on_epoch`` observer, called with an :class:`EpochProgress`
after each epoch (an edge client logs it, and raises from it to abandon a task whose deadline passed); it never changes
results. Every runtime (PyTorch here; ExecuTorch and ONNX Runtime in ``edge_client``) implements it and follows the
same batch order, :func:`batch_order`, so the same task gives the same weights whichever runtime runs it.

The batch loss is :func:`fedge.learning.terms.batch_loss`: the objective plus each term of the request, the one
expression every runtime computes (the exporters trace it into their programs). A request may also ask for the
diagonal empirical Fisher information of the trained weights (``fisher_samples`` > 0, :func:`fisher_diagonal`): a
statistic of the answer, not a term, that every runtime computes from its own gradients of the objective's loss.

Every runtime takes a batch's inputs from :meth:`TrainRequest.batch_x`, which applies the request's augmentation
(:mod:`fedge.data.augment`) on the host, so an exported program trains on exactly the images eager PyTorch does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedge.data.augment import Augmentation, augment_batch, black_level
from fedge.errors import ConfigError
from fedge.learning.models import load_exchanged_state
from fedge.learning.objectives import Objective
from fedge.learning.pool_first import pool_before_relu
from fedge.learning.terms import TermCall, batch_loss, needs_representation
from fedge.types import StateDict


@dataclass(frozen=True)
class SGDSettings:
    """Momentum SGD as in FedNTD B.3; momentum buffers start at zero for every task."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")


class MomentumSGD:
    """``torch.optim.SGD``'s update (dampening 0, no Nesterov, minimizing), written out with the tensor operations torch
    uses, in the same order, so that the weights are bitwise those of ``torch.optim.SGD``: on the CPU its per-tensor
    path, on CUDA its ``foreach`` path (torch's default on each). ``tests/fedge/learning/test_training.py`` checks both.

    Why not ``torch.optim.SGD`` itself: the first one a process builds imports ``torch._dynamo`` and sympy (its
    ``add_param_group`` is wrapped in ``torch._disable_dynamo``, with no switch), which on this project's CPU machine
    costs as much as importing torch: 2.65 s and 72 MB of resident memory (torch 2.13). Every edge client and every
    simulator worker builds one; on a Jetson the memory counts twice. Momentum buffers live as long as the object:
    :func:`train` makes one per task, so they start at zero for every task.
    """

    def __init__(self, params: list[nn.Parameter], sgd: SGDSettings) -> None:
        self.params = params
        self.sgd = sgd
        self.buffers: list[torch.Tensor | None] = [None] * len(params)
        self.foreach = bool(params) and all(p.device.type == "cuda" for p in params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient; the others are left alone, as torch does."""
        lr, momentum, wd = self.sgd.lr, self.sgd.momentum, self.sgd.weight_decay
        live = [(i, g) for i, p in enumerate(self.params) if (g := p.grad) is not None]
        if not self.foreach:
            for i, g in live:
                p = self.params[i]
                if wd:
                    g = g.add(p, alpha=wd)
                p.add_(self._buffer(i, g) if momentum else g, alpha=-lr)
            return
        params: list[torch.Tensor] = [self.params[i] for i, _ in live]
        grads = [g for _, g in live]
        if wd:
            grads = list(torch._foreach_add(grads, params, alpha=wd))
        if momentum:
            bufs = [self.buffers[i] for i, _ in live]
            ready = [b for b in bufs if b is not None]
            if len(ready) == len(bufs):
                torch._foreach_mul_(ready, momentum)
                torch._foreach_add_(ready, grads, alpha=1)
                grads = ready
            else:  # torch's foreach path, too, goes one tensor at a time while a buffer is missing
                grads = [self._buffer(i, g) for (i, _), g in zip(live, grads, strict=True)]
        torch._foreach_add_(params, grads, alpha=-lr)

    def _buffer(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s momentum buffer after this step's ``grad``: a copy of it on the first step, else
        ``buf * momentum + grad`` in place (torch's ``1 - dampening`` is 1)."""
        buf = self.buffers[i]
        if buf is None:
            buf = self.buffers[i] = grad.detach().clone()
        else:
            buf.mul_(self.sgd.momentum).add_(grad, alpha=1)
        return buf


@dataclass(frozen=True)
class TrainRequest:
    """What one local training call must do; every runtime's ``train`` takes exactly this."""

    x: torch.Tensor  # (N, *input_shape)
    y: torch.Tensor  # (N,) int64 labels
    objective: Objective
    sgd: SGDSettings
    epochs: int
    batch_size: int
    seed: int  # shuffle seed of :func:`batch_order`
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)  # the objective's inputs by name
    terms: tuple[TermCall, ...] = ()  # what the algorithm adds to the objective, with this round's tensors
    fisher_samples: int = 0  # > 0: answer with the diagonal Fisher of the trained weights from this many samples
    augment: Augmentation = field(
        default_factory=Augmentation
    )  # random crop/flip/Cutout of each batch (fedge.data.augment)
    # Per-sample inputs computed on each augmented batch, one tensor per step of batch_order (a teacher's logits on the
    # images the student sees); they replace that input's rows of ``inputs`` (see with_batch_logits).
    step_inputs: Mapping[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # Called after each epoch; what it raises ends the training (the weights are then partly trained).
    on_epoch: Callable[[EpochProgress], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ConfigError(f"x has {len(self.x)} samples but y has {len(self.y)}")
        if self.epochs < 0 or self.batch_size < 1:
            raise ConfigError(f"need epochs >= 0 and batch_size >= 1, got {self.epochs} and {self.batch_size}")
        kinds = [c.term.kind for c in self.terms]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"a request takes each local term once, got {kinds}")
        if self.fisher_samples < 0:
            raise ConfigError(f"fisher_samples must be >= 0, got {self.fisher_samples}")
        names = {i.name for i in self.objective.inputs}
        if set(self.inputs) != names:
            raise ConfigError(
                f"objective {self.objective.kind!r} takes inputs {sorted(names)}, got {sorted(self.inputs)}"
            )
        for spec in self.objective.inputs:
            if spec.per_sample and len(self.inputs[spec.name]) != len(self.x):
                raise ConfigError(
                    f"input {spec.name!r} has {len(self.inputs[spec.name])} rows for {len(self.x)} samples"
                )

    def batch_x(self, idx: torch.Tensor, step: int) -> torch.Tensor:
        """The inputs of the samples ``idx``, the ``step``-th batch of :func:`batch_order`, augmented when the request
        says so: the same batch whichever runtime asks (one generator per batch, seeded from the shuffle seed)."""
        xb = self.x[idx]
        if not self.augment.active:
            return xb
        seed = int(np.random.SeedSequence([self.seed, step]).generate_state(1)[0])
        return augment_batch(xb, self.augment, self._fill, torch.Generator().manual_seed(seed))

    @functools.cached_property
    def _fill(self) -> torch.Tensor:
        return black_level(self.x)

    def batch_inputs(self, idx: torch.Tensor, step: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The objective's inputs for the samples ``idx`` (the ``step``-th batch): per-sample rows, per-round constants
        whole, and the ``step``-th tensor of an input computed per augmented batch."""
        out = {}
        for spec in self.objective.inputs:
            if spec.name in self.step_inputs:
                t = self.step_inputs[spec.name][step]
            else:
                t = self.inputs[spec.name][idx] if spec.per_sample else self.inputs[spec.name]
            out[spec.name] = t.to(device)
        return out

    def with_batch_logits(self, name: str, logits: Callable[[torch.Tensor], torch.Tensor]) -> TrainRequest:
        """This request with input ``name`` computed by ``logits`` on every augmented batch, as FedNTD's authors give
        the teacher the same augmented images as the student (their ``ClientTrainer._get_dg_logits(data)``); the
        request itself when nothing is augmented (the per-sample rows of ``inputs`` are then the same values)."""
        if not self.augment.active:
            return self
        order = batch_order(len(self.x), self.epochs, self.batch_size, self.seed)
        per_step = tuple(logits(self.batch_x(idx, step)) for step, idx in enumerate(order))
        return dataclasses.replace(self, step_inputs={**self.step_inputs, name: per_step})


@dataclass(frozen=True)
class EpochProgress:
    """One finished epoch of a training call, for its ``on_epoch`` observer."""

    epoch: int  # 1-based
    epochs: int
    steps: int  # mini-batch steps of this epoch
    mean_loss: float  # mean batch loss of this epoch


class EpochMeter:
    """Counts the steps of :func:`batch_order` and calls a request's ``on_epoch`` at every epoch's end.

    Every epoch of :func:`batch_order` has the same number of batches (the trailing-batch rule depends only on the
    sample count and the batch size), so an epoch ends every ``len(order) // epochs`` steps.
    """

    def __init__(self, request: TrainRequest, total_steps: int) -> None:
        self._hook = request.on_epoch
        self._epochs = request.epochs
        self._per_epoch = total_steps // request.epochs if request.epochs else 0
        self._steps = 0
        self._loss = 0.0

    def step(self, loss: float) -> None:
        """Record one step's loss; at an epoch's end, report it."""
        self._steps += 1
        self._loss += loss
        if self._hook is None or self._steps % self._per_epoch:
            return
        epoch = self._steps // self._per_epoch
        self._hook(EpochProgress(epoch, self._epochs, self._per_epoch, self._loss / self._per_epoch))
        self._loss = 0.0


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did."""

    steps: int
    samples: int
    mean_loss: float
    fisher: StateDict | None = None  # the diagonal Fisher of the trained weights, when the request asked for it


REPRESENTATION = "representation"
HOOKS = (REPRESENTATION,)
"""What an algorithm may need of a model and a runtime beyond a loss of the logits: ``representation``, the
``representation(x)`` / ``head(z)`` split of the model that a term reading representations uses (MOON, FedDecorr).
Every training runtime runs it (``edge_client.backends.RUNTIME_HOOKS``); a plugin model must have the split."""


def required_hooks(request: TrainRequest) -> frozenset[str]:
    """The hooks of :data:`HOOKS` that ``request`` uses."""
    return frozenset({REPRESENTATION}) if needs_representation([c.term for c in request.terms]) else frozenset()


def check_hooks(request: TrainRequest, supported: frozenset[str], runtime: str) -> None:
    """ConfigError naming the hooks ``request`` uses that ``runtime`` (which runs ``supported``) cannot run."""
    missing = required_hooks(request) - supported
    if missing:
        raise ConfigError(f"the {runtime} runtime cannot run the training hook(s) {', '.join(sorted(missing))}")


def batch_order(num_samples: int, epochs: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Mini-batch indices for ``epochs`` shuffled passes; every backend uses this exact order.

    A trailing batch of one sample is dropped: batch norm cannot normalize a single sample in training mode.
    """
    gen = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    for _ in range(epochs):
        perm = torch.randperm(num_samples, generator=gen)
        for start in range(0, num_samples, batch_size):
            idx = perm[start : start + batch_size]
            if len(idx) > 1 or num_samples == 1:
                batches.append(idx)
    return batches


def representation_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's representation of ``x`` (its penultimate layer, ``model.representation``) and the logits from it
    (``model.head``); ConfigError for a model without that split (every model of :mod:`fedge.learning.models` has
    it)."""
    represent, head = getattr(model, "representation", None), getattr(model, "head", None)
    if not (callable(represent) and callable(head)):
        raise ConfigError(f"model {type(model).__name__} has no representation(x)/head(z) split to compare with")
    z = represent(x)
    return z, head(z)


class Split(nn.Module):
    """``forward(x) -> (z, logits)``: ``model`` as ``head(representation(x))``, for terms that read representations in a
    functional call (the batched executor, the exported programs); it holds the model as ``self.model``, so the call
    names the model's weights ``model.<name>``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return representation_and_logits(self.model, x)


def _frozen(model: nn.Module, weights: StateDict) -> nn.Module:
    """A copy of ``model`` with ``weights``, in eval mode and without gradients: a reference the loss compares with."""
    frozen = copy.deepcopy(model)
    load_exchanged_state(frozen, weights)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def _loss(
    model: nn.Module,
    r: TrainRequest,
    xb: torch.Tensor,
    yb: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    tensors: list[dict[str, dict[str, torch.Tensor]]],
    references: list[dict[str, nn.Module]],
) -> torch.Tensor:
    """One batch's loss (:func:`fedge.learning.terms.batch_loss`), through the representation when a term reads it."""
    terms = [c.term for c in r.terms]
    if not needs_representation(terms):
        return batch_loss(r.objective, terms, model(xb), yb, inputs, params=params, tensors=tensors)
    z, logits = representation_and_logits(model, xb)
    with torch.no_grad():
        reference_z = [{name: representation_and_logits(m, xb)[0] for name, m in refs.items()} for refs in references]
    return batch_loss(
        r.objective, terms, logits, yb, inputs, params=params, tensors=tensors, z=z, reference_z=reference_z
    )


Gradients = Callable[[torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]]
"""The gradients of the batch-mean cross-entropy of a batch ``(x, y)`` at a runtime's current weights, in training
mode, by trainable parameter name, leaving the weights and batch-norm statistics as they were."""


def fisher_diagonal(gradients: Gradients, request: TrainRequest) -> StateDict:
    """The diagonal empirical Fisher information of the trainable parameters on the request's data: the mean over
    mini-batches of the squared gradient of the batch-mean cross-entropy, as the FedNTD authors' FedCurv computes it
    (``upload_local_fisher``): one shuffled pass in the request's batch size, stopping after the first batch that
    takes the count past ``request.fisher_samples``. ``gradients`` is the runtime's (every runtime runs this pass)."""
    r = request
    seed = int(np.random.SeedSequence([r.seed, 0x46495348]).generate_state(1)[0] & 0x7FFFFFFF)  # "FISH"
    fisher_request = dataclasses.replace(r, seed=seed, epochs=1, step_inputs={})
    squares: dict[str, torch.Tensor] = {}
    batches, seen = 0, 0
    for step, idx in enumerate(batch_order(len(r.x), 1, r.batch_size, seed)):
        grads = gradients(fisher_request.batch_x(idx, step), r.y[idx])
        for k, g in grads.items():
            if k in squares:
                squares[k] += g.detach().pow(2)
            else:
                squares[k] = torch.zeros_like(g) + g.detach().pow(2)
        batches, seen = batches + 1, seen + len(idx)
        if seen > r.fisher_samples:
            break
    return {k: (s / max(batches, 1)).cpu() for k, s in squares.items()}


def eager_gradients(model: nn.Module) -> Gradients:
    """:data:`Gradients` of an eager model (on its device); its batch-norm statistics are restored after each batch."""
    device = next(model.parameters()).device
    params = dict(model.named_parameters())

    def gradients(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        return dict(zip(params, grads, strict=True))

    return gradients


def train(model: nn.Module, request: TrainRequest) -> TrainStats:
    """Run the request's epochs of mini-batch SGD on ``model`` in place (eager PyTorch, CPU or CUDA)."""
    r = request
    device = next(model.parameters()).device
    model.train()
    opt = MomentumSGD(list(model.parameters()), r.sgd)
    params = dict(model.named_parameters())
    tensors = [c.on(device) for c in r.terms]
    references = [{name: _frozen(model, w) for name, w in c.references.items()} for c in r.terms]
    total, steps, samples = 0.0, 0, 0
    order = batch_order(len(r.x), r.epochs, r.batch_size, r.seed)
    meter = EpochMeter(r, len(order))
    compute = pool_before_relu(model)  # the same weights bit for bit, less work (fedge.learning.pool_first)
    for step, idx in enumerate(order):
        xb, yb = r.batch_x(idx, step).to(device), r.y[idx].to(device)
        loss = _loss(compute, r, xb, yb, r.batch_inputs(idx, step, device), params, tensors, references)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = float(loss.detach())
        total += value
        meter.step(value)
        steps += 1
        samples += len(idx)
    fisher = fisher_diagonal(eager_gradients(model), r) if r.fisher_samples > 0 else None
    return TrainStats(steps=steps, samples=samples, mean_loss=total / steps if steps else 0.0, fisher=fisher)


# Inference batch sizes. On the CPU, batches of 128 keep a convolution's activations small (fedavg_cnn: 13 MB at 128
# against 100 MB at 1,000): channels-last fedavg_cnn evaluated the 10,000 MNIST test images in 1.4 s against 2.3 s
# at 1,000 (two threads, this project's 2-core machine; 64-256 measured alike). On a GPU large batches fill the device.
CPU_PREDICT_BATCH = 128
DEVICE_PREDICT_BATCH = 1000


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, *, batch_size: int | None = None) -> torch.Tensor:
    """Logits of ``model`` in eval mode, computed in batches, returned on the CPU.

    A convolutional model on the CPU runs channels-last (NHWC), on a copy when its weights are in the default layout:
    oneDNN's NHWC convolutions and max-pools evaluate the 10,000 MNIST test images 2-3x faster
    (``benchmarks/executors.py`` prints the figures). Logits move at round-off level (~3e-7) against the default
    layout. ``model`` is left in eval mode, its weights and layout untouched.
    """
    device = next(model.parameters()).device
    if batch_size is None:
        batch_size = CPU_PREDICT_BATCH if device.type == "cpu" else DEVICE_PREDICT_BATCH
    model.eval()
    model, layout = _inference_layout(model, device) if x.dim() == 4 else (model, torch.contiguous_format)
    model = pool_before_relu(model)  # the same logits bit for bit, less work (fedge.learning.pool_first)
    outs = [
        model(x[i : i + batch_size].to(device).contiguous(memory_format=layout)).float().cpu()
        for i in range(0, len(x), batch_size)
    ]
    return torch.cat(outs) if outs else torch.empty(0)


def _inference_layout(model: nn.Module, device: torch.device) -> tuple[nn.Module, torch.memory_format]:
    """The model to run images through and their layout: channels-last for a convolutional model on the CPU."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    if device.type != "cpu" or not weights:
        return model, torch.contiguous_format
    if all(w.is_contiguous(memory_format=torch.channels_last) for w in weights):
        return model, torch.channels_last
    return copy.deepcopy(model).to(memory_format=torch.channels_last), torch.channels_last  # type: ignore[call-overload]
