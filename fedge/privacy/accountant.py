"""The privacy ledger of a DP-FedAvg run: epsilon at delta after each round, from Google's ``dp-accounting``.

Each round is one Poisson-sampled Gaussian mechanism (McMahan et al., ICLR 2018, Sec. 3): every client joins with
probability ``q`` and the sum of the clipped updates gets Gaussian noise of ``z`` times the clip. ``T`` rounds compose
``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` ``T`` times, so epsilon after ``T`` rounds is a pure function of
``(q, z, T, delta)`` and the accountant: a resumed run recomputes its ledger instead of storing it.

Adaptive clipping (Andrew et al., NeurIPS 2021, Sec. 3.1 and Thm. 1) also releases a noised count of the unclipped
updates, with std ``sigma_b``. Its Theorem 1 accounts for both queries as one Gaussian mechanism of noise multiplier
``z``, provided the update's noise multiplier is raised to ``z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2``
(:func:`update_noise_multiplier`); the ledger composes ``z``.

``dp-accounting`` is imported on use: only a DP run needs it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

from fedge.errors import ConfigError

ACCOUNTANTS = ("rdp", "pld")
"""``rdp``: Renyi DP (Mironov 2017) at dp-accounting's default orders; ``pld``: privacy loss distributions (tighter,
slower)."""


def default_delta(population: int) -> float:
    """``1 / N^1.1``: below ``1/N``, so that "release one random client's data" is not (eps, delta)-DP."""
    return 1.0 / population**1.1


def update_noise_multiplier(z: float, count_std: float) -> float:
    """The noise multiplier of the update sum when the clipped-count query with std ``count_std`` (in clients) shares
    the budget of noise multiplier ``z`` (Andrew et al. 2021, Thm. 1): ``(z^-2 - (2 count_std)^-2)^-1/2``."""
    rest = z**-2 - (2 * count_std) ** -2
    if rest <= 0:
        raise ConfigError(
            f"adaptive clipping: the clipped-count noise (std {count_std:g} = expected cohort / 20) must exceed half "
            f"the noise multiplier ({z:g} / 2) to leave noise for the update; raise --client-fraction or "
            "--num-clients, or use a fixed --dp-clip"
        )
    return rest**-0.5


def epsilon(q: float, z: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``rounds`` Poisson-sampled (rate ``q``) Gaussian (noise multiplier ``z``) rounds."""
    if rounds == 0:
        return 0.0
    import dp_accounting
    from dp_accounting import pld, rdp

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )
    account: dp_accounting.PrivacyAccountant
    if accountant == "rdp":
        account = rdp.RdpAccountant()
    elif accountant == "pld":
        account = pld.PLDAccountant()
    else:
        raise ConfigError(f"dp_accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    with _quiet_absl():
        account.compose(event)
        value = float(account.get_epsilon(delta))
    return value if math.isfinite(value) else math.inf


class _DropExcludedOrders(logging.Filter):
    """dp-accounting's RDP warns for each fractional order its series does not converge at and excludes it; that is
    its documented behaviour, not a problem of the run, and would print a dozen lines a round."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    logger, dropped = logging.getLogger("absl"), _DropExcludedOrders()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)
