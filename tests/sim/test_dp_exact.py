"""DP-FedAvg's server path releases exactly what a plain float64 reading of the mechanism releases (issue 51: the
aggregation was made cheaper, not different): the same runs, once with :class:`DifferentialPrivacyStrategy`'s own
``aggregate`` and once with :func:`_straightforward_aggregate` in its place, end with the same model and the same
metrics.jsonl, bit for bit, for a fixed and an adaptive clip, central and under secure aggregation (with dropouts),
with ``--dp-noise-seed``. Both runs use this machine's arithmetic, so the check holds on any CPU."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedge.accounting.records import AggregationRecord
from fedge.algorithms.base import CheckedReply
from fedge.algorithms.differential_privacy import DifferentialPrivacyStrategy, PrivateRound
from fedge.privacy.mechanism import adapted_clip, noise_rng
from fedge.secagg.driver import run_configured
from fedge.secagg.errors import RoundAbandoned
from fedge.secagg.rounds import SUM_CLIENT, ProtocolLedger, rounding_rng, simulated_dropouts, simulated_drops
from fedge.types import ClientId
from sim.run import run_inprocess
from tests.sim.test_dp import _config as dp_config

_TIMING = re.compile(r".*_s(_max)?$")  # wall-clock fields of a metrics row: not part of what is released


def _straightforward_aggregate(
    self: DifferentialPrivacyStrategy, rnd: int, replies: Mapping[ClientId, CheckedReply]
) -> dict[str, float]:
    """DP-FedAvg's aggregation for the FedAvg family's one part (the model's move), written plainly: each reply
    concatenated in float64 (torch), minus the broadcast weights, clipped by the L2 norm summed in numpy's
    single-threaded loop (as fedge.tensors.l2_norm does: BLAS's dot would change its last bits with its thread
    count), summed in id order (Python ``sum``), noised by the round's generator (by the coordinator, or per client
    before a secure sum of the cohort in id order), divided by ``m = qN`` and added to the weights."""
    state = self._round
    assert state is not None and state.round == rnd
    assert len(self._layout.parts) == 1 and self._layout.parts[0].relative
    names = self._layout.parts[0].tensors
    weights = state.weights
    base = torch.cat([weights[k].reshape(-1).double() for k in names]).numpy()
    bound, adaptive = state.clip, self.adaptive
    vectors: dict[ClientId, np.ndarray] = {}
    norms: dict[ClientId, float] = {}
    for c in sorted(replies):
        move = torch.cat([replies[c].update.tensors[k].reshape(-1).double() for k in names]).numpy() - base
        norm = float(np.sqrt(np.einsum("i,i->", move, move)))
        norms[c] = min(norm, bound)
        clipped = move * (bound / norm) if norm > bound else move
        vectors[c] = np.append(clipped, 1.0 if adaptive and norm <= bound else 0.0)
    stds = np.full(base.size + 1, self.z_update * bound)
    stds[-1] = self.count_std
    rng = noise_rng(self.dp_config.dp_noise_seed, rnd)
    metrics = {
        "dp_epsilon": self.epsilon_after(rnd),
        "dp_delta": self.delta,
        "dp_clip": bound,
        "dp_noise_std": float(stds[0]),
        "dp_cohort": float(len(state.cohort)),
    }
    if state.secure is not None:
        config = state.secure
        share = stds / np.sqrt(config.min_survivors)
        noises = {c: rng.normal(0.0, share) for c in state.cohort if c in vectors}  # in id order: one stream
        inputs = {c: vectors[c] + noises[c] if c in vectors else np.zeros(base.size + 1) for c in state.cohort}
        drop_at: dict[ClientId, Any] = {c: "advertise" for c in state.cohort if c not in vectors}
        simulated = simulated_dropouts(state.cohort, self.dp_config.simulate_dropouts, self.dp_config.seed, rnd)
        drop_at.update({c: s for c, s in simulated.items() if c in vectors})
        ledger = ProtocolLedger(rnd, 4 * base.size)  # the round's messages, for the byte counts and drop reasons
        try:
            result = run_configured(
                config, inputs, drop_at=drop_at, rng=rounding_rng(self.dp_config.seed, rnd), on_message=ledger
            )
        except RoundAbandoned as exc:
            gone = [c for c in sorted(drop_at) if c in vectors]
            self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, config), str(exc))
            return metrics
        total, survivors = result.decoded_sum, result.survivors
        noise = sum((noises[c] for c in survivors), np.zeros(base.size + 1))
        gone = [c for c in result.dropped if c in vectors]
        self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, result.config), "")
        metrics |= {"dp_min_survivors": float(config.min_survivors), "dp_survivors": float(len(survivors))}
    else:
        noise = rng.normal(0.0, stds)
        total = sum((vectors[c] for c in sorted(vectors)), np.zeros(base.size + 1)) + noise
        survivors = tuple(sorted(vectors))
    mean = base + total[:-1] / self.expected_cohort
    new, start = {}, 0
    for k in names:
        size = weights[k].numel()
        new[k] = torch.from_numpy(mean[start : start + size].copy()).reshape(weights[k].shape).to(weights[k].dtype)
        start += size
    if adaptive:
        self.clip = adapted_clip(
            bound, float(total[-1]), self.expected_cohort, self.dp_config.dp_target_quantile, self.dp_config.dp_clip_lr
        )
        metrics["dp_unclipped_share"] = float(total[-1]) / self.expected_cohort
    self.inner.aggregate(rnd, {SUM_CLIENT: self._mean_reply(rnd, replies, survivors, new)})
    clipped_sum = sum((vectors[c][:-1] for c in survivors), np.zeros(base.size))
    self.last = PrivateRound({c: norms[c] for c in survivors}, clipped_sum, noise[:-1], survivors, base, mean, bound)
    return metrics


def _recording(aggregate: Callable[..., dict[str, float]], seen: list[PrivateRound | None]) -> Callable[..., Any]:
    """``aggregate``, keeping each round's :attr:`DifferentialPrivacyStrategy.last` (its float64 sums: a difference
    of one ulp there rarely survives the float32 model)."""

    def recorded(self: DifferentialPrivacyStrategy, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> Any:
        self.last = None
        metrics = aggregate(self, rnd, replies)
        seen.append(self.last)
        return metrics

    return recorded


def _same_round(a: PrivateRound | None, b: PrivateRound | None) -> bool:
    if a is None or b is None:
        return a is b
    arrays = ("clipped_sum", "noise", "before", "after")
    same = all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays)
    return same and (a.clipped_norms, a.survivors, a.clip) == (b.clipped_norms, b.survivors, b.clip)


def _outputs(path: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    released = [{k: v for k, v in row.items() if not _TIMING.fullmatch(k)} for row in rows]
    return load_file(path / "global_model.safetensors"), released


@pytest.mark.parametrize(
    "overrides",
    [
        dict(dp_clip="0.1"),
        dict(dp_clip="adaptive:0.5"),
        dict(dp_clip="0.1", secure_aggregation=True, simulate_dropouts=0.2),
        dict(dp_clip="adaptive:0.5", secure_aggregation=True),
    ],
    ids=["fixed", "adaptive", "fixed-secure-dropouts", "adaptive-secure"],
)
def test_the_release_is_the_straightforward_mechanisms_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: dict[str, object]
) -> None:
    config = dp_config(num_clients=12, dp_noise_multiplier=0.5, dp_noise_seed=7, **overrides)
    fast_rounds: list[PrivateRound | None] = []
    plain_rounds: list[PrivateRound | None] = []
    own = DifferentialPrivacyStrategy.aggregate
    monkeypatch.setattr(DifferentialPrivacyStrategy, "aggregate", _recording(own, fast_rounds))
    fast = run_inprocess(config, tmp_path / "fast", executor="sequential")
    monkeypatch.setattr(DifferentialPrivacyStrategy, "aggregate", _recording(_straightforward_aggregate, plain_rounds))
    plain = run_inprocess(config, tmp_path / "plain", executor="sequential")
    assert len(fast_rounds) == 3 and fast_rounds[0] is not None and fast_rounds[0].clip in (0.1, 0.5)
    assert all(_same_round(a, b) for a, b in zip(fast_rounds, plain_rounds, strict=True))
    (fast_model, fast_rows), (plain_model, plain_rows) = _outputs(fast.path), _outputs(plain.path)
    assert fast_model.keys() == plain_model.keys()
    assert all(torch.equal(fast_model[k], plain_model[k]) for k in fast_model)
    assert fast_rows == plain_rows
    assert fast_rows[0]["aggregated"] and "dp_clip" in fast_rows[-1]
    if config.dp_fixed_clip is None:
        assert fast_rows[1]["dp_clip"] != fast_rows[0]["dp_clip"]  # the clip moved: the count bits were summed
