"""What one client contributes to a DP-FedAvg round: every value its server's released sums are made of, as one vector
that one clip ``C`` bounds.

An algorithm names the sums its server needs as secure-aggregation parts (:mod:`fedge.secagg.parts`): the model's
move for the FedAvg family; also SCAFFOLD's control-variate deltas (as sent), and FedDyn's move once more, unweighted,
for its drift term ``h``. Under DP the parts are not clipped on their own: a client's *whole* contribution to the
released sums must have L2 norm at most ``C`` for the noise ``N(0, (z C)^2)`` per coordinate to make the round one
Gaussian event of multiplier ``z`` (the accountant's). So the vector is the concatenation of the *distinct* parts,
clipped jointly: SCAFFOLD's ``clip_C([y_k - x, delta_c_k])``. A part over the same values as an earlier one (FedDyn's
drift sum: the model's move again) is not sent twice; the server derives its sum from the earlier part's noised sum
(post-processing), so one clip of the move covers both and no noise is spent on a copy.

From the noised sum ``S`` of the vectors the server builds the one reply that stands for the cohort
(:meth:`Contribution.stand_in`): a weighted part's mean with McMahan et al.'s fixed denominator, ``w + S_p / m``
(``m = qN``, the expected cohort), an unweighted part's sum ``S_p`` as it is (SCAFFOLD's ``c + S_c / N`` and FedDyn's
``h - alpha S / N`` divide by the population ``N`` themselves: fixed denominators too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from fedge.aggregation.flat import Spec
from fedge.errors import ConfigError
from fedge.secagg.parts import PartLayout, SecurePart


def distinct_parts(parts: Sequence[SecurePart]) -> tuple[SecurePart, ...]:
    """``parts`` less those whose values an earlier part already carries (the same tensors, both relative or both as
    sent): what a client sends."""
    kept: list[SecurePart] = []
    for p in parts:
        if not any(k.relative == p.relative and set(p.tensors) <= set(k.tensors) for k in kept):
            kept.append(p)
    return tuple(kept)


class Contribution:
    """The flat vector of a client's contribution (:attr:`sent`, :attr:`dim` values) and the stand-in reply built
    from the vectors' noised sum. ``specs``: each reply tensor's shape and dtype."""

    def __init__(self, parts: Sequence[SecurePart], specs: Mapping[str, Spec]) -> None:
        per_value = [p.tensors[0] for p in parts if p.value_bound is not None]
        if per_value:
            raise ConfigError(
                f"DP-FedAvg clips a client's contribution in L2 norm; a part clipped per value ({per_value[0]}...: "
                "outputs, not a move) is not built for it"
            )
        self.full = PartLayout(parts, specs)  # every part the algorithm's server reads, in its order
        self.sent = PartLayout(distinct_parts(parts), specs)  # what each client's vector holds
        self.dim = self.sent.dim

    @property
    def parts(self) -> tuple[SecurePart, ...]:
        """The parts of the vector a client sends."""
        return self.sent.parts

    def reference(self, weights: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        """(dim,): what the vector is a move from (the broadcast weights on relative parts' coordinates, else 0)."""
        return self.sent.reference(weights)

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        """(dim,): a reply's tensors in the vector's order."""
        return self.sent.flatten(tensors)

    def move_into(
        self, tensors: Mapping[str, torch.Tensor], reference: npt.NDArray[np.float64], out: npt.NDArray[np.float64]
    ) -> None:
        """Write ``flatten(tensors) - reference`` (dim,) into ``out``, bit for bit, in one pass and no temporary."""
        self.sent.flatten_into(tensors, out, reference)

    def stand_in(
        self, weights: Mapping[str, torch.Tensor], total: npt.NDArray[np.float64], denominator: float
    ) -> dict[str, torch.Tensor]:
        """The tensors of the reply that stands for the round, from the noised sum ``total`` (dim,) of the vectors:
        each weighted part's ``w + S_p / denominator`` (as sent: ``S_p / denominator``), each unweighted part's sum
        ``S_p``; a part not sent takes its values from the part that carries them."""
        where: dict[tuple[bool, str], slice] = {}  # (relative, tensor) -> its values in the vector
        start = 0
        for p, layout in zip(self.sent.parts, self.sent.layouts, strict=True):
            for k, (shape, _) in ((k, layout.specs[k]) for k in p.tensors):
                where[(p.relative, k)] = slice(start, start + math.prod(shape))
                start = where[(p.relative, k)].stop
        if self.full.parts == self.sent.parts:  # every part sent (the FedAvg family): the sum is already in order
            full = total
        else:
            full = np.concatenate([total[where[(p.relative, k)]] for p in self.full.parts for k in p.tensors])
        return self.full.stand_in(weights, full, denominator)  # (full dim,) in float64 until each tensor's dtype
