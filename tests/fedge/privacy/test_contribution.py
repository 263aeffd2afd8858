"""A client's DP contribution from an algorithm's parts, by hand: a part over values an earlier one carries is not sent
twice (FedDyn's drift sum), others are (SCAFFOLD's control deltas, a relative and an as-sent part over one name); the
stand-in reply takes each part's values from the noised sum, over the fixed denominator where weighted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedge.errors import ConfigError
from fedge.privacy.contribution import Contribution, distinct_parts
from fedge.secagg.parts import SecurePart

SPECS = {
    "w": ((2, 2), torch.float32),
    "b": ((2,), torch.float32),
    "cd.w": ((2, 2), torch.float32),
}
WEIGHTS = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([10.0, 20.0])}


def test_feddyn_sends_its_move_once_and_h_takes_its_sum() -> None:
    parts = (SecurePart(("w", "b")), SecurePart(("w",), weighted=False, into="drift."))
    assert distinct_parts(parts) == parts[:1]
    contribution = Contribution(parts, SPECS)
    assert contribution.dim == 6
    np.testing.assert_array_equal(contribution.reference(WEIGHTS), [1, 2, 3, 4, 10, 20])
    total = np.arange(1.0, 7.0)  # (6,) the noised sum of the moves
    out = contribution.stand_in(WEIGHTS, total, 2.0)
    assert set(out) == {"w", "b", "drift.w"}
    torch.testing.assert_close(out["w"], WEIGHTS["w"] + torch.tensor([[1.0, 2.0], [3.0, 4.0]]) / 2)
    torch.testing.assert_close(out["b"], WEIGHTS["b"] + torch.tensor([5.0, 6.0]) / 2)
    torch.testing.assert_close(out["drift.w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # the sum, not over m


def test_scaffold_sends_both_parts_and_the_deltas_sum_stays_a_sum() -> None:
    parts = (SecurePart(("w", "b")), SecurePart(("cd.w",), relative=False, weighted=False))
    contribution = Contribution(parts, SPECS)
    assert contribution.parts == parts and contribution.dim == 10
    np.testing.assert_array_equal(contribution.reference(WEIGHTS), [1, 2, 3, 4, 10, 20, 0, 0, 0, 0])
    update = {"w": WEIGHTS["w"] + 1, "b": WEIGHTS["b"] - 1, "cd.w": torch.full((2, 2), 0.5)}
    np.testing.assert_array_equal(
        contribution.flatten(update) - contribution.reference(WEIGHTS), [1] * 4 + [-1] * 2 + [0.5] * 4
    )
    out = contribution.stand_in(WEIGHTS, np.full(10, 4.0), 4.0)
    torch.testing.assert_close(out["w"], WEIGHTS["w"] + 1)
    torch.testing.assert_close(out["cd.w"], torch.full((2, 2), 4.0))


def test_a_move_and_the_same_tensor_as_sent_are_two_parts() -> None:
    parts = (SecurePart(("w",)), SecurePart(("w",), relative=False, weighted=False, into="raw."))
    assert distinct_parts(parts) == parts


def test_a_part_clipped_per_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="clipped per value"):
        Contribution((SecurePart(("w",), relative=False, value_bound=1.0),), SPECS)
