"""FedBuff's staleness weights, buffered mean update and server step, against hand computations."""

import math

import pytest
import torch

from fedge.aggregation.fedbuff import BufferedUpdate, ServerLearningRate, StalenessWeight, buffered_delta
from fedge.errors import ConfigError


def test_staleness_weights_by_hand():
    constant, sqrt, poly = (StalenessWeight.parse(spec) for spec in ("constant", "sqrt", "poly:2"))
    assert [constant(s) for s in (0, 1, 7)] == [1.0, 1.0, 1.0]
    assert sqrt(0) == 1.0 and sqrt(4) == pytest.approx(1 / 3) and sqrt(9) == pytest.approx(1 / 4)
    assert poly(0) == 1.0 and poly(1) == pytest.approx(1 / 4) and poly(3) == pytest.approx(1 / 16)
    assert StalenessWeight.parse("poly:0.5")(3) == pytest.approx(1 / 2)
    assert StalenessWeight.parse("poly:0")(5) == 1.0  # exponent 0: constant
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        sqrt(-1)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("poly", "poly needs an exponent"),
        ("poly:x", "poly needs an exponent"),
        ("poly:-1", "must be a number >= 0"),
        ("sqrt:2", "takes no argument"),
        ("linear", "choose constant, sqrt or poly:A"),
    ],
)
def test_bad_staleness_weights_say_what_is_wrong(spec: str, says: str):
    with pytest.raises(ConfigError, match=says):
        StalenessWeight.parse(spec)


def _update(client: str, base: int, n: float, *values: float) -> BufferedUpdate:
    return BufferedUpdate(client, base, n, {"w": torch.tensor(values), "steps": torch.tensor(2)})


def test_the_buffered_mean_update_by_hand():
    # At version 2: a's update is fresh (s = 0), b's two steps old (s = 2); n_a = 1, n_b = 3.
    updates = [_update("a", 2, 1.0, 2.0, -1.0), _update("b", 0, 3.0, 4.0, 8.0)]
    # poly:1: weights 1 and 1/3. (1 * 1 * [2, -1] + 1/3 * 3 * [4, 8]) / (1 + 3) = [6, 7] / 4
    delta = buffered_delta(updates, 2, StalenessWeight.parse("poly:1"))
    assert delta["w"].tolist() == pytest.approx([1.5, 1.75])
    # The normalisation is the buffer's data size, not the staleness-weighted one (FedBuff Algorithm 1 divides by K):
    # a buffer of equally stale updates moves the model less than a fresh one.
    stale = [_update("a", 0, 1.0, 2.0, 2.0), _update("b", 0, 1.0, 4.0, 4.0)]
    assert buffered_delta(stale, 4, StalenessWeight.parse("sqrt"))["w"].tolist() == pytest.approx([1.0, 1.0])
    assert buffered_delta(stale, 0, StalenessWeight.parse("sqrt"))["w"].tolist() == pytest.approx([3.0, 3.0])
    # constant weights, one version: FedAvg's data-size weighted mean of the moves
    fresh = [_update("a", 5, 1.0, 2.0, 0.0), _update("b", 5, 3.0, 6.0, 4.0)]
    assert buffered_delta(fresh, 5, StalenessWeight())["w"].tolist() == pytest.approx([5.0, 3.0])
    with pytest.raises(ValueError, match="at least one"):
        buffered_delta([], 0, StalenessWeight())


def test_the_server_step_by_hand():
    weights = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(10)}
    delta = {"w": torch.tensor([1.5, -2.0], dtype=torch.float64), "steps": torch.tensor(2.4, dtype=torch.float64)}
    half = ServerLearningRate(0.5)(weights, delta)
    assert half["w"].dtype == torch.float32 and half["w"].tolist() == pytest.approx([1.75, 1.0])
    assert half["steps"].dtype == torch.int64 and int(half["steps"]) == 11  # 10 + 1.2, rounded
    assert ServerLearningRate(1.0)(weights, delta)["w"].tolist() == pytest.approx([2.5, 0.0])
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ConfigError, match="server_lr must be > 0"):
            ServerLearningRate(bad)
