"""Rewrite an eager model for fast ExecuTorch training programs, keeping its state-dict names and shapes.

ExecuTorch 1.4.1 runs a training program on its CPU kernel library. The library has optimized (vectorized, Eigen
BLAS) kernels for ``mm``, ``bmm``, ``linear``, ``add``, ``sub``, ``mul``, ``div``, ``exp``, ``le``, ``where``,
``log_softmax``, ``sum.dim_IntList``, ``gelu``, ``elu`` and ``native_layer_norm`` (``kernels/optimized/optimized.yaml``
of the 1.4.1 tag; the same list is compiled into the wheel's ``_portable_lib``). Everything else is a *portable*
kernel, written for clarity: ``convolution`` and ``convolution_backward`` are direct loops (150-200x slower than
eager PyTorch), ``addmm`` (what ``nn.Linear`` becomes) is a naive triple loop, ``max_pool2d_with_indices`` takes
~15 ns per element, ``where`` walks a generic broadcast iterator (~10 ns per element), and every copy kernel
(``slice_copy``, ``cat``, ``permute_copy``, ...) pays one ``memcpy`` per contiguous run, so its speed depends on how
long the runs are, not on how many elements move.

:func:`lower_for_training` returns a model computing the same function with ops that avoid those kernels:

- **Convolutions** become im2col + one ``mm``. A run of ``Conv2d`` / ``BatchNorm2d`` / ``ReLU`` / ``MaxPool2d(2, 2)``
  inside an ``nn.Sequential`` runs channels-last (NHWC) between one permute in and one permute out: the patch matrix
  is then ``(N*Ho*Wo, kh*kw*C)`` with runs of ``C`` floats, and the product is written as ``P @ W2d.t()`` so that
  autograd forms the weight gradient as ``(g.t() @ P).t()`` (the patch matrix is never transposed; only the small
  weight and the output gradient are). A convolution outside such a run is lowered on its own, with its own permutes.
- **Linear layers** become ``mm(W, x.t()).t()``: the weight is never transposed, forward or backward (autograd's
  layout-aware ``mm`` backward transposes only batch-sized tensors), where ``nn.Linear``'s ``addmm`` transposes it
  three times.
- **ReLU** becomes ``x * sign(relu(x))`` with the mask detached: its backward is one ``mul`` instead of
  ``threshold_backward``'s ``le`` + ``where``.
- **MaxPool2d(2, 2)** becomes pairwise maxima with 0/1 masks (``sign(relu(b - a))``), first along the width, then
  along the height. The values are exactly ``max_pool2d``'s and the gradient goes to the first maximum of each window
  in row-major order, as ``max_pool2d``'s indices do (ties included: after a ReLU they are frequent).
- **Batch norm** (1d on ``(N, F)``, 2d channels-last) computes the batch statistics in two passes (mean, then the mean
  of squared deviations) with short partial sums, and updates the running statistics as ``nn.BatchNorm`` does
  (momentum, unbiased variance). This is also more accurate than the portable ``var`` kernel, whose single pass
  loses ~1e-4 of the variance on real image batches.

Parameters and buffers are the *same tensors* as the input model's, registered under the same names: the lowered
model's ``state_dict()`` has the same keys, shapes and order, and training it trains the original. Modules that are
not recognized (``Embedding``, ``LSTM``, other pooling, ...) are kept as they are. The lowering is for training
programs only: XNNPACK-delegated inference programs lower convolutions much better themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["lower_for_training"]


# --- elementwise building blocks -----------------------------------------------------------------------------------


def _positive_mask(x: torch.Tensor) -> torch.Tensor:
    """1.0 where ``x > 0``, else 0.0, detached (``relu`` and ``sign`` are fast kernels; ``gt`` + a cast is not)."""
    return torch.sign(torch.relu(x.detach()))


def _first_max(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``max(a, b)`` whose gradient goes to ``a`` on ties, as ``max_pool2d`` (the earlier window element wins).

    Multiplying by exact 0/1 masks keeps the value exactly ``a`` or ``b`` (``a + (b - a)`` could round).
    """
    take_b = _positive_mask(b - a)  # 1 where b > a
    return a * (1.0 - take_b) + b * take_b


