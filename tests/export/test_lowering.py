"""export.lowering: the rewritten model computes what the eager model computes, forward, backward and BN statistics."""

from __future__ import annotations

import pytest
import torch
from export_support import SPECS
from torch import nn

from export.lowering import (
    ChannelsLastConv2d,
    ChannelsLastMaxPool2d,
    ChannelsLastSequential,
    Conv2dAsMatmul,
    MatmulLinear,
    lower_for_training,
    patch_conv,
)
from fedge.learning.models import exchanged_state
from fedge.programs.spec import ModelSpec

MNIST_SHAPED = {
    "dsfl_mnist_cnn": ModelSpec("dsfl_mnist_cnn", (1, 28, 28), 10),
    "dsfl_fmnist_cnn": ModelSpec("dsfl_fmnist_cnn", (1, 28, 28), 10),
    "fedavg_cnn": ModelSpec("fedavg_cnn", (3, 32, 32), 10),  # CIFAR-10's shape, three input channels
}


def _inputs(spec: ModelSpec, n: int) -> torch.Tensor:
    x = spec.example(n, seed=3)
    # MNIST-like: mostly background. Exact zeros after ReLU make tied max-pool windows, which must route like eager.
    return torch.where(x > 0.5, x, torch.full_like(x, -0.4242)) if x.is_floating_point() else x


@pytest.mark.parametrize("name", sorted(SPECS) + [f"{n}@full-size" for n in sorted(MNIST_SHAPED)])
def test_a_lowered_model_trains_like_the_eager_one(name: str) -> None:
    spec = SPECS[name] if name in SPECS else MNIST_SHAPED[name.removesuffix("@full-size")]
    eager, twin = spec.build(seed=1).train(), spec.build(seed=1).train()
    lowered = lower_for_training(twin)
    assert list(lowered.state_dict()) == list(eager.state_dict())  # same names, same order: weights map one to one
    assert all(a is b for a, b in zip(lowered.parameters(), twin.parameters(), strict=True))  # the same tensors

    x = _inputs(spec, 12)
    y = torch.arange(12) % spec.num_classes
    for _ in range(3):  # three SGD steps: BN running statistics and weights must stay together
        for model in (eager, lowered):
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p -= 0.05 * p.grad
    got, expected = exchanged_state(twin), exchanged_state(eager)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=2e-5, msg=k)
    eager.eval()
    lowered.eval()
    with torch.no_grad():
        torch.testing.assert_close(lowered(x), eager(x), rtol=1e-4, atol=2e-5)


def test_convolutions_and_linear_layers_become_matrix_multiplies() -> None:
    lowered = lower_for_training(MNIST_SHAPED["fedavg_cnn"].build(seed=0))
    assert isinstance(lowered.get_submodule("features"), ChannelsLastSequential)  # one permute pair per block
    assert isinstance(lowered.get_submodule("classifier.0"), MatmulLinear)
    lone = lower_for_training(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh()))
    assert isinstance(lone.get_submodule("0"), Conv2dAsMatmul)  # a block with an unknown layer: convs one by one
    kept = lower_for_training(nn.Sequential(nn.Conv2d(2, 4, 3, groups=2)))
    assert type(kept.get_submodule("0")) is nn.Conv2d  # grouped convolutions are kept as they are


@pytest.mark.parametrize("custom_op", [True, False])
def test_max_pooling_routes_gradients_of_ties_to_the_first_element_like_max_pool2d(custom_op: bool) -> None:
    x = torch.tensor([[1.0, 1.0, 0.0, 2.0], [1.0, 0.5, 2.0, 2.0], [0.0, 0.0, 3.0, -1.0], [0.0, 0.0, 3.0, 3.0]])
    a = x[None, None].clone().requires_grad_()
    b = x[None, :, :, None].clone().requires_grad_()  # NHWC, one channel
    out_a = nn.functional.max_pool2d(a, 2, 2)
    out_b = ChannelsLastMaxPool2d(use_custom_op=custom_op)(b)
    torch.testing.assert_close(out_b[..., 0], out_a[0], rtol=0, atol=0)
    weights = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (out_a[0, 0] * weights).sum().backward()
    (out_b[0, :, :, 0] * weights).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(b.grad[0, :, :, 0], a.grad[0, 0], rtol=0, atol=0)


