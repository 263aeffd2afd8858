"""The pieces of DP-FedAvg that touch the numbers: Poisson sampling, clipping, noise and the adaptive clip.

McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018, Algorithm 1 (DP-FedAvg with
the fixed-denominator estimator f_f: the sum of the clipped updates over ``q N``); Andrew et al., "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021, Algorithm 1 (the clip's geometric update, eq. 2-3).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fedge.tensors import l2_norm
from fedge.types import ClientId

_SAMPLE, _NOISE = 0xD9501, 0xD9502  # SeedSequence words: which per-round stream


def poisson_sample(available: Sequence[ClientId], q: float, seed: int, rnd: int) -> list[ClientId]:
    """Each available client independently with probability ``q``, drawn from (seed, round) alone; may be empty."""
    pool = sorted(available)
    gen = np.random.default_rng(np.random.SeedSequence([_SAMPLE, seed & 0xFFFFFFFFFFFFFFFF, rnd]))
    keep = gen.random(len(pool)) < q  # (N,)
    return [c for c, k in zip(pool, keep, strict=True) if k]


def noise_rng(noise_seed: int | None, rnd: int) -> np.random.Generator:
    """Round ``rnd``'s noise generator (PCG64): from ``noise_seed`` and the round when given (reproducible
    simulations), else from 32 bytes of ``os.urandom`` (the operating system's CSPRNG) drawn now."""
    if noise_seed is None:
        return np.random.default_rng(np.random.SeedSequence(int.from_bytes(os.urandom(32), "big")))
    return np.random.default_rng(np.random.SeedSequence([_NOISE, noise_seed & 0xFFFFFFFFFFFFFFFF, rnd]))


def clip(delta: npt.NDArray[np.float64], bound: float) -> tuple[npt.NDArray[np.float64], float]:
    """``delta`` scaled down to L2 norm ``bound`` when longer (``delta * min(1, C / ||delta||)``); and its norm."""
    norm = l2_norm(delta)
    return (delta * (bound / norm) if norm > bound else delta), norm


def adapted_clip(clip: float, noised_unclipped: float, expected_cohort: float, target: float, lr: float) -> float:
    """Andrew et al. eq. 3: ``C exp(-lr (b - target))`` where ``b`` is the noised share of updates with norm at most
    ``C`` over the expected cohort (eq. 2): the clip grows while fewer than ``target`` of the updates fit in it."""
    share = noised_unclipped / expected_cohort
    return clip * math.exp(-lr * (share - target))


def count_std(expected_cohort: float) -> float:
    """The std of the noise on the clipped count: ``expected cohort / 20``, Andrew et al.'s recommended setting
    (Sec. 3.1: sigma_b = m / 20)."""
    return expected_cohort / 20
