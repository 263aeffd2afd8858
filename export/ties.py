"""Ties: the discrete decisions of a training step that float32 cannot tell apart, found and flipped on purpose.

A ReLU passes its gradient where its input is above zero; a max-pool window routes its gradient to its largest input.
Where a ReLU's input is within float32's rounding of zero, or a window's two largest inputs are within rounding of
each other, a correct float32 program may decide the other way than float64. The forward pass is the same either way
(the values are tied), but the backward pass routes one element's gradient differently, and the step's update moves
by that element's contribution: one row of a linear layer, one output channel of a convolution, or (a tie in the
classifier) one sample's whole gradient through every layer below it.

The stepwise gate (:func:`export.gates.stepwise.stepwise_parity`) uses this to tell a tie from an imprecise kernel by
the error's shape rather than its size: :func:`find_ties` lists the decisions of a float64 step nearest their tie,
:func:`add_flips` runs the same step with chosen decisions flipped (a float64 step in which float32's other choice is
made exactly), and :func:`attribute` picks the flips whose contributions explain the program's difference from
float64. What a set of flips cannot explain (an op that loses precision inside, a wrong gradient) remains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

EPS32 = torch.finfo(torch.float32).eps
Handle = torch.utils.hooks.RemovableHandle

REACH = 64.0
"""A decision is a candidate tie when its margin (a ReLU's input, a window's gap between its two largest inputs) is
within this many float32 roundings of the values that formed it (:func:`find_ties`). A float32 forward pass
accumulates about one rounding per layer; a flip attributed beyond its reach is no tie, so a generous reach admits no
wrong program: the flip must still explain the difference (:func:`attribute`)."""


PROBES = 6
"""Random directions that estimate each flip's size (:func:`find_ties`)."""


@dataclass(frozen=True)
class Tie:
    """One near-tied decision of a float64 step.

    ``module`` is the qualified name of the ``nn.ReLU`` or ``nn.MaxPool2d``; ``output`` the flat index of its output
    element; for a max-pool, ``taken`` and ``other`` the flat input indices of the window's largest input (which
    float64 routes the gradient to) and its runner-up. ``closeness`` is the margin in float32 roundings (0: tied).
    """

    module: str
    output: int
    closeness: float
    taken: int = -1
    other: int = -1

    def __str__(self) -> str:
        what = "ReLU" if self.taken < 0 else "max-pool window"
        return f"{what} {self.module}[{self.output}] at {self.closeness:.2g} roundings"


