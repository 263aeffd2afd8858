"""DP-FedAvg for SCAFFOLD and FedDyn on hand-built rounds: one joint clip bounds all a client adds to what the server
releases (SCAFFOLD's model and control variate, FedDyn's model and drift term h), measured on the server's state;
with no noise and a clip above every update the run is the algorithm's own with McMahan et al.'s fixed denominator;
adaptive clipping counts the joint norm; under secure aggregation the released sums are the clipped contributions
plus the survivors' noise shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from secagg_support import DeviceChannel, framed, seeded_bytes
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, Strategy, UpdateReport
from fedge.algorithms.differential_privacy import DifferentialPrivacyStrategy
from fedge.algorithms.feddyn import FedDynSettings
from fedge.algorithms.scaffold import CONTROL, CONTROL_DELTA, ScaffoldSettings
from fedge.config import RunConfig
from fedge.privacy.mechanism import noise_rng
from fedge.secagg.parts import PARTS_PARAM
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

RUN = "run"
LR_G = 0.5  # SCAFFOLD's global step size: applied after the fixed denominator
STATE = {"scaffold": CONTROL, "feddyn": "feddyn.h."}  # the server state besides the model, by prefix


def _config(algorithm: str, **overrides: object) -> RunConfig:
    base: dict[str, object] = dict(
        algorithm=algorithm,
        dataset="synthetic",
        num_clients=10,
        client_fraction=0.5,  # m = 5
        dp_noise_multiplier=1.0,
        dp_clip="0.5",
        dp_noise_seed=3,
    )
    if algorithm == "scaffold":
        base["algo"] = ScaffoldSettings(server_lr=LR_G)
    return RunConfig(**(base | overrides))  # type: ignore[arg-type]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _strategy(config: RunConfig) -> Strategy[Any]:
    strategy = make_strategy(config, ServerContext(_model, 3, RUN))
    if isinstance(strategy, DifferentialPrivacyStrategy):
        strategy._rand = seeded_bytes(0)  # deterministic keys for the secure path (tests only)
    return strategy


def _flat(tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([t.reshape(-1).double().numpy() for t in tensors.values()])


def _server(strategy: Strategy[Any], algorithm: str) -> tuple[np.ndarray, np.ndarray]:
    """The released state: the global weights (flat) and SCAFFOLD's c or FedDyn's h (flat)."""
    weights = strategy.global_weights()
    assert weights is not None
    tensors, _ = strategy.state()
    prefix = STATE[algorithm]
    return _flat(weights), _flat({k: v for k, v in tensors.items() if k.startswith(prefix)})


def _updates(strategy: Strategy[Any], rnd: int, steps: Mapping[str, tuple[float, float]]) -> dict[str, Message]:
    """Client c's update: the global weights plus a random step of L2 norm ``steps[c][0]`` and, for SCAFFOLD, a control
    delta of norm ``steps[c][1]``."""
    gen = torch.Generator().manual_seed(rnd)
    weights = strategy.global_weights()
    assert weights is not None
    scaffold = any(k.startswith(CONTROL_DELTA) for k in strategy.reply_tensors())
    out = {}
    for c, (move, control) in steps.items():
        raw = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in weights.items()}
        tensors = {k: (weights[k] + move / np.linalg.norm(_flat(raw)) * raw[k]).float() for k in weights}
        if scaffold:
            raw = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in weights.items()}
            tensors |= {CONTROL_DELTA + k: (control / np.linalg.norm(_flat(raw)) * v).float() for k, v in raw.items()}
        params = wire.to_params(UpdateReport(num_examples=10 + len(out), loss=1.0))
        out[c] = Message(UPDATE, rnd, run=RUN, client=c, params=params, tensors=tensors)
    return out


def _replies(strategy: Strategy[Any], rnd: int, steps: Mapping[str, tuple[float, float]]) -> dict[str, CheckedReply]:
    return {c: strategy.accept(rnd, c, m) for c, m in _updates(strategy, rnd, steps).items()}


def _round(
    strategy: Strategy[Any], rnd: int, steps: Mapping[str, tuple[float, float]], cohort: list[str] | None = None
) -> dict[str, float]:
    strategy.configure(rnd, sorted(cohort if cohort is not None else steps))
    return strategy.aggregate(rnd, _replies(strategy, rnd, steps))


def _released_sum(algorithm: str, before: tuple[np.ndarray, np.ndarray], after: tuple[np.ndarray, np.ndarray]) -> Any:
    """The noised sum S of the contributions, read back from the server's state (N = 10, m = 5): SCAFFOLD moves x by
    lr_g S_y / m and c by S_c / N; FedDyn's h moves by -alpha S / N and x by S / m - h / alpha = S (1/m + 1/N)."""
    (x0, s0), (x1, s1) = before, after
    if algorithm == "scaffold":
        return np.concatenate([(x1 - x0) * 5 / LR_G, (s1 - s0) * 10])
    assert np.allclose(x1 - x0, -(s1 - s0) / 0.1 * 10 * (1 / 5 + 1 / 10), atol=1e-5)  # the same S in both
    return (x1 - x0) / (1 / 5 + 1 / 10)


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_one_client_changes_the_release_by_at_most_the_clip(algorithm: str) -> None:
    """With the same noise, a client 10^4 times beyond the clip (in its move and, for SCAFFOLD, its control delta)
    changes the released sums by exactly one clip's length against its not replying; as far as one just beyond."""
    released = {}
    for far in (None, 1.0, 1e4):
        strategy = _strategy(_config(algorithm))
        before = _server(strategy, algorithm)
        steps = {"c0": (0.2, 0.1), "c1": (0.3, 0.2)} | ({} if far is None else {"c2": (far, far)})
        _round(strategy, 1, steps, cohort=["c0", "c1", "c2"])  # c2 sampled in all three: the same noise draw
        assert isinstance(strategy, DifferentialPrivacyStrategy) and strategy.last is not None
        if far is not None:
            assert strategy.last.clipped_norms["c2"] == pytest.approx(0.5)  # the joint norm, clipped to C
        released[far] = _released_sum(algorithm, before, _server(strategy, algorithm))
    change = np.linalg.norm(released[1e4] - released[None])
    assert change == pytest.approx(0.5, rel=1e-4)  # float32 state; exactly C in float64
    assert np.allclose(released[1e4], released[1.0], atol=1e-4)
    assert np.linalg.norm(released[None]) > 0.5  # the noise is there (Z C = 0.5 per coordinate)


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_without_noise_and_clipping_it_is_the_algorithms_own_run(algorithm: str) -> None:
    """Z = 0 (set after construction: the config reads Z = 0 as no DP) and a clip above every update: with a cohort
    of exactly m = qN clients the fixed denominator is the cohort's mean, so two rounds give the plain algorithm's
    model and c (SCAFFOLD) or h (FedDyn) with uniform weighting, to float32 rounding (1e-6)."""
    private = _strategy(_config(algorithm, dp_clip="100"))
    assert isinstance(private, DifferentialPrivacyStrategy)
    private.z_update = 0.0
    settings = ScaffoldSettings(server_lr=LR_G) if algorithm == "scaffold" else FedDynSettings()
    uniform = dataclasses.replace(settings, weighting="uniform")  # DP-FedAvg's weights
    plain = _strategy(_config(algorithm, dp_noise_multiplier=0.0, dp_clip="adaptive", dp_noise_seed=None, algo=uniform))
    assert not isinstance(plain, DifferentialPrivacyStrategy)
    steps = {f"c{i}": (0.1 * (i + 1), 0.05 * (i + 1)) for i in range(5)}
    for rnd in (1, 2):
        for strategy in (private, plain):
            _round(strategy, rnd, steps)
        for a, b in zip(_server(private, algorithm), _server(plain, algorithm), strict=True):
            assert np.abs(a).max() > 1e-3 and np.allclose(a, b, atol=1e-6)
    assert private.last is not None and max(private.last.clipped_norms.values()) < 100  # nothing clipped


