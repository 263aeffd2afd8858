"""The accountant against dp-accounting called directly, and Andrew et al.'s raised noise multiplier by hand."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedge.errors import ConfigError
from fedge.privacy.accountant import Ledger, default_delta, epsilon, update_noise_multiplier


def _direct(q: float, z: float, rounds: int, delta: float, kind: str) -> float:
    account = rdp.RdpAccountant() if kind == "rdp" else pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    account.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(account.get_epsilon(delta))


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize(("q", "z", "delta"), [(0.1, 2.0, 1e-5), (0.3, 4.0, 1e-3)])
def test_epsilon_is_dp_accountings(kind: str, q: float, z: float, delta: float) -> None:
    """The ledger's epsilon after T rounds is dp-accounting's accountant given T Poisson-sampled Gaussian events."""
    ledger = Ledger(q, z, delta, kind)
    for rounds in (1, 5, 40):
        assert ledger.epsilon(rounds) == pytest.approx(_direct(q, z, rounds, delta, kind), rel=1e-9)
    assert epsilon(q, z, 40, delta, kind) == ledger.epsilon(40)


def test_epsilon_grows_with_rounds_and_shrinks_with_noise() -> None:
    ledger = Ledger(0.1, 2.0, 1e-5)
    values = [ledger.epsilon(t) for t in (0, 1, 10, 100)]
    assert values[0] == 0 and values == sorted(values) and values[1] < values[3]
    assert epsilon(0.1, 4.0, 100, 1e-5) < values[3]
    assert Ledger(0.1, 2.0, 1e-5, "pld").epsilon(100) < values[3]  # PLD is tighter


def test_unknown_accountant_is_refused() -> None:
    with pytest.raises(ConfigError, match="rdp, pld"):
        epsilon(0.1, 1.0, 3, 1e-5, "moments")


def test_update_noise_multiplier_is_andrew_et_al_theorem_1() -> None:
    z, sigma_b = 1.0, 5.0  # m = 100: sigma_b = m / 20
    assert update_noise_multiplier(z, sigma_b) == pytest.approx((1 - 1 / 100) ** -0.5)
    assert update_noise_multiplier(z, sigma_b) > z
    with pytest.raises(ConfigError, match="clipped-count noise"):
        update_noise_multiplier(1.0, 0.5)  # (2 sigma_b)^-2 = z^-2: nothing left for the update


def test_default_delta() -> None:
    assert default_delta(1000) == pytest.approx(1000**-1.1) and default_delta(1000) < 1 / 1000
    assert math.isclose(default_delta(1), 1.0)