# --- batch norm shared by both layouts ------------------------------------------------------------------------------


class _BatchNormState(nn.Module):
    """Parameters, running statistics and hyperparameters of a batch-norm layer, adopted from an ``nn.BatchNorm``."""

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        # The very parameters and buffers of ``bn``, under the same names and in the same order.
        self.weight = bn.weight
        self.bias = bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.eps = float(bn.eps)
        self.momentum = float(bn.momentum if bn.momentum is not None else 0.1)  # None is refused before this


def _batch_norm(
    module: _BatchNormState, flat: torch.Tensor, channel_mean: Callable[[torch.Tensor], torch.Tensor], count: int
) -> torch.Tensor:
    """Batch norm of ``flat`` ``(rows, C)``: batch statistics in training mode (updating the running ones), else
    the running statistics. ``channel_mean`` reduces a tensor shaped like ``flat`` to its per-channel mean."""
    if module.training:
        mean = channel_mean(flat)
        centred = flat - mean
        var = channel_mean(centred * centred)  # biased, as used for normalization
        # In place on the buffers, as nn.BatchNorm does: an exported training step returns the new values.
        m = module.momentum
        unbiased = var.detach() * (count / (count - 1))
        module.running_mean.copy_(module.running_mean * (1.0 - m) + mean.detach() * m)
        module.running_var.copy_(module.running_var * (1.0 - m) + unbiased * m)
        module.num_batches_tracked.add_(1)
    else:
        mean, var = module.running_mean, module.running_var
        centred = flat - mean
    scale = torch.rsqrt(var + module.eps)
    if module.weight is not None:
        scale = scale * module.weight
    out = centred * scale
    return out + module.bias if module.bias is not None else out


# --- channels-last (NHWC) layers ----------------------------------------------------------------------------------


class ChannelsLastConv2d(nn.Module):
    """``nn.Conv2d`` (groups 1, zero padding) on NHWC input as im2col + ``mm``; same ``weight`` and ``bias``."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight = conv.weight  # (C_out, C_in, kh, kw): the very same Parameter
        self.bias = conv.bias
        self.kernel_size = _pair(conv.kernel_size)
        self.stride = _pair(conv.stride)
        self.padding = _pair(conv.padding)  # type: ignore[arg-type]  # string padding is refused by _can_lower_conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NHWC ``(N, H, W, C_in)`` -> NHWC ``(N, Ho, Wo, C_out)``."""
        n, h, w, c = x.shape
        (kh, kw), (sh, sw), (ph, pw) = self.kernel_size, self.stride, self.padding
        # Zero padding as a concatenation: its backward is a slice (the portable constant_pad_nd refuses the
        # negative padding that F.pad's backward would need).
        if pw:
            z = x.new_zeros((n, h, pw, c))
            x = torch.cat([z, x, z], dim=2)
        if ph:
            z = x.new_zeros((n, ph, w + 2 * pw, c))
            x = torch.cat([z, x, z], dim=1)
        ho = (h + 2 * ph - kh) // sh + 1
        wo = (w + 2 * pw - kw) // sw + 1
        # im2col in two stages, kw + kh slices rather than kh * kw: fewer graph nodes (export time) and fewer
        # zero-filled gradient buffers in the backward pass.
        cols = torch.stack([x[:, :, j : j + sw * (wo - 1) + 1 : sw, :] for j in range(kw)], dim=3)  # (N,Hp,Wo,kw,C)
        rows = [cols[:, i : i + sh * (ho - 1) + 1 : sh] for i in range(kh)]  # each (N, Ho, Wo, kw, C)
        patches = torch.stack(rows, dim=3).reshape(-1, kh * kw * c)  # (N*Ho*Wo, kh*kw*C), K ordered (i, j, c)
        weight = self.weight.permute(0, 2, 3, 1).reshape(self.weight.shape[0], kh * kw * c)  # (C_out, K), small
        # mm with a transposed view as the second operand: autograd computes its gradient as (g.t() @ patches).t().
        out = torch.mm(patches, weight.t())  # (N*Ho*Wo, C_out)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(n, ho, wo, -1)