def test_scaffold_divides_the_model_by_m_and_the_control_by_n_when_a_client_drops() -> None:
    """Sampled c0..c2, c2 never replied: x + lr_g (sum of two moves) / qN and c + (sum of two deltas) / N."""
    strategy = _strategy(_config("scaffold", dp_clip="100"))
    assert isinstance(strategy, DifferentialPrivacyStrategy)
    strategy.z_update = 0.0
    x0, c0 = _server(strategy, "scaffold")
    strategy.configure(1, ["c0", "c1", "c2"])
    replies = _replies(strategy, 1, {"c0": (0.2, 0.1), "c1": (0.4, 0.3)})
    strategy.aggregate(1, replies)
    x1, c1 = _server(strategy, "scaffold")
    moves = sum(
        _flat({k: v for k, v in r.update.tensors.items() if k in ("weight", "bias")}) - x0 for r in replies.values()
    )
    deltas = sum(
        _flat({k: v for k, v in r.update.tensors.items() if k.startswith(CONTROL_DELTA)}) for r in replies.values()
    )
    assert np.allclose(x1, x0 + LR_G * moves / 5, atol=1e-6)
    assert np.allclose(c1, c0 + deltas / 10, atol=1e-7)


def test_adaptive_clipping_counts_the_joint_norm() -> None:
    """SCAFFOLD under adaptive clipping: a client whose move fits in C but whose [move, control delta] does not is
    clipped, and its bit is 0: the count is 7 (not 10) plus the noise."""
    cfg = _config("scaffold", dp_clip="adaptive:0.5", num_clients=100, client_fraction=0.2)  # m = 20, sigma_b = 1
    strategy = _strategy(cfg)
    assert isinstance(strategy, DifferentialPrivacyStrategy)
    steps = {f"c{i}": (0.1, 0.1 if i < 7 else 3.0) for i in range(10)}
    metrics = _round(strategy, 1, steps)
    dim = 2 * (5 * 3 + 3)  # the model and its control delta
    draw = noise_rng(3, 1).normal(0.0, np.append(np.full(dim, strategy.z_update * 0.5), 1.0))
    assert metrics["dp_unclipped_share"] == pytest.approx((7 + draw[-1]) / 20)
    assert strategy.last is not None and sum(n < 0.5 for n in strategy.last.clipped_norms.values()) == 7


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_secure_aggregation_releases_the_clipped_sum_plus_the_survivors_noise(algorithm: str) -> None:
    """Each client's [move, control delta] (SCAFFOLD) or move (FedDyn, whose h reuses it) is clipped jointly, noised
    and masked; the server's state moves by the unmasked sum: the clipped contributions plus the survivors' noise."""
    strategy = _strategy(_config(algorithm, secure_aggregation=True))
    assert isinstance(strategy, DifferentialPrivacyStrategy)
    before = _server(strategy, algorithm)
    metrics = _round(strategy, 1, {"c0": (0.3, 0.2), "c1": (3.0, 3.0), "c2": (0.1, 0.0), "c3": (1.0, 0.5)})
    last = strategy.last
    assert last is not None and metrics["dp_survivors"] == 4 and len(last.survivors) == 4
    assert last.clipped_sum.size == (36 if algorithm == "scaffold" else 18)  # FedDyn's second part is not sent again
    released = _released_sum(algorithm, before, _server(strategy, algorithm))
    assert np.allclose(released, last.clipped_sum + last.noise, atol=1e-4)  # the ring's fixed point, then float32
    assert np.std(last.noise) > 0.1


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_devices_build_the_joint_vector_from_the_broadcast(algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DP under secure aggregation with the clients' parties on their devices (edge_client/secure.py): the broadcast
    names SCAFFOLD's two parts (FedDyn sends its move once: the default part), each device clips [move, control
    delta] jointly, adds its noise share and masks; given the in-process noise stream (each client's draw in id
    order), the server's model and c or h are the in-process ones within the ring's fixed point (devices round with
    their own streams)."""
    from edge_client.secure import SecureRounds

    clients = ["c0", "c1", "c2", "c3"]
    steps = {"c0": (0.3, 0.2), "c1": (3.0, 3.0), "c2": (0.1, 0.0), "c3": (1.0, 0.5)}
    config = _config(algorithm, secure_aggregation=True)
    inprocess = _strategy(config)
    _round(inprocess, 1, steps)
    remote = _strategy(config)
    assert isinstance(remote, DifferentialPrivacyStrategy)
    devices = {c: SecureRounds(c) for c in clients}
    remote.use_channel(DeviceChannel(devices, {}, run=RUN))
    plan = remote.configure(1, clients)
    assert plan.broadcast is not None and (PARTS_PARAM in plan.broadcast.params) == (algorithm == "scaffold")
    noise = noise_rng(3, 1)  # the in-process stream, drawn in turn by each device below
    monkeypatch.setattr("edge_client.secure.noise_rng", lambda seed, rnd: noise)
    updates = _updates(remote, 1, steps)  # the same as in process
    replies = {}
    for c in clients:
        reply = devices[c].reply(plan.tasks[c], framed(plan.broadcast), updates[c])
        assert reply is not None and not set(reply.tensors) & set(updates[c].tensors)  # never the update
        replies[c] = remote.accept(1, c, framed(reply))
    metrics = remote.aggregate(1, replies)
    assert metrics["dp_survivors"] == 4 and remote.last is None  # the coordinator saw no client's noise
    for a, b in zip(_server(remote, algorithm), _server(inprocess, algorithm), strict=True):
        assert np.abs(a).max() > 1e-3 and np.allclose(a, b, atol=1e-5)
