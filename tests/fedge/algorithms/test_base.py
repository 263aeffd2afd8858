"""The reply checks every strategy shares: :func:`all_finite` finds a NaN or an infinity wherever it is, in every
floating dtype (numpy's check where numpy has the dtype, torch's elsewhere)."""

from __future__ import annotations

import pytest
import torch

from fedge.algorithms.base import all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 517, -1])
def test_all_finite_finds_a_non_finite_value_anywhere(dtype: torch.dtype, bad: float, at: int) -> None:
    t = torch.randn(33, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(t) and all_finite(t.t()) and all_finite(-t)
    t.view(-1)[at] = bad
    assert not all_finite(t) and not all_finite(t.t())  # contiguous or not
    assert not all_finite(torch.neg(t.t()))


def test_all_finite_takes_extremes_and_empty_tensors() -> None:
    assert all_finite(torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0, -0.0]))
    assert all_finite(torch.zeros(0)) and all_finite(torch.zeros(0, 3, dtype=torch.float16))
    assert not all_finite(torch.tensor(float("nan")))  # a 0-d tensor