class Conv2dAsMatmul(ChannelsLastConv2d):
    """A lone ``nn.Conv2d`` (NCHW in and out) lowered as :class:`ChannelsLastConv2d` between two permutes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NCHW ``(N, C_in, H, W)`` -> NCHW ``(N, C_out, Ho, Wo)``."""
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()


class ChannelsLastBatchNorm2d(_BatchNormState):
    """``nn.BatchNorm2d`` on NHWC input, with the same parameters and running-statistic buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NHWC ``(N, H, W, C)`` -> the same shape."""
        n, h, w, c = x.shape
        flat = x.reshape(-1, c)  # (N*H*W, C): per-channel vectors broadcast along the last dimension

        def channel_mean(values: torch.Tensor) -> torch.Tensor:
            # Partial sums over W, then H, then the batch mean: short float32 sums, not one of length N*H*W.
            return values.reshape(n, h, w, c).sum(dim=2).sum(dim=1).mean(dim=0) / (h * w)

        return _batch_norm(self, flat, channel_mean, count=n * h * w).reshape(n, h, w, c)


class ChannelsLastMaxPool2d(nn.Module):
    """``nn.MaxPool2d(2, 2)`` on NHWC input: pairwise maxima with max_pool2d's values and gradient routing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NHWC ``(N, H, W, C)`` -> ``(N, H // 2, W // 2, C)``."""
        n, h, w, c = x.shape
        ho, wo = h // 2, w // 2
        if h != 2 * ho or w != 2 * wo:
            x = x[:, : 2 * ho, : 2 * wo, :]  # floor mode drops the last row / column
        pairs = x.reshape(n * 2 * ho, wo, 2 * c)  # neighbours along the width side by side
        rows = _first_max(pairs[:, :, :c], pairs[:, :, c:])  # (N*2Ho, Wo, C)
        rows = rows.reshape(n * ho, 2 * wo * c)  # neighbouring rows side by side
        # Slices, not rows[:, 0]: the backward of a select is a where over a broadcast mask, of a slice a copy.
        return _first_max(rows[:, : wo * c], rows[:, wo * c :]).reshape(n, ho, wo, c)


class ChannelsLastSequential(nn.Sequential):
    """An ``nn.Sequential`` of channels-last layers taking and returning NCHW tensors (one permute each way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)  # NCHW -> NHWC
        for layer in self:
            x = layer(x)
        return x.permute(0, 3, 1, 2).contiguous()  # back to NCHW for what follows (e.g. a flatten)


# --- layers on (N, F) ------------------------------------------------------------------------------------------------


class MatmulLinear(nn.Module):
    """``nn.Linear`` as ``mm(W, x.t()).t()`` on ``(N, in)`` input: the weight is never copied or transposed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight  # (out, in)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.t()).t()  # (N, out); only the batch-sized x and output are transposed
        return out + self.bias if self.bias is not None else out


class MaskReLU(nn.Module):
    """``nn.ReLU`` as ``x * mask``: its backward is one multiplication, not ``le`` + ``where``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _positive_mask(x)


class TwoPassBatchNorm1d(_BatchNormState):
    """``nn.BatchNorm1d`` on ``(N, F)`` input with two-pass statistics; same parameters and buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # (N, C, L) input: not lowered
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.training,
                self.momentum,
                self.eps,
            )
        return _batch_norm(self, x, lambda v: v.mean(dim=0), count=x.shape[0])


# --- the rewrite ------------------------------------------------------------------------------------------------------


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return int(value[0]), int(value[1])