def terms_magnitude(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``|W| |x| + |b|`` of a linear or 2-D convolution layer: the scale of its sums' float32 rounding."""
    bias = getattr(module, "bias", None)
    b = None if bias is None else bias.abs()
    if isinstance(module, nn.Linear):
        return nn.functional.linear(x.abs(), module.weight.abs(), b)
    if isinstance(module, nn.Conv2d) and isinstance(module.padding, tuple):
        return nn.functional.conv2d(
            x.abs(), module.weight.abs(), b, module.stride, module.padding, module.dilation, module.groups
        )
    return None


def batch_norm_rounding(
    module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, x_rounding: torch.Tensor
) -> torch.Tensor:
    """The rounding scale of a batch norm's output: ``|gamma| (r + |x| + |mean|) / std + |beta|``, where ``r`` is
    the rounding ``x`` carries from the sum that made it (a convolution's output before a batch norm cancels)."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    if module.training or module.running_mean is None or module.running_var is None:
        mean, var = x.mean(dims, keepdim=True), x.var(dims, unbiased=False, keepdim=True)
    else:
        mean, var = module.running_mean.view(shape), module.running_var.view(shape)
    scale = torch.rsqrt(var + module.eps)
    if module.weight is not None:
        scale = scale * module.weight.abs().view(shape)
    beta = module.bias.abs().view(shape) if module.bias is not None else 0.0
    return scale * (x_rounding + x.abs() + mean.abs()) + beta


def _windows(pool: nn.MaxPool2d, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per output element of a max-pool without padding or dilation: the flat input indices of each window's
    elements, ``(outputs, window)``, and the windows' values; None for other pools."""
    k, s = pool.kernel_size, pool.stride
    if pool.padding not in (0, (0, 0)) or pool.dilation not in (1, (1, 1)) or pool.ceil_mode or x.dim() != 4:
        return None
    kh, kw = (k, k) if isinstance(k, int) else k
    sh, sw = (s, s) if isinstance(s, int) else s
    n, c, h, w = x.shape
    flat = torch.arange(n * c * h * w).view(n * c, 1, h, w).double()
    index = nn.functional.unfold(flat, (kh, kw), stride=(sh, sw)).long()  # (n*c, kh*kw, L)
    values = nn.functional.unfold(x.detach().reshape(n * c, 1, h, w), (kh, kw), stride=(sh, sw))
    return index.transpose(1, 2).reshape(-1, kh * kw), values.transpose(1, 2).reshape(-1, kh * kw)


def _margin(distance: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``distance`` in float32 roundings of ``scale``; infinite where the scale is 0 (exact in any precision)."""
    return torch.where(scale > 0, distance / (EPS32 * scale).clamp(min=torch.finfo(scale.dtype).tiny), torch.inf)


@dataclass
class _Decisions:
    """One layer's decisions in a step, per output element (flat): how near its tie each is (:func:`_margin`), what
    decides it (a ReLU's input, a max-pool's input with each window's largest and runner-up), and the output's
    gradient, filled in on the way back."""

    margin: torch.Tensor
    value: torch.Tensor
    taken: torch.Tensor | None = None
    other: torch.Tensor | None = None
    grad: torch.Tensor | None = None


def _record(model: nn.Module, decisions: dict[str, _Decisions], inputs_seen: list[torch.Tensor]) -> list[Handle]:
    """Hooks that fill ``decisions`` on ``model``'s next forward and backward pass, and ``inputs_seen`` with what the
    model is called on.

    Rounding scales are carried along the forward pass: a linear or convolution output's is its terms' magnitude, a
    batch norm's adds its input's rounding to what it normalizes, a ReLU's and a max-pool's pass through. A tensor of
    unknown origin (a flatten in ``forward``) is its own scale.
    """
    rounding: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(output) -> (output, scale); keeps ids alive

    def scale_of(t: torch.Tensor) -> torch.Tensor:
        kept = rounding.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else t.abs()

    def hook(name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        @torch.no_grad()
        def on_output(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
            x_in = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            if x_in is None or not isinstance(output, torch.Tensor) or name in decisions:
                return
            scale: torch.Tensor | None = None
            if isinstance(module, nn.ReLU):
                decisions[name] = _Decisions(_margin(x_in.abs(), scale_of(x_in)).flatten(), x_in.flatten().clone())
                # A zero output is exact whichever way float32 decided: no max-pool tie among zeros (an empty
                # background's windows) routes a gradient anywhere the ReLU lets through.
                scale = torch.where(x_in > 0, scale_of(x_in), 0.0)
            elif isinstance(module, nn.MaxPool2d) and (windows := _windows(module, x_in)) is not None:
                index, values = windows
                scales = scale_of(x_in).flatten()[index]
                top = values.topk(2, dim=1)
                taken = index.gather(1, top.indices[:, :1]).flatten()
                other = index.gather(1, top.indices[:, 1:]).flatten()
                gap = top.values[:, 0] - top.values[:, 1]
                bound = torch.maximum(scales.gather(1, top.indices[:, :1]), scales.gather(1, top.indices[:, 1:]))
                # Two bit-equal inputs came from equal sums (a constant background's patches): any program computes
                # them equal too, and routing between them moves nothing.
                margin = torch.where(gap > 0, _margin(gap, bound.flatten()), torch.inf)
                decisions[name] = _Decisions(margin, x_in.flatten().clone(), taken, other)
                scale = scale_of(x_in).flatten()[taken].view_as(output)
            elif isinstance(module, nn.modules.batchnorm._BatchNorm) and x_in.dim() >= 2:
                scale = batch_norm_rounding(module, x_in, scale_of(x_in))
            else:
                scale = terms_magnitude(module, x_in)
                if scale is None and output.shape == x_in.shape:
                    scale = scale_of(x_in)  # an elementwise layer (dropout in eval, identity)
            if scale is not None and scale.shape == output.shape:
                rounding[id(output)] = (output, scale)
            if name in decisions and output.requires_grad:
                output.register_hook(lambda g: setattr(decisions[name], "grad", g.detach().flatten()))

        return on_output

    def on_call(module: nn.Module, args: tuple[object, ...]) -> None:
        if not inputs_seen and args and isinstance(args[0], torch.Tensor):
            inputs_seen.append(args[0].detach())

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if not list(m.children())]
    return [model.register_forward_pre_hook(on_call), *handles]


def find_ties(
    model: nn.Module,
    step: Callable[[nn.Module], object],
    difference: Mapping[str, torch.Tensor],
    *,
    lr: float,
    limit: int,
) -> list[Tie]:
    """The decisions of ``step(model)`` (one SGD step at learning rate ``lr`` from a fresh optimizer, in place)
    within :data:`REACH` roundings of their tie whose flips would explain most of ``difference`` (the program's
    update less this step's), most first, at most ``limit``. ``model`` is left at its weights before the step.

    This is estimated for every near tie at once, without running a step per tie: flipping one element's decision
    changes the parameters' gradient by ``J^T u`` (``J`` the Jacobian of the layer's input with respect to the
    parameters, ``u`` the gradient it reroutes) and the update by ``-lr J^T u``. Its inner product with ``difference``
    is ``u`` against ``J difference``, how the layer's input moves when the parameters move along ``difference``: one
    forward pass (a float64 finite difference; the pass is continuous at a tie). Its size comes from the same product
    with random directions. Near ties whose flips would change little (windows of nearly equal inputs in an image's
    background, many hundreds) or much more than the difference (a ReLU deep in the network that the program decided
    as float64 did) rank last or not at all.
    """
    params = dict(model.named_parameters())
    direction = {k: difference[k].double() for k in params if k in difference}
    size = max((float(d.abs().max()) for d in direction.values() if d.numel()), default=0.0)
    if size == 0.0:
        return []
    before = {k: p.detach().clone() for k, p in params.items()}
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}

    def reset(to: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(to[k])
            for k, b in model.named_buffers():
                b.copy_(buffers[k])

    decisions: dict[str, _Decisions] = {}
    seen: list[torch.Tensor] = []
    handles = _record(model, decisions, seen)
    try:
        step(model)
    finally:
        for h in handles:
            h.remove()
        reset(before)
    if not seen:
        return []
    # Move the parameters by ~1e-7 of their size along a direction: float64 resolves the change to ~1e-9.
    largest = max(1.0, max(float(b.abs().max()) for b in before.values()))

    def tangents(along: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """How each decision's input moves when the parameters move along ``along`` (forward, finite difference)."""
        eps = 1e-7 * largest / max(float(v.abs().max()) for v in along.values())
        moved: dict[str, _Decisions] = {}
        handles = _record(model, moved, [])
        try:
            reset({k: v + eps * along[k] if k in along else v for k, v in before.items()})
            model.train()
            with torch.no_grad():
                model(seen[0])
        finally:
            for h in handles:
                h.remove()
            reset(before)
        return {k: (moved[k].value - d.value) / eps for k, d in decisions.items() if k in moved}

    def rerouted(d: _Decisions, tangent: torch.Tensor) -> torch.Tensor:
        """Per output element, the flip's rerouted gradient ``u`` against the tangent: ``u . J along``."""
        assert d.grad is not None
        if d.taken is None or d.other is None:
            way = torch.where(d.value > 0, -1.0, 1.0)  # a flip blocks a passed gradient, passes a blocked one
            return way * d.grad * tangent
        return d.grad * (tangent[d.other] - tangent[d.taken])

    # A flip changes the update by C = -lr J^T u: towards the difference by -lr u.(J difference); its size
    # |C|^2 = lr^2 |J^T u|^2 = lr^2 E[(u . J r)^2] over random r ~ N(0, I), estimated from PROBES directions.
    # What flipping it alone would remove from the difference's sum of squares: 2 <difference, C> - |C|^2.
    toward = tangents(direction)
    gen = torch.Generator().manual_seed(0)
    probes = [
        tangents({k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in direction.items()})
        for _ in range(PROBES)
    ]
    scored: list[tuple[float, Tie]] = []
    for name, d in decisions.items():
        if d.grad is None or name not in toward or d.grad.shape != d.margin.shape:
            continue
        along = -lr * rerouted(d, toward[name])
        size2 = lr**2 * torch.stack([rerouted(d, p[name]) ** 2 for p in probes]).mean(0)
        gain = 2.0 * along - size2
        near = ((d.margin <= REACH) & (gain > 0)).nonzero().flatten()
        best = near[gain[near].argsort(descending=True)[:limit]]
        for i in best.tolist():
            taken = -1 if d.taken is None else int(d.taken[i])
            other = -1 if d.other is None else int(d.other[i])
            scored.append((float(gain[i]), Tie(name, i, float(d.margin[i]), taken, other)))
    scored.sort(key=lambda st: -st[0])
    return [t for _, t in scored[:limit]]


def add_flips(model: nn.Module, flips: Sequence[Tie]) -> list[Handle]:
    """Hooks that make ``model``'s steps decide each of ``flips`` the other way, exactly: the forward values are
    unchanged, the backward pass routes the element's gradient as float32 would have.

    A ReLU that passed its gradient (input above zero) stops passing it, one that blocked it passes it; a max-pool
    window routes its gradient to its runner-up instead of its largest input. Each is a term ``c (v - v.detach())``
    added to the output element: zero forward, gradient ``c`` times the output's onto ``v``.
    """
    by_module: dict[str, list[Tie]] = {}
    for t in flips:
        by_module.setdefault(t.module, []).append(t)

    def hook(ties: list[Tie]) -> Callable[[nn.Module, tuple[object, ...], torch.Tensor], torch.Tensor]:
        def on_output(module: nn.Module, inputs: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            assert isinstance(x, torch.Tensor)
            flat_x = x.reshape(-1)
            terms = []
            for t in ties:
                if t.taken < 0:
                    v = flat_x[t.output]
                    way = -1.0 if bool(v.detach() > 0) else 1.0  # float64 passed it: block it; else pass it
                    terms.append(way * (v - v.detach()))
                else:
                    routed = flat_x[t.other] - flat_x[t.taken]
                    terms.append(routed - routed.detach())
            index = torch.tensor([t.output for t in ties])
            return output.reshape(-1).index_add(0, index, torch.stack(terms)).view_as(output)

        return on_output

    modules = dict(model.named_modules())
    return [modules[name].register_forward_hook(hook(ties)) for name, ties in by_module.items()]


def attribute(
    difference: Mapping[str, torch.Tensor],
    contributions: Sequence[Mapping[str, torch.Tensor]],
    slack: Mapping[str, torch.Tensor],
    *,
    most: int,
) -> list[int]:
    """Indices of the contributions (each a flip's change of the step's update) whose sum best explains
    ``difference`` (the program's update less float64's), chosen greedily, at most ``most``.

    What is left is measured as the sum of squares of each element's excess over its ``slack`` (one float32 rounding
    of the result, which the gate allows anyway): rounding noise spread over millions of elements would otherwise
    outweigh a tie's one channel. A flip is taken while it removes at least a tenth of what is left: a tie's
    contribution is what the program did, so it removes most of it; an imprecise kernel's error is not shaped like
    any flip, and no flip removes much of it.
    """
    residual = {k: v.double().clone() for k, v in difference.items()}
    chosen: list[int] = []

    def left(r: Mapping[str, torch.Tensor]) -> float:
        return sum(float(((r[k].abs() - slack[k]).clamp(min=0.0) ** 2).sum()) for k in r)

    while len(chosen) < most:
        now = left(residual)
        after = [
            (left({k: residual[k] - c[k].double() for k in residual}), i)
            for i, c in enumerate(contributions)
            if i not in chosen
        ]
        if not after or now == 0.0:
            break
        best_left, best = min(after)
        if best_left > 0.9 * now:
            break
        chosen.append(best)
        for k in residual:
            residual[k] -= contributions[best][k].double()
    return chosen
