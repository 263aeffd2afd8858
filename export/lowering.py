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
  Where its input needs a gradient and its output is about as large as its input (stride 1, 'same' padding), it is
  the custom operator :func:`patch_conv`, whose backward is written out: the input gradient as one more im2col +
  ``mm`` (a convolution of the padded output gradient with the flipped kernel), instead of autograd's scatter of
  kh * kw patch-gradient slices into zero-filled copies of the input. Its im2col is one ``as_strided_copy``.
- **Linear layers** become ``mm(W, x.t()).t()``: the weight is never transposed, forward or backward (autograd's
  layout-aware ``mm`` backward transposes only batch-sized tensors), where ``nn.Linear``'s ``addmm`` transposes it
  three times.
- **ReLU** becomes ``x * sign(relu(x))`` with the mask detached: its backward is one ``mul`` instead of
  ``threshold_backward``'s ``le`` + ``where``. A ReLU right before a 2x2 max pooling moves after it (the same values
  and gradients, on a quarter of the elements).
- **MaxPool2d(2, 2)** becomes pairwise maxima with 0/1 masks (``sign(relu(b - a))``), first along the width, then
  along the height. The values are exactly ``max_pool2d``'s and the gradient goes to the first maximum of each window
  in row-major order, as ``max_pool2d``'s indices do (ties included: after a ReLU they are frequent). It is the
  custom operator :func:`max_pool_2x2`, whose backward puts the two halves of each stage back together with one
  ``cat`` (autograd's backward of the slices fills a zero buffer and scatters into it once per slice).
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CUSTOM_OP_DECOMPOSITIONS", "lower_for_training"]


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


# --- convolution with a hand-written backward ------------------------------------------------------------------------
#
# Autograd's backward of a sliced im2col adds each of the kh * kw patch-gradient slices into a zero-filled copy of the
# input (``full`` + ``slice_scatter`` + ``add``: about three input-sized passes per slice, most of a fedavg_cnn step's
# copying). A stride-1 convolution has a cheaper backward: the input gradient is the convolution of the output
# gradient, zero-padded by ``k - 1 - p``, with the kernel flipped and its channel axes swapped (one more im2col and
# ``mm``), and the weight gradient is ``g^T @ patches``. torch.export differentiates what an autograd.Function's
# forward does and ignores its backward, so the convolution is a custom operator with a registered backward:
# ``_export_forward_backward`` writes that backward into the joint graph, and :data:`CUSTOM_OP_DECOMPOSITIONS` then
# replaces the operators with the aten ops below, which the runtime has kernels for.


def _fresh(t: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    """``t`` (NHWC) zero-padded: always a tensor of its own, never a view (see :func:`_patches`)."""
    return F.pad(t, (0, 0, pad_w, pad_w, pad_h, pad_h)) if pad_h or pad_w else t.clone()


def _patches(padded: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """im2col of a contiguous NHWC tensor for a stride-1 ``kh x kw`` kernel: ``(N*Ho*Wo, kh*kw*C)``, K ordered
    ``(i, j, c)``, as one strided copy (``as_strided_copy`` walks fixed strides, 0.8 ns per element here, where the
    sliced im2col's slices and stacks took twice as long).

    ``padded`` must be a tensor of its own, not a view: a strided read of a view is exported relative to the view's
    base, through an ``as_strided_scatter`` the runtime has no kernel for.
    """
    n, hp, wp, c = padded.shape
    ho, wo = hp - kh + 1, wp - kw + 1
    row = wp * c  # the stride of one step down; one step right is c
    windows = torch.ops.aten.as_strided_copy(padded, (n, ho, wo, kh, kw, c), (hp * row, row, c, row, c, 1))
    return windows.reshape(n * ho * wo, kh * kw * c)


def _conv_forward(x: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, w, c = x.shape
    c_out, _, kh, kw = weight.shape
    patches = _patches(_fresh(x, pad_h, pad_w), kh, kw)
    w2d = weight.permute(0, 2, 3, 1).reshape(c_out, kh * kw * c)  # (C_out, K), K ordered (i, j, c)
    out = torch.mm(patches, w2d.t()).reshape(n, h + 2 * pad_h - kh + 1, w + 2 * pad_w - kw + 1, c_out)
    return out, patches


def _conv_input_grad(grad: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    # dx[u, v] = sum_{i, j} gp[u + i, v + j] @ W[:, :, kh-1-i, kw-1-j], gp = grad zero-padded by k - 1 - p.
    c_out, c, kh, kw = weight.shape
    n, ho, wo, _ = grad.shape
    qh, qw = kh - 1 - pad_h, kw - 1 - pad_w
    flipped = weight.flip(2, 3).permute(2, 3, 0, 1).reshape(kh * kw * c_out, c)  # rows ordered (i, j, o)
    grad_x = torch.mm(_patches(_fresh(grad, qh, qw), kh, kw), flipped)
    return grad_x.reshape(n, ho + 2 * qh - kh + 1, wo + 2 * qw - kw + 1, c)


def _conv_weight_grad(grad: torch.Tensor, patches: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    c_out, c, kh, kw = weight.shape
    grad_w2d = torch.mm(grad.reshape(-1, c_out).t(), patches)  # (C_out, K)
    return grad_w2d.reshape(c_out, kh, kw, c).permute(0, 3, 1, 2).contiguous()


@torch.library.custom_op("fedge::patch_conv", mutates_args=())
def patch_conv(x: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stride-1 convolution of NHWC ``x`` by ``weight`` (no bias): the NHWC output and the im2col patches."""
    return _conv_forward(x, weight, pad_h, pad_w)


@patch_conv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, w, c = x.shape
    c_out, _, kh, kw = weight.shape
    ho, wo = h + 2 * pad_h - kh + 1, w + 2 * pad_w - kw + 1
    return x.new_empty((n, ho, wo, c_out)), x.new_empty((n * ho * wo, kh * kw * c))


@torch.library.custom_op("fedge::patch_conv_input_grad", mutates_args=())
def patch_conv_input_grad(grad: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    """The input gradient of :func:`patch_conv` for the output gradient ``grad``."""
    return _conv_input_grad(grad, weight, pad_h, pad_w)


@patch_conv_input_grad.register_fake
def _(grad: torch.Tensor, weight: torch.Tensor, pad_h: int, pad_w: int) -> torch.Tensor:
    n, ho, wo, _ = grad.shape
    _, c, kh, kw = weight.shape
    return grad.new_empty((n, ho - 2 * pad_h + kh - 1, wo - 2 * pad_w + kw - 1, c))


@torch.library.custom_op("fedge::patch_conv_weight_grad", mutates_args=())
def patch_conv_weight_grad(grad: torch.Tensor, patches: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight gradient of :func:`patch_conv` for the output gradient ``grad``."""
    return _conv_weight_grad(grad, patches, weight)


@patch_conv_weight_grad.register_fake
def _(grad: torch.Tensor, patches: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.new_empty(weight.shape)


def _patch_conv_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, weight, pad_h, pad_w = inputs
    ctx.save_for_backward(weight, output[1])
    ctx.padding = (pad_h, pad_w)
    ctx.input_grad = x.requires_grad


def _patch_conv_backward(
    ctx: Any, grad: torch.Tensor, _grad_patches: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor, None, None]:
    weight, patches = ctx.saved_tensors
    grad_x = patch_conv_input_grad(grad, weight, *ctx.padding) if ctx.input_grad else None
    return grad_x, patch_conv_weight_grad(grad, patches, weight), None, None


patch_conv.register_autograd(_patch_conv_backward, setup_context=_patch_conv_setup)


def _pool_forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h, w, c = x.shape
    ho, wo = h // 2, w // 2
    if h != 2 * ho or w != 2 * wo:
        x = x[:, : 2 * ho, : 2 * wo, :]  # floor mode drops the last row / column
    pairs = x.reshape(n * 2 * ho, wo, 2 * c)  # neighbours along the width side by side
    a, b = pairs[:, :, :c], pairs[:, :, c:]
    take_w = _positive_mask(b - a)  # 1 where the right one is larger: ties go to the left, as max_pool2d's
    rows = (a * (1.0 - take_w) + b * take_w).reshape(n * ho, 2 * wo * c)  # neighbouring rows side by side
    a, b = rows[:, : wo * c], rows[:, wo * c :]
    take_h = _positive_mask(b - a)
    return (a * (1.0 - take_h) + b * take_h).reshape(n, ho, wo, c), take_w, take_h


def _pool_input_grad(grad: torch.Tensor, take_w: torch.Tensor, take_h: torch.Tensor, h: int, w: int) -> torch.Tensor:
    # Each stage's gradient goes to the element its mask chose, the two halves put side by side again by one cat
    # (autograd's backward of the two slices fills a zero buffer and scatters into it, once per slice).
    n, ho, wo, c = grad.shape
    g = grad.reshape(n * ho, wo * c)
    rows = torch.cat([g * (1.0 - take_h), g * take_h], dim=1).reshape(n * 2 * ho, wo, c)
    pairs = torch.cat([rows * (1.0 - take_w), rows * take_w], dim=2).reshape(n, 2 * ho, 2 * wo, c)
    if h != 2 * ho or w != 2 * wo:
        pairs = F.pad(pairs, (0, 0, 0, w - 2 * wo, 0, h - 2 * ho))
    return pairs


@torch.library.custom_op("fedge::max_pool_2x2", mutates_args=())
def max_pool_2x2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nn.MaxPool2d(2, 2)`` of NHWC ``x`` (values and ties as ``max_pool2d``), and the 0/1 masks its backward uses."""
    return _pool_forward(x)


@max_pool_2x2.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h, w, c = x.shape
    ho, wo = h // 2, w // 2
    return x.new_empty((n, ho, wo, c)), x.new_empty((n * 2 * ho, wo, c)), x.new_empty((n * ho, wo * c))


@torch.library.custom_op("fedge::max_pool_2x2_input_grad", mutates_args=())
def max_pool_2x2_input_grad(
    grad: torch.Tensor, take_w: torch.Tensor, take_h: torch.Tensor, h: int, w: int
) -> torch.Tensor:
    """The input gradient of :func:`max_pool_2x2` for the output gradient ``grad``."""
    return _pool_input_grad(grad, take_w, take_h, h, w)


@max_pool_2x2_input_grad.register_fake
def _(grad: torch.Tensor, take_w: torch.Tensor, take_h: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return grad.new_empty((grad.shape[0], h, w, grad.shape[3]))


def _max_pool_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    (x,) = inputs
    ctx.save_for_backward(output[1], output[2])
    ctx.size = (x.shape[1], x.shape[2])


def _max_pool_backward(ctx: Any, grad: torch.Tensor, *_mask_grads: torch.Tensor | None) -> torch.Tensor:
    take_w, take_h = ctx.saved_tensors
    return max_pool_2x2_input_grad(grad, take_w, take_h, *ctx.size)


max_pool_2x2.register_autograd(_max_pool_backward, setup_context=_max_pool_setup)

#: What ``ExportedProgram.run_decompositions`` needs to turn the custom operators above into aten ops.
CUSTOM_OP_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    torch.ops.fedge.patch_conv.default: _conv_forward,
    torch.ops.fedge.patch_conv_input_grad.default: _conv_input_grad,
    torch.ops.fedge.patch_conv_weight_grad.default: _conv_weight_grad,
    torch.ops.fedge.max_pool_2x2.default: _pool_forward,
    torch.ops.fedge.max_pool_2x2_input_grad.default: _pool_input_grad,
}


# --- channels-last (NHWC) layers ----------------------------------------------------------------------------------


class ChannelsLastConv2d(nn.Module):
    """``nn.Conv2d`` (groups 1, zero padding) on NHWC input as im2col + ``mm``; same ``weight`` and ``bias``."""

    def __init__(self, conv: nn.Conv2d, *, use_patch_conv: bool = True) -> None:
        super().__init__()
        self.use_patch_conv = use_patch_conv
        self.weight = conv.weight  # (C_out, C_in, kh, kw): the very same Parameter
        self.bias = conv.bias
        self.kernel_size = _pair(conv.kernel_size)
        self.stride = _pair(conv.stride)
        self.padding = _pair(conv.padding)  # type: ignore[arg-type]  # string padding is refused by _can_lower_conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NHWC ``(N, H, W, C_in)`` -> NHWC ``(N, Ho, Wo, C_out)``."""
        (kh, kw), (ph, pw) = self.kernel_size, self.padding
        _, h, w, _ = x.shape
        if self.use_patch_conv and self.stride == (1, 1) and ph < kh and pw < kw and kh * kw > 1:
            # patch_conv's input gradient convolves the whole padded output gradient: as cheap as the sliced
            # backward's matrix product when the output is about as large as the input ('same' padding), up to
            # 2.25x its multiplications for a valid 5x5 convolution of a 12x12 input (dsfl_mnist_cnn), which
            # then keeps the sliced path. A first layer (no input gradient) keeps it too: measured interleaved,
            # patch_conv made fedavg_cnn's and dsfl_mnist_cnn's one-channel first layers slower, not faster.
            area_in, area_out = h * w, (h + 2 * ph - kh + 1) * (w + 2 * pw - kw + 1)
            if x.requires_grad and 4 * area_in <= 5 * area_out:
                out, _ = patch_conv(x.contiguous(), self.weight, ph, pw)
                return out + self.bias if self.bias is not None else out
        return self._sliced_forward(x)

    def _sliced_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any stride: im2col from slices, differentiated by autograd (a slower backward than :func:`patch_conv`)."""
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

    def __init__(self, *, use_custom_op: bool = True) -> None:
        super().__init__()
        self.use_custom_op = use_custom_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """NHWC ``(N, H, W, C)`` -> ``(N, H // 2, W // 2, C)``."""
        if self.use_custom_op:
            return max_pool_2x2(x.contiguous())[0]  # the same values, a backward with one cat per stage
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


def _channels_last(layer: nn.Module, faster: bool) -> nn.Module | None:
    """The channels-last version of one layer of a convolutional block, or None if it has none."""
    if _can_lower_conv(layer):
        assert isinstance(layer, nn.Conv2d)
        return ChannelsLastConv2d(layer, use_patch_conv=faster)
    if _can_lower_batch_norm(layer, nn.BatchNorm2d):
        assert isinstance(layer, nn.BatchNorm2d)
        return ChannelsLastBatchNorm2d(layer)
    if type(layer) is nn.ReLU:
        return MaskReLU()
    if _is_pool_2x2(layer):
        return ChannelsLastMaxPool2d(use_custom_op=faster)
    return None


def _lower_sequential(seq: nn.Sequential, faster: bool) -> nn.Module | None:
    """A channels-last copy of a convolutional block whose every layer has a channels-last version, else None."""
    if not any(_can_lower_conv(m) for m in seq):
        return None
    layers = [_channels_last(m, faster) for m in seq]
    if any(m is None for m in layers):
        return None
    named = list(zip(seq._modules, layers, strict=True))
    # ReLU then 2x2 max pooling == the pooling then the ReLU, values and gradients (a positive maximum is kept by
    # both and routed to the same first maximum; a window whose maximum is <= 0 gives 0 and no gradient either
    # way), and the ReLU then masks a quarter of the elements.
    for k in range(len(named) - 1 if faster else 0):
        if isinstance(named[k][1], MaskReLU) and isinstance(named[k + 1][1], ChannelsLastMaxPool2d):
            named[k], named[k + 1] = named[k + 1], named[k]
    lowered = ChannelsLastSequential()
    for name, layer in named:
        lowered.add_module(name, layer)  # same child names: same state-dict keys (these two layers have none)
    lowered.train(seq.training)
    return lowered


def _lower_module(module: nn.Module, faster: bool) -> nn.Module | None:
    """The lowered replacement of ``module`` itself, or None to keep it (and lower its children)."""
    if type(module) is nn.Sequential:
        return _lower_sequential(module, faster)
    if _can_lower_conv(module):
        assert isinstance(module, nn.Conv2d)
        return Conv2dAsMatmul(module, use_patch_conv=faster)
    if type(module) is nn.Linear:
        return MatmulLinear(module)
    if type(module) is nn.ReLU:
        return MaskReLU()
    if _can_lower_batch_norm(module, nn.BatchNorm1d):
        assert isinstance(module, nn.BatchNorm1d)
        return TwoPassBatchNorm1d(module)
    return None


def _lower_children(module: nn.Module, faster: bool) -> None:
    for name, child in list(module.named_children()):
        replacement = _lower_module(child, faster)
        if replacement is None:
            _lower_children(child, faster)
        else:
            replacement.train(child.training)
            setattr(module, name, replacement)


def lower_for_training(model: nn.Module, *, faster_copies: bool = True) -> nn.Module:
    """A model computing what ``model`` computes, with ops that reach ExecuTorch's optimized kernels.

    The result shares ``model``'s parameters and buffers (same tensors, same state-dict names, shapes and order), so
    weights map one to one and an exported training program takes the same weights. ``model`` itself is not changed:
    the rewrite works on a shallow copy of its module tree. See the module docstring for what is rewritten and why.
    ``faster_copies=False`` leaves out :func:`patch_conv`, :func:`max_pool_2x2` and the ReLU-after-pooling order:
    the lowering as it was before them, kept as the benchmark's baseline (``benchmarks/runtimes.py``).
    """
    lowered = _shallow_copy_tree(model)
    replacement = _lower_module(lowered, faster_copies)
    if replacement is not None:
        replacement.train(model.training)
        return replacement
    _lower_children(lowered, faster_copies)
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
