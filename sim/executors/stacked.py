"""Local training of many clients at once as one stacked model (torch.func), for the ``batched`` executor.

K training requests of the same model run together: every parameter gets a leading client axis, and each step is
one ``vmap(grad(functional_call))`` over the clients instead of K small models, so a round on a GPU is a few large
kernels. It computes what :func:`fedge.learning.training.train` computes for each request on its own:

- each client follows its own :func:`fedge.learning.training.batch_order` (its own seed, sample count and epochs);
- each client has its own momentum buffers and step count; SGD is written out with the ops ``torch.optim.SGD``
  uses (weight decay, then ``buf = m * buf + g``, then ``w - lr * buf``; a zero buffer's first update is ``g``
  exactly, as torch's ``clone``);
- unequal sizes are masked: a step vmaps only over the clients that have a batch of that size at that step (a
  client's trailing batch of an epoch, or a client whose steps are over), and the others' weights and momentum are
  not touched at all;
- the local terms (:func:`fedge.learning.terms.batch_loss`, the expression every runtime computes) are vmapped with
  the loss, their round tensors stacked per client (FedProx's anchor, SCAFFOLD's correction, FedCurv's weights).

Results equal the sequential executor's up to float summation order (the stacked kernels add in another order):
``tests/test_batched_executor.py`` measures it. What cannot be done exactly is refused with :class:`BatchedRefusal`
(:func:`model_refusal`, :func:`request_refusal`), never dropped: losses other than :data:`OBJECTIVES`, models with
buffers (batch norm) or dropout, augmentation, terms with reference models (MOON), the Fisher information (FedCurv),
and epoch observers.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedge.errors import ConfigError
from fedge.learning.terms import batch_loss, needs_representation
from fedge.learning.training import Split, TrainRequest, TrainStats, batch_order
from fedge.types import StateDict

INSTEAD = "use --executor sequential or processes"


class BatchedRefusal(ConfigError):
    """The batched executor cannot run this training exactly (one line, naming the executors that can)."""


def model_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be trained stacked, or None."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        return f"the batched executor cannot train a model with buffers (batch norm: {buffers[0]}); {INSTEAD}"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return f"the batched executor cannot train a model with dropout (its random masks); {INSTEAD}"
    return None


OBJECTIVES = ("ce", "ntd")
"""The local losses tested stacked against fedge.learning.training.train (FedAvg, FedProx, SCAFFOLD, FedDyn: ce;
FedNTD: ntd). Local terms run stacked unless they compare with reference models."""


def request_refusal(request: TrainRequest) -> str | None:
    """Why ``request`` cannot be trained stacked exactly, or None."""
    r = request
    if r.objective.kind not in OBJECTIVES:
        return (
            f"the batched executor trains the losses {', '.join(OBJECTIVES)} only, not {r.objective.kind!r}; {INSTEAD}"
        )
    unsupported = {
        "augmentation": r.augment.active or bool(r.step_inputs),
        "reference models (MOON)": any(c.term.references for c in r.terms),
        "the Fisher information (FedCurv)": r.fisher_samples > 0,
        "an epoch observer": r.on_epoch is not None,
    }
    names = [name for name, on in unsupported.items() if on]
    if names:
        return f"the batched executor cannot train with {', '.join(names)}; {INSTEAD}"
    return None


def group_key(request: TrainRequest) -> tuple[object, ...]:
    """Requests with equal keys train in one stack: the same loss, optimizer, batch size and input shapes."""
    r = request
    shapes = tuple(
        (k, tuple(v.shape[1:]) if _per_sample(r, k) else tuple(v.shape)) for k, v in sorted(r.inputs.items())
    )
    terms = tuple(c.term for c in r.terms)
    return (r.objective, terms, r.sgd, r.batch_size, tuple(r.x.shape[1:]), shapes)


def _per_sample(r: TrainRequest, name: str) -> bool:
    return next(spec.per_sample for spec in r.objective.inputs if spec.name == name)


def train_stacked(
    model: nn.Module,
    weights: Sequence[StateDict],
    requests: Sequence[TrainRequest],
    device: torch.device,
    resident: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[tuple[StateDict, TrainStats]]:
    """Train ``weights[k]`` on ``requests[k]`` for every k at once; each client's weights after training (on the
    CPU) and its stats. All requests must share :func:`group_key`. ``model`` gives the architecture only;
    ``resident`` gives a client's samples and labels on ``device`` (a cache that keeps them there across rounds)."""
    on_device = resident or (lambda t: t.to(device))
    why = model_refusal(model)
    for r in requests:
        why = why or request_refusal(r)
    if why:
        raise BatchedRefusal(why)
    if len({group_key(r) for r in requests}) > 1:
        raise ValueError("train_stacked takes requests of one group_key")
    first = requests[0]
    names = [n for n, _ in model.named_parameters()]
    params = {n: torch.stack([w[n].to(device, torch.float32) for w in weights]) for n in names}
    momentum = {n: torch.zeros_like(p) for n, p in params.items()} if first.sgd.momentum else {}
    # Each term's round tensors, stacked over the clients: term index -> tensor name -> parameter -> (K, *shape).
    term_tensors = [
        {t: _stack([r.terms[i].tensors[t] for r in requests], names, device) for t in call.term.tensors}
        for i, call in enumerate(first.terms)
    ]

    # The clients' data, resident on the device in one tensor; offsets turn a client's indices into rows of it.
    offsets = [0, *itertools.accumulate(len(r.x) for r in requests)]
    x_all = torch.cat([on_device(r.x) for r in requests])
    y_all = torch.cat([on_device(r.y) for r in requests])
    per_sample = {s.name: s.per_sample for s in first.objective.inputs}
    rows = {k: torch.cat([r.inputs[k].to(device) for r in requests]) for k in per_sample if per_sample[k]}
    whole = {k: torch.stack([r.inputs[k].to(device) for r in requests]) for k in per_sample if not per_sample[k]}

    orders = [batch_order(len(r.x), r.epochs, r.batch_size, r.seed) for r in requests]
    steps = max((len(o) for o in orders), default=0)
    losses: list[list[torch.Tensor]] = [[] for _ in requests]
    objective, sgd = first.objective, first.sgd
    terms = [c.term for c in first.terms]
    split = Split(model) if needs_representation(terms) else None

    def loss_of(
        p: dict[str, torch.Tensor],
        xb: torch.Tensor,
        yb: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        tensors: list[dict[str, dict[str, torch.Tensor]]],
    ) -> torch.Tensor:
        if split is None:
            logits = functional_call(model, p, (xb,))
            return batch_loss(objective, terms, logits, yb, inputs, params=p, tensors=tensors)
        z, logits = functional_call(split, {f"model.{n}": v for n, v in p.items()}, (xb,))
        return batch_loss(objective, terms, logits, yb, inputs, params=p, tensors=tensors, z=z)

    step_fn = vmap(grad_and_value(loss_of))
    with warnings.catch_warnings():
        # torch has no batching rule for kl_div (FedNTD's loss) and loops over the clients for that one op, correctly;
        # its "performance drop" warning would be printed once per run and says nothing the user can act on.
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        for clients, idx, sel in _schedule(orders, offsets, steps, device):
            p = params if sel is None else {n: v[sel] for n, v in params.items()}
            inputs = {k: v[idx] for k, v in rows.items()}
            inputs |= {k: v if sel is None else v[sel] for k, v in whole.items()}
            tensors = [
                {t: {n: v if sel is None else v[sel] for n, v in per.items()} for t, per in by_name.items()}
                for by_name in term_tensors
            ]
            grads, loss = step_fn(p, x_all[idx], y_all[idx], inputs, tensors)
            new_p, new_m = _sgd(p, grads, momentum, sel, sgd.lr, sgd.momentum, sgd.weight_decay)
            for n in names:
                if sel is None:
                    params[n] = new_p[n]
                    if momentum:
                        momentum[n] = new_m[n]
                else:  # only the clients of this group move; masked clients keep their weights and momentum
                    params[n] = params[n].index_copy(0, sel, new_p[n])
                    if momentum:
                        momentum[n] = momentum[n].index_copy(0, sel, new_m[n])
            for j, k in enumerate(clients):
                losses[k].append(loss[j])

    out = []
    for k in range(len(requests)):
        values = [float(v) for v in torch.stack(losses[k]).cpu()] if losses[k] else []
        stats = TrainStats(
            steps=len(orders[k]),
            samples=sum(len(i) for i in orders[k]),
            mean_loss=sum(values) / len(values)
            if values
            else 0.0,  # summed in step order, as fedge.learning.training.train
        )
        out.append(({n: params[n][k].detach().cpu() for n in names}, stats))
    return out


def _schedule(
    orders: Sequence[Sequence[torch.Tensor]], offsets: Sequence[int], steps: int, device: torch.device
) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Every stacked step of the training, in order: (its clients, their batches as rows of the stacked data (G,
    size), the clients' positions or None for all of them). One vmap per step and batch size, so that every batch
    loss is its own mean. All indices reach the device in one copy: a copy from pageable host memory waits for the
    GPU's queued kernels, and one per step would keep the host from running ahead of them."""
    everyone = list(range(len(orders)))
    plan: list[tuple[list[int], torch.Tensor, list[int] | None]] = []
    for t in range(steps):
        by_size: dict[int, list[int]] = {}
        for k, order in enumerate(orders):
            if t < len(order):
                by_size.setdefault(len(order[t]), []).append(k)
        for _, clients in sorted(by_size.items()):
            idx = torch.stack([orders[k][t] + offsets[k] for k in clients])
            plan.append((clients, idx, None if clients == everyone else clients))
    if not plan:
        return []
    # One tensor: every step's batch rows, then the positions of every step that moves only some clients.
    parts = [idx.flatten() for _, idx, _ in plan] + [torch.tensor(sel) for _, _, sel in plan if sel is not None]
    pieces = iter(torch.cat(parts).to(device).split([len(part) for part in parts]))
    rows = [next(pieces).view(idx.shape) for _, idx, _ in plan]
    return [
        (clients, r, None if sel is None else next(pieces)) for (clients, _, sel), r in zip(plan, rows, strict=True)
    ]


def _sgd(
    p: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    sel: torch.Tensor | None,
    lr: float,
    m: float,
    wd: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One ``torch.optim.SGD`` step (dampening 0, no Nesterov) of the selected clients, with the ops it uses."""
    new_p, new_m = {}, {}
    with torch.no_grad():
        for n, w in p.items():
            g = grads[n]
            if wd:
                g = g.add(w, alpha=wd)
            if m:
                buf = momentum[n] if sel is None else momentum[n][sel]
                g = new_m[n] = buf.mul(m).add(g)
            new_p[n] = w.add(g, alpha=-lr)
    return new_p, new_m


def _stack(states: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str], device: torch.device) -> StateDict:
    return {n: torch.stack([s[n].to(device, torch.float32) for s in states]) for n in names}
