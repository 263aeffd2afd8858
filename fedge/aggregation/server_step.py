"""The server step of the weight-exchange algorithms: how the global model moves once a round's models are averaged.

A strategy of the FedAvg family averages the clients' returned models into ``averaged``; a :class:`ServerOptimizer`
turns the global weights ``x`` and ``averaged`` into the next global model. Reddi et al. (ICLR 2021, "Adaptive
Federated Optimization", Algorithm 2) read the averaged update ``Delta = averaged - x`` as the negative of a
pseudo-gradient ``g = x - averaged``, so a server optimizer is any optimizer that descends along a gradient:

- :class:`Plain`: ``x + lr * Delta`` (SCAFFOLD's global step size lr_g, Algorithm 1 line 16); with lr = 1 the step
  is the average itself, FedAvg, bit for bit (``x + 1 * (averaged - x)`` would round differently).
- :class:`Momentum`: FedAvgM (Hsu, Qi and Brown 2019, "Measuring the Effects of Non-Identical Data Distribution",
  Sec. 3): ``v <- beta * v + g``, ``x <- x - lr * v``, which is ``torch.optim.SGD(momentum=beta, dampening=0)`` with
  ``.grad = g``: that optimizer runs it.
- :class:`Adaptive`: FedAdam, FedYogi, FedAdagrad, Algorithm 2 as the paper writes it (:func:`adaptive_step`). Not
  torch's optimizers, because they compute something else: ``torch.optim.Adam`` divides by the bias corrections
  ``1 - beta^t`` (the paper has none), starts ``v`` at 0 (the paper at ``tau^2``) and adds eps to the corrected
  ``sqrt(v / (1 - beta2^t))``; none of its options turns the correction off. ``torch.optim.Adagrad`` has no first
  moment: it is the paper's FedAdagrad only with ``beta1 = 0`` (``initial_accumulator_value = tau^2``,
  ``eps = tau``; a test checks this), and the paper's default is 0.9. Yogi (Zaheer et al., NeurIPS 2018) is not in
  ``torch.optim`` at all. The three share ``m`` and the step and differ in one line for ``v``, so one small function
  holds them, with the float operations the module had before, so no run's result changed.

An algorithm whose server does more than step along the average (SCAFFOLD's control variates, FedDyn's ``h``) takes
its own step in :meth:`fedge.algorithms.fedavg.FedAvg.server_step`, around a server optimizer. Only floating-point
tensors are stepped; integer buffers (batch norm's counters) take the average unchanged. An optimizer's state
(:meth:`ServerOptimizer.state`) goes into the run journal with the strategy's, so a resumed run continues the same
optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from fedge.errors import ConfigError
from fedge.tensors import tensors_like
from fedge.types import StateDict

__all__ = ["ADAPTIVE", "Adaptive", "Momentum", "Plain", "ServerOptimizer", "adaptive_step", "pseudo_gradient"]

ADAPTIVE = ("adam", "yogi", "adagrad")  # the second-moment rules of Reddi et al. Algorithm 2


def pseudo_gradient(weights: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> StateDict:
    """``g = x - averaged`` for every floating-point tensor of ``weights``: the direction a gradient step descends."""
    return {k: w - averaged[k] for k, w in weights.items() if w.is_floating_point()}


class ServerOptimizer(ABC):
    """Turns the global weights and the round's average into the next global weights; may keep state across rounds."""

    @abstractmethod
    def step(self, weights: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> StateDict:
        """The next global weights, from the current ``weights`` and the clients' ``averaged`` model (same keys)."""

    def state(self) -> dict[str, torch.Tensor]:
        """The optimizer's state as named tensors for the run journal (names its own, disjoint from the model's)."""
        return {}

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned (``tensors`` may hold other entries too); ConfigError when it does not
        fit."""
        return None  # a stateless optimizer has nothing to restore


class Plain(ServerOptimizer):
    """``x + lr * (averaged - x)``; lr = 1 is FedAvg: the average, unchanged."""

    def __init__(self, lr: float = 1.0) -> None:
        if not lr > 0:
            raise ConfigError(f"the server learning rate must be > 0, got {lr}")
        self.lr = lr

    def step(self, weights: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> StateDict:
        if self.lr == 1.0:
            return dict(averaged)
        return {
            k: w + self.lr * (averaged[k] - w) if w.is_floating_point() else averaged[k] for k, w in weights.items()
        }


class Momentum(ServerOptimizer):
    """FedAvgM: heavy-ball momentum on the pseudo-gradient, run by ``torch.optim.SGD`` (see the module)."""

    _BUFFER = "server_momentum."  # v in the saved state

    def __init__(self, like: Mapping[str, torch.Tensor], *, lr: float, momentum: float) -> None:
        # Leaf tensors the optimizer owns: each step copies the current global weights in, so a model set from outside
        # (a resumed run) is what it steps from.
        self._params = {k: v.detach().clone() for k, v in like.items() if v.is_floating_point()}
        self._sgd = torch.optim.SGD(list(self._params.values()), lr=lr, momentum=momentum, dampening=0.0)

    def step(self, weights: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> StateDict:
        g = pseudo_gradient(weights, averaged)
        with torch.no_grad():
            for k, p in self._params.items():
                p.copy_(weights[k])
                p.grad = g[k]
            self._sgd.step()
        return {k: self._params[k].detach().clone() if k in self._params else averaged[k] for k in weights}

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, p in self._params.items():
            buffer = self._sgd.state[p].get("momentum_buffer")
            if buffer is not None:  # none before the first step
                out[self._BUFFER + k] = buffer
        return out

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not any(self._BUFFER + k in tensors for k in self._params):
            return  # saved before the first step
        for k, buffer in tensors_like(tensors, self._BUFFER, self._params).items():
            self._sgd.state[self._params[k]]["momentum_buffer"] = buffer.clone()


def adaptive_step(
    kind: str,
    x: torch.Tensor,
    delta: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of Reddi et al. Algorithm 2 for one tensor: ``(x_{t+1}, m_t, v_t)`` from the averaged update
    ``delta`` (= -pseudo-gradient)::

        m_t = beta1 * m_{t-1} + (1 - beta1) * delta
        v_t = beta2 * v_{t-1} + (1 - beta2) * delta^2                         (adam)
        v_t = v_{t-1} - (1 - beta2) * delta^2 * sign(v_{t-1} - delta^2)      (yogi)
        v_t = v_{t-1} + delta^2                                              (adagrad)
        x_{t+1} = x_t + lr * m_t / (sqrt(v_t) + tau)
    """
    m = beta1 * m + (1 - beta1) * delta
    square = delta * delta
    if kind == "adam":
        v = beta2 * v + (1 - beta2) * square
    elif kind == "yogi":
        v = v - (1 - beta2) * square * torch.sign(v - square)
    elif kind == "adagrad":
        v = v + square
    else:
        raise ConfigError(f"unknown adaptive server optimizer {kind!r}; choose one of {', '.join(ADAPTIVE)}")
    return x + lr * m / (v.sqrt() + tau), m, v


class Adaptive(ServerOptimizer):
    """FedAdam, FedYogi or FedAdagrad (``kind``): :func:`adaptive_step` on every floating-point tensor, with
    ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``) and no bias correction."""

    _FIRST = "server_m."  # m_t in the saved state
    _SECOND = "server_v."  # v_t in the saved state

    def __init__(
        self, kind: str, like: Mapping[str, torch.Tensor], *, lr: float, beta1: float, beta2: float, tau: float
    ) -> None:
        if kind not in ADAPTIVE:
            raise ConfigError(f"unknown adaptive server optimizer {kind!r}; choose one of {', '.join(ADAPTIVE)}")
        self.kind, self.lr, self.beta1, self.beta2, self.tau = kind, lr, beta1, beta2, tau
        floats = {k: v for k, v in like.items() if v.is_floating_point()}
        self._m: StateDict = {k: torch.zeros_like(v) for k, v in floats.items()}
        self._v: StateDict = {k: torch.full_like(v, tau**2) for k, v in floats.items()}

    def step(self, weights: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor]) -> StateDict:
        stepped = dict(averaged)
        for k in self._m:
            delta = averaged[k] - weights[k]  # Delta_t
            stepped[k], self._m[k], self._v[k] = adaptive_step(
                self.kind,
                weights[k],
                delta,
                self._m[k],
                self._v[k],
                lr=self.lr,
                beta1=self.beta1,
                beta2=self.beta2,
                tau=self.tau,
            )
        return stepped

    def state(self) -> dict[str, torch.Tensor]:
        return {**{self._FIRST + k: v for k, v in self._m.items()}, **{self._SECOND + k: v for k, v in self._v.items()}}

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._m = tensors_like(tensors, self._FIRST, self._m)
        self._v = tensors_like(tensors, self._SECOND, self._v)
