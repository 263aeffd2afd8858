"""Float64 with each layer's result rounded once, as float32 would: the hooks that move every layer's output and
gradient by up to one float32 rounding (pushed up, down, at random, or only where a sum is tied at zero). The stepwise
gate's allowance (:func:`export.gates.stepwise.stepwise_parity`) is the spread of such runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from export import ties


def _jittered(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    # A float32 sum's rounding scales with its terms, not with its (possibly cancelled) result: each element moves by
    # up to eps32 of itself plus eps32 of the tensor's mean magnitude.
    u, v = (torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2.0 - 1.0 for _ in range(2))
    eps = torch.finfo(torch.float32).eps
    return t * (1.0 + eps * u) + eps * v * t.detach().abs().mean()


class _Jitter(torch.autograd.Function):
    """Identity up to one float32 rounding, forward and backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        ctx.gen = gen  # type: ignore[attr-defined]
        return _jittered(x, gen)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _jittered(g, ctx.gen), None  # type: ignore[attr-defined]


def _terms_magnitude(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``|W| |x| + |b|`` of a linear or 2-D convolution layer (the scale of its sums' float32 rounding), else None."""
    with torch.no_grad():
        return ties.terms_magnitude(module, x)


def _normalized_terms(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``|gamma| (|x| + |mean|) / std + |beta|`` of a batch-norm layer (the scale of its output's float32 rounding:
    ``x - mean`` rounds at eps32 of ``|x| + |mean|``), else None.

    A ReLU behind a batch norm is tied where the normalized output is within eps32 of these of zero; the layer before
    cannot tell, its output's zero is not the ReLU's. The rounding the input carries from the sum that made it is
    left out, as a loose push that would excuse more than ties (it let the unlowered dsfl_mnist_cnn pass at 3.55e-6
    before its 1.7e-5 was found to be a single ReLU tie, which tie flips now explain).
    """
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or x.dim() < 2:
        return None
    with torch.no_grad():
        return ties.batch_norm_rounding(module, x, torch.zeros((), dtype=x.dtype))


def add_jitter(
    model: nn.Module, gen: torch.Generator, push: float | str | None = None
) -> list[torch.utils.hooks.RemovableHandle]:
    eps = torch.finfo(torch.float32).eps

    # A linear or convolution bias's gradient is one sum of the output's gradient over every sample and position
    # (39,200 terms for a 28x28 convolution at batch 50), and in front of a batch norm the sum cancels to zero: what
    # the program stores there is its rounding, which for n terms is about sqrt(n) eps32 of the terms' magnitudes
    # (the probabilistic bound of Higham and Mary, SIAM J. Sci. Comput. 2019), not eps32 of the result.
    # dsfl_fmnist_cnn's ce program from seed 0 rounds features.0.bias's sum to 19x one eps32 of its terms at step 8.
    sum_rounding: dict[int, torch.Tensor] = {}

    def note_sum_rounding(module: nn.Module, output: torch.Tensor) -> None:
        if isinstance(module, (nn.Linear, nn.Conv2d)) and module.bias is not None and output.dim() in (2, 4):
            dims = [0, *range(2, output.dim())]
            count = output.numel() // output.shape[1]
            output.register_hook(
                lambda g: sum_rounding.__setitem__(id(module), count**0.5 * g.detach().abs().sum(dims))
            )

    def bias_hook(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def jitter_bias(g: torch.Tensor) -> torch.Tensor:
            rounding = sum_rounding.pop(id(module), None)
            g = _jittered(g, gen)
            if rounding is None or rounding.shape != g.shape:
                return g
            if isinstance(push, float):
                way = torch.full_like(rounding, push)
            else:
                way = torch.rand(rounding.shape, generator=gen, dtype=rounding.dtype) * 2 - 1
            return g + eps * way * rounding

        return jitter_bias

    def on_output(module: nn.Module, inputs: tuple[object, ...], output: object) -> object:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            if output.requires_grad:
                note_sum_rounding(module, output)
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            terms = _terms_magnitude(module, x) if x is not None else None
            normalized = False
            if terms is None and x is not None and push == "ties":
                # Behind a batch norm, a ReLU's tie sits at the normalized output's zero and a max-pool window's
                # between two normalized outputs: the tie runs move every one by its rounding, up or down at random.
                terms = _normalized_terms(module, x)
                normalized = terms is not None
            if terms is not None and terms.shape == output.shape:
                if push == "ties":
                    sign = torch.randint(0, 2, terms.shape, generator=gen).to(terms.dtype) * 2 - 1
                    tied = output.detach().abs() <= eps * terms
                    way = sign if normalized else torch.where(tied, sign, torch.zeros_like(sign))
                elif push is None:
                    way = torch.rand(terms.shape, generator=gen, dtype=terms.dtype) * 2 - 1
                else:
                    way = torch.full_like(terms, float(push))
                output = output + eps * way * terms  # a constant offset: the gradient passes unchanged
            return _Jitter.apply(output, gen)
        return output  # an LSTM's (output, state) tuple: its input and parameter gradients are still jittered

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(on_output) for m in leaves]
    biases = {
        id(m.bias): m for m in leaves if isinstance(m, (nn.Linear, nn.Conv2d)) and isinstance(m.bias, nn.Parameter)
    }
    handles += [
        p.register_hook(bias_hook(biases[id(p)]) if id(p) in biases else lambda g: _jittered(g, gen))
        for p in model.parameters()
    ]
    return handles
