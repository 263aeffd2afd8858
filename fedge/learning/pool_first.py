"""fedge's CNNs as eager PyTorch computes them: each ReLU that a max-pool follows moved after the pool.

The models keep the papers' order (convolution, ReLU, pooling), which the exported programs keep too (with the pool
first, ExecuTorch 1.4.1's unlowered training program of dsfl_mnist_cnn fails at run time). Eager training and
inference run :func:`pool_before_relu`'s form instead: the same function, the same gradients and so the same weights
bit for bit, with the ReLU on a quarter of the elements.

Why exact: ReLU is monotone, so ``max(relu(v)) == relu(max(v))`` over every window. The gradient goes to the window's
maximum in both orders (the pool's first maximal element: ReLU keeps the order of positive values, so both orders
find the same one) when it is positive, and is zero in both when it is not (ReLU's gradient at a value <= 0 is 0).

Measured in CPU seconds at 1 thread on FedNTD's MNIST setup (Intel Xeon, Sapphire Rapids; ``benchmarks/
client_profile.py`` section 3 shows the training figure): a fedavg_cnn client's local training takes 0.91-0.92x the
CPU of the papers' order (1.29 against 1.41 s), the server's evaluation of the 10,000 test images 0.89x (2.22 against
2.48 s).
"""

from __future__ import annotations

import copy

from torch import nn

from fedge.learning.models import DSFLFashionCNN, DSFLMnistCNN, FedAvgCNN

_FEATURES_WHOLE = (DSFLMnistCNN, DSFLFashionCNN, FedAvgCNN)
"""Models whose forward, representation and head use their ``features`` only as a whole (never a slice or one
layer of it), so that reordering commuting layers inside it changes no output. A subclass may not: not listed."""


def _swapped(layers: list[nn.Module]) -> list[nn.Module] | None:
    """``layers`` with every (ReLU, MaxPool2d) pair in pool-then-ReLU order; None when there is none."""
    out, changed = list(layers), False
    for i in range(len(out) - 1):
        if type(out[i]) is nn.ReLU and type(out[i + 1]) is nn.MaxPool2d:
            out[i], out[i + 1] = out[i + 1], out[i]
            changed = True
    return out if changed else None


def _observed(model: nn.Module) -> bool:
    """Whether a hook sees any of ``model``'s layers run (its own, or one registered for every module)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks:
        return True
    if hooks._global_backward_pre_hooks:
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in model.modules()
    )


def pool_before_relu(model: nn.Module) -> nn.Module:
    """``model`` with each ReLU of its ``features`` that a 2-D max-pool follows moved after that pool: the same
    outputs and gradients bit for bit (see the module docstring), computed with less work.

    The result shares every parameter, buffer and layer with ``model`` (only its table of children is its own), so
    weights set into ``model`` are the result's, and training the result trains ``model``. Models other than fedge's
    CNNs, models with nothing to move, and models whose layers something observes (a module hook: the export gates'
    jitter and tie probes read each layer's input and output in the model's own order) are returned as they are.
    """
    if type(model) not in _FEATURES_WHOLE or _observed(model):
        return model
    features = model._modules.get("features")
    if not isinstance(features, nn.Sequential):
        return model
    layers = _swapped(list(features))
    if layers is None:
        return model
    shell = copy.copy(model)  # a new object over the same attributes; its children table is replaced below
    shell._modules = dict(model._modules)
    shell._modules["features"] = nn.Sequential(*layers).train(features.training)
    return shell