def _can_lower_conv(conv: nn.Module) -> bool:
    return (
        type(conv) is nn.Conv2d
        and conv.groups == 1
        and _pair(conv.dilation) == (1, 1)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


def _can_lower_batch_norm(bn: nn.Module, cls: type[nn.modules.batchnorm._BatchNorm]) -> bool:
    # momentum=None (a cumulative average) and batch norm without running statistics stay as they are.
    return (
        type(bn) is cls
        and isinstance(bn, nn.modules.batchnorm._BatchNorm)
        and bn.track_running_stats
        and bn.momentum is not None
        and bn.affine
    )


def _is_pool_2x2(pool: nn.Module) -> bool:
    return (
        type(pool) is nn.MaxPool2d
        and _pair(pool.kernel_size) == (2, 2)
        and _pair(pool.stride or pool.kernel_size) == (2, 2)
        and _pair(pool.padding) == (0, 0)
        and _pair(pool.dilation) == (1, 1)
        and not pool.ceil_mode
        and not pool.return_indices
    )


def _channels_last(layer: nn.Module) -> nn.Module | None:
    """The channels-last version of one layer of a convolutional block, or None if it has none."""
    if _can_lower_conv(layer):
        assert isinstance(layer, nn.Conv2d)
        return ChannelsLastConv2d(layer)
    if _can_lower_batch_norm(layer, nn.BatchNorm2d):
        assert isinstance(layer, nn.BatchNorm2d)
        return ChannelsLastBatchNorm2d(layer)
    if type(layer) is nn.ReLU:
        return MaskReLU()
    if _is_pool_2x2(layer):
        return ChannelsLastMaxPool2d()
    return None


def _lower_sequential(seq: nn.Sequential) -> nn.Module | None:
    """A channels-last copy of a convolutional block whose every layer has a channels-last version, else None."""
    if not any(_can_lower_conv(m) for m in seq):
        return None
    layers = [_channels_last(m) for m in seq]
    if any(m is None for m in layers):
        return None
    lowered = ChannelsLastSequential()
    for name, layer in zip(seq._modules, layers, strict=True):
        lowered.add_module(name, layer)  # same child names: same state-dict keys
    lowered.train(seq.training)
    return lowered


def _lower_module(module: nn.Module) -> nn.Module | None:
    """The lowered replacement of ``module`` itself, or None to keep it (and lower its children)."""
    if type(module) is nn.Sequential:
        return _lower_sequential(module)
    if _can_lower_conv(module):
        assert isinstance(module, nn.Conv2d)
        return Conv2dAsMatmul(module)
    if type(module) is nn.Linear:
        return MatmulLinear(module)
    if type(module) is nn.ReLU:
        return MaskReLU()
    if _can_lower_batch_norm(module, nn.BatchNorm1d):
        assert isinstance(module, nn.BatchNorm1d)
        return TwoPassBatchNorm1d(module)
    return None


def _lower_children(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        replacement = _lower_module(child)
        if replacement is None:
            _lower_children(child)
        else:
            replacement.train(child.training)
            setattr(module, name, replacement)


def lower_for_training(model: nn.Module) -> nn.Module:
    """A model computing what ``model`` computes, with ops that reach ExecuTorch's optimized kernels.

    The result shares ``model``'s parameters and buffers (same tensors, same state-dict names, shapes and order), so
    weights map one to one and an exported training program takes the same weights. ``model`` itself is not changed:
    the rewrite works on a shallow copy of its module tree. See the module docstring for what is rewritten and why.
    """
    lowered = _shallow_copy_tree(model)
    replacement = _lower_module(lowered)
    if replacement is not None:
        replacement.train(model.training)
        return replacement
    _lower_children(lowered)
    return lowered


def _shallow_copy_tree(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original tensors."""
    import copy

    clone = copy.copy(module)
    clone._modules = {
        name: _shallow_copy_tree(child) if child is not None else None for name, child in module._modules.items()
    }
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone
