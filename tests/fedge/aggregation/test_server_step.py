"""The server optimizers against hand computations, and the paper-versus-torch facts the module's docstring states."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fedge.aggregation.server_step import Adaptive, Momentum, Plain, adaptive_step
from fedge.errors import ConfigError

X = {"w": torch.tensor([1.0, -2.0, 0.5]), "steps": torch.tensor(4)}  # a float tensor and an integer counter
AVG = {"w": torch.tensor([1.5, -1.0, 0.25]), "steps": torch.tensor(6)}


def test_plain_with_lr_1_is_the_average_itself_and_otherwise_a_step_towards_it() -> None:
    stepped = Plain().step(X, AVG)
    assert all(stepped[k] is AVG[k] for k in AVG)  # FedAvg: not x + (avg - x), which can round differently
    half = Plain(0.5).step(X, AVG)
    assert half["w"].tolist() == [1.25, -1.5, 0.375]
    assert half["steps"] is AVG["steps"]  # integer buffers take the average
    with pytest.raises(ConfigError, match="must be > 0"):
        Plain(0.0)


def test_momentum_is_fedavgm_by_hand_and_its_buffer_survives_a_restart() -> None:
    lr, beta = 0.5, 0.9
    opt = Momentum(X, lr=lr, momentum=beta)
    assert opt.state() == {}  # no buffer before the first step
    x, v = X["w"], torch.zeros(3)
    weights = dict(X)
    for avg in (AVG["w"], torch.tensor([0.0, 0.0, 0.0])):
        v = beta * v + (x - avg)  # v <- beta v + g, g = x - avg the pseudo-gradient
        x = x - lr * v
        weights = opt.step(weights, {"w": avg, "steps": AVG["steps"]})
        assert torch.allclose(weights["w"], x, atol=1e-6)
        assert weights["steps"] is AVG["steps"]
    restored = Momentum(X, lr=lr, momentum=beta)
    restored.load_state({**opt.state(), "unrelated": torch.zeros(1)})
    nxt = {"w": torch.tensor([2.0, 1.0, -1.0]), "steps": AVG["steps"]}
    assert torch.equal(restored.step(weights, nxt)["w"], opt.step(weights, nxt)["w"])
    with pytest.raises(ConfigError, match=r"server_momentum\.w"):
        Momentum(X, lr=lr, momentum=beta).load_state({"server_momentum.w": torch.zeros(2)})


def test_adaptive_state_round_trips_and_a_wrong_one_is_refused() -> None:
    opt = Adaptive("yogi", X, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    weights = opt.step(X, AVG)
    assert weights["steps"] is AVG["steps"]
    restored = Adaptive("yogi", X, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    restored.load_state(opt.state())
    assert torch.equal(restored.step(weights, AVG)["w"], opt.step(weights, AVG)["w"])
    with pytest.raises(ConfigError, match=r"server_v\.w"):
        restored.load_state({"server_m.w": torch.zeros(3)})
    with pytest.raises(ConfigError, match="unknown adaptive server optimizer"):
        Adaptive("rmsprop", X, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)


def _torch_step(
    optimizer: Callable[..., torch.optim.Optimizer], x: torch.Tensor, grads: list[torch.Tensor], **kw: Any
) -> torch.Tensor:
    p = x.clone()
    opt = optimizer([p], **kw)
    for g in grads:
        p.grad = g
        opt.step()
    return p


def _paper(kind: str, x: torch.Tensor, grads: list[torch.Tensor], *, beta1: float, tau: float) -> torch.Tensor:
    m, v = torch.zeros_like(x), torch.full_like(x, tau**2)
    for g in grads:
        x, m, v = adaptive_step(kind, x, -g, m, v, lr=0.1, beta1=beta1, beta2=0.99, tau=tau)
    return x


GRADS = [torch.tensor([0.3, -0.02, 1.0]), torch.tensor([0.1, 0.05, -0.4])]


def test_the_papers_fedadagrad_is_torchs_adagrad_only_without_a_first_moment() -> None:
    x, tau = torch.tensor([1.0, -2.0, 0.5]), 1e-3
    torch_adagrad = _torch_step(torch.optim.Adagrad, x, GRADS, lr=0.1, initial_accumulator_value=tau**2, eps=tau)
    assert torch.allclose(_paper("adagrad", x, GRADS, beta1=0.0, tau=tau), torch_adagrad, atol=1e-6)
    assert not torch.allclose(_paper("adagrad", x, GRADS, beta1=0.9, tau=tau), torch_adagrad, atol=1e-3)


def test_the_papers_fedadam_is_not_torchs_adam() -> None:
    """torch's Adam corrects the moments' bias (its first step is lr * g / (|g| + eps)); the paper's does not."""
    x, tau = torch.tensor([1.0, -2.0, 0.5]), 1e-3
    torch_adam = _torch_step(torch.optim.Adam, x, GRADS[:1], lr=0.1, betas=(0.9, 0.99), eps=tau)
    g = GRADS[0]
    assert torch.allclose(torch_adam, x - 0.1 * g / (g.abs() + tau), atol=1e-6)
    assert not torch.allclose(_paper("adam", x, GRADS[:1], beta1=0.9, tau=tau), torch_adam, atol=1e-2)
