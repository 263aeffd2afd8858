"""The flat float64 vector of a model's tensors: :meth:`FlatLayout.flatten_into` writes exactly what concatenating
the tensors in float64 (minus a reference) gives, for every dtype, and :meth:`FlatLayout.unflatten` inverts it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedge.aggregation.flat import FlatLayout


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=gen),
        "half": torch.randn(5, generator=gen).half(),
        "bf": torch.randn(2, 2, generator=gen).bfloat16(),
        "steps": torch.tensor(7, dtype=torch.int64),
        "wide": torch.randn(4, 3, generator=gen).double().t(),  # not contiguous
        "empty": torch.zeros(0),
    }


def _plain(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1).double() for t in tensors.values()]).numpy()


@pytest.mark.parametrize("minus", [False, True])
def test_flatten_into_is_the_float64_concatenation_minus_the_reference_bit_for_bit(minus: bool) -> None:
    tensors = _tensors()
    layout = FlatLayout({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    assert layout.dim == 12 + 5 + 4 + 1 + 12
    reference = np.random.default_rng(1).normal(size=layout.dim)
    out = np.full(layout.dim + 2, np.nan)  # a view of a larger buffer, as the DP server passes
    layout.flatten_into(tensors, out[1:-1], reference if minus else None)
    expected = _plain(tensors) - reference if minus else _plain(tensors)
    assert np.array_equal(out[1:-1], expected)
    assert np.isnan(out[0]) and np.isnan(out[-1])  # nothing written outside the view
    assert np.array_equal(layout.flatten(tensors), _plain(tensors))


def test_unflatten_gives_each_tensor_back_in_its_dtype_and_shares_nothing() -> None:
    tensors = _tensors()
    layout = FlatLayout({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    flat = layout.flatten(tensors)
    back = layout.unflatten(flat)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    flat[:] = 0.0
    assert torch.equal(back["wide"], tensors["wide"])  # a float64 tensor is a copy, not a view of ``flat``