def test_lowering_leaves_the_input_model_as_it_was() -> None:
    model = MNIST_SHAPED["dsfl_mnist_cnn"].build(seed=0)
    before = [type(m) for m in model.modules()]
    lower_for_training(model)
    assert [type(m) for m in model.modules()] == before


@pytest.mark.parametrize(("kernel", "padding", "size"), [(5, 2, 9), (5, 0, 12), (3, 1, 6), ((3, 5), (0, 2), 7)])
def test_patch_conv_computes_conv2d_and_its_gradients(
    kernel: int | tuple[int, int], padding: int | tuple[int, int], size: int
) -> None:
    # The custom operator's hand-written backward (the input gradient as a convolution of the padded output
    # gradient with the flipped kernel) against autograd through F.conv2d, in float64.
    conv = nn.Conv2d(4, 6, kernel, padding=padding, bias=False).double()
    ph, pw = conv.padding  # type: ignore[misc]
    x = torch.randn(3, 4, size, size, dtype=torch.float64, requires_grad=True)
    expected = nn.functional.conv2d(x, conv.weight, padding=conv.padding)
    x_nhwc = x.detach().permute(0, 2, 3, 1).contiguous().requires_grad_()
    got, _ = patch_conv(x_nhwc, conv.weight, ph, pw)
    torch.testing.assert_close(got.permute(0, 3, 1, 2), expected, rtol=0, atol=1e-12)
    r = torch.randn_like(expected)
    (expected * r).sum().backward()
    grad_w = conv.weight.grad
    conv.weight.grad = None
    (got * r.permute(0, 2, 3, 1)).sum().backward()
    assert x_nhwc.grad is not None and x.grad is not None and conv.weight.grad is not None and grad_w is not None
    torch.testing.assert_close(x_nhwc.grad.permute(0, 3, 1, 2), x.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(conv.weight.grad, grad_w, rtol=0, atol=1e-12)


def test_a_block_pools_before_its_relu_and_convolves_with_patch_conv_where_that_is_cheaper() -> None:
    block = lower_for_training(MNIST_SHAPED["fedavg_cnn"].build(seed=0)).get_submodule("features")
    kinds = [type(m).__name__ for m in block]
    assert kinds == ["ChannelsLastConv2d", "ChannelsLastMaxPool2d", "MaskReLU"] * 2  # ReLU after the pool
    calls: list[tuple[int, ...]] = []
    original = torch.ops.fedge.patch_conv.default

    def spy(x: torch.Tensor, *args: object) -> object:
        calls.append(tuple(x.shape))
        return original(x, *args)

    import export.lowering as lowering

    lowering.patch_conv, saved = spy, lowering.patch_conv  # type: ignore[assignment]
    try:
        block(torch.randn(2, 3, 32, 32))
    finally:
        lowering.patch_conv = saved
    # Only the second convolution: the first one's input needs no gradient (its sliced path measured faster).
    assert calls == [(2, 16, 16, 32)]


def test_faster_copies_off_gives_the_earlier_lowering() -> None:
    # The benchmark's baseline (export_training(..., faster_copies=False)): no custom operators, ReLU before pooling.
    model = MNIST_SHAPED["fedavg_cnn"].build(seed=0)
    plain = lower_for_training(model, faster_copies=False).get_submodule("features")
    assert [type(m).__name__ for m in plain] == ["ChannelsLastConv2d", "MaskReLU", "ChannelsLastMaxPool2d"] * 2
    assert not any(getattr(m, "use_patch_conv", False) or getattr(m, "use_custom_op", False) for m in plain)
    fast = lower_for_training(model).get_submodule("features")
    assert all(m.use_patch_conv for m in fast if isinstance(m, ChannelsLastConv2d))
    assert all(m.use_custom_op for m in fast if isinstance(m, ChannelsLastMaxPool2d))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-6)  # the same function either way
