"""DP-FedAvg's client share under secure aggregation: what one client adds to the secure sum, on its own device.

With secure aggregation the coordinator never sees an un-noised sum (step 3 of
:mod:`fedge.algorithms.differential_privacy`): each client encodes ``[clip_C(w_k - w), b_k] + N(0, diag(s)^2)``, its
clipped update, the bit ``b_k = ||w_k - w|| <= C`` of adaptive clipping (0 under a fixed clip, which releases no
count), and its share ``s`` of the round's noise (``z_delta C / sqrt(t)`` per coordinate of the update,
``sigma_b / sqrt(t)`` for the bit, ``t`` the fewest survivors a round completes with). The server sends ``C`` and
``s`` in the round's broadcast (:func:`share_params`); a device builds its input with :func:`client_input` from them,
drawing the noise from its own generator (seeded from ``os.urandom``: the server never learns a client's noise, so
never the un-noised sum).

A client provisioned for a DP run (its config.json names the noise multiplier ``z``) does not take the broadcast's
word for the noise: :class:`NoiseFloor` refuses a round that asks for less than an honest coordinator ever asks,
``z C / sqrt(n)`` per coordinate for a cohort of ``n`` (an honest share is ``z_delta C / sqrt(t)`` with
``z_delta >= z`` and ``t <= n``), so the sum over the whole cohort carries at least the run's stated noise whatever
the coordinator says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedge.config import RunConfig
from fedge.errors import CodecError
from fedge.privacy.mechanism import clip, count_std

CLIP_PARAM = "dp.clip"
NOISE_PARAM = "dp.noise_std"
COUNT_NOISE_PARAM = "dp.count_noise_std"
COUNT_PARAM = "dp.count"

_MAX = 1e6  # no legitimate clip or noise std comes near it; a larger one is a broken or hostile broadcast


@dataclass(frozen=True)
class ClientShare:
    """What one client's share of a DP round needs: the clip, whether it reports the bit, and its noise stds."""

    clip: float
    count: bool  # adaptive clipping: the bit ||delta|| <= C is the vector's last value
    noise_std: float  # per coordinate of the update
    count_noise_std: float  # on the bit

    def __post_init__(self) -> None:
        for name in ("clip", "noise_std", "count_noise_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= _MAX):
                raise CodecError(f"DP parameter {name} must be a finite number in [0, {_MAX:g}], got {value!r}")
        if self.clip <= 0:
            raise CodecError(f"the DP clip must be > 0, got {self.clip!r}")


def share_params(share: ClientShare) -> dict[str, str]:
    """``share`` as broadcast params (exact: ``repr`` of each float)."""
    return {
        CLIP_PARAM: repr(share.clip),
        COUNT_PARAM: "1" if share.count else "0",
        NOISE_PARAM: repr(share.noise_std),
        COUNT_NOISE_PARAM: repr(share.count_noise_std),
    }


def share_of(params: Mapping[str, str]) -> ClientShare | None:
    """The client share a broadcast's params describe; None when they describe none (no DP); CodecError when
    malformed."""
    if CLIP_PARAM not in params:
        return None

    def number(key: str) -> float:
        raw = params.get(key, "")
        try:
            return float(raw[:40])
        except ValueError:
            raise CodecError(f"param {key} is not a number") from None

    if params.get(COUNT_PARAM) not in ("0", "1"):
        raise CodecError(f"param {COUNT_PARAM} must be 0 or 1")
    return ClientShare(number(CLIP_PARAM), params[COUNT_PARAM] == "1", number(NOISE_PARAM), number(COUNT_NOISE_PARAM))


def client_input(
    update: npt.NDArray[np.float64],
    reference: npt.NDArray[np.float64],
    share: ClientShare,
    rng: np.random.Generator,
) -> npt.NDArray[np.float64]:
    """``[clip_C(update - reference), b] + noise``: one client's input to the secure sum, (dim + 1,)."""
    delta, norm = clip(update - reference, share.clip)  # (dim,)
    vector = np.empty(delta.shape[0] + 1)  # (dim + 1,)
    vector[:-1] = delta
    vector[-1] = 1.0 if share.count and norm <= share.clip else 0.0
    stds = np.full(vector.shape, share.noise_std)
    stds[-1] = share.count_noise_std
    return vector + rng.normal(0.0, stds)


@dataclass(frozen=True)
class NoiseFloor:
    """The least noise a client provisioned for DP-FedAvg adds, from its run config: the noise multiplier ``z`` and,
    under adaptive clipping, the expected cohort ``m`` whose count noise is ``m / 20``."""

    noise_multiplier: float
    expected_cohort: float
    adaptive: bool

    @classmethod
    def of_config(cls, config: RunConfig) -> NoiseFloor | None:
        """The floor of ``config``'s DP run; None for a run without DP."""
        if not config.differential_privacy:
            return None
        m = config.client_fraction * config.num_clients
        return cls(config.dp_noise_multiplier, m, config.dp_fixed_clip is None)

    def check(self, share: ClientShare | None, cohort: int) -> None:
        """CodecError unless ``share`` (the round's broadcast) asks for at least the noise an honest coordinator
        asks of a cohort of ``cohort`` clients."""
        if share is None:
            raise CodecError(
                f"this client was provisioned for DP-FedAvg (noise multiplier {self.noise_multiplier:g}) but the "
                "secure round asks for no noise: refused"
            )
        slack = 1 - 1e-9  # the broadcast's floats are exact reprs; this only absorbs the division's rounding
        need = self.noise_multiplier * share.clip / math.sqrt(max(cohort, 1))
        if share.noise_std < need * slack:
            raise CodecError(
                f"the secure round asks for noise std {share.noise_std:g} per value, less than the "
                f"{need:g} (z {self.noise_multiplier:g} x clip {share.clip:g} / sqrt({cohort})) this client's DP "
                "run needs: refused"
            )
        if self.adaptive and share.count:
            need_count = count_std(self.expected_cohort) / math.sqrt(max(cohort, 1))
            if share.count_noise_std < need_count * slack:
                raise CodecError(
                    f"the secure round asks for count noise std {share.count_noise_std:g}, less than the "
                    f"{need_count:g} this client's DP run needs: refused"
                )
