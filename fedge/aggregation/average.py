"""Server-side aggregation of model weights and of model outputs.

- Weights: FedAvg's data-size-weighted average, FedNTD eq. 2 / DS-FL eq. 3.
- Per-class outputs (FD): the global average over the clients holding each class, DS-FL eq. 5, and each client's
  leave-one-out distillation target, DS-FL eq. 6.
- Outputs on shared open data (DS-FL): simple aggregation SA, eq. 16, and entropy reduction aggregation ERA, eq. 13-15.

DS-FL calls a model's softmax output its "logit"; the FD functions take whatever per-class vectors the caller averages
(softmax outputs in DS-FL), the SA/ERA functions take softmax outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedge.errors import ConfigError
from fedge.types import Probs, StateDict

__all__ = ["aggregate_era", "aggregate_sa", "fd_global_logits", "fd_leave_one_out", "weighted_average"]


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """FedAvg, FedNTD eq. 2 / DS-FL eq. 3: ``sum_k (n_k / n) w_k`` for every tensor of the state dicts.

    ``weights`` are the clients' ``n_k`` (sample counts) or any non-negative weights; they are normalized here. The sum
    runs in float64 in the order given, so the result is deterministic, and is cast back to each tensor's dtype;
    integer tensors (e.g. batch norm's ``num_batches_tracked``) are rounded to the nearest integer first.
    """
    if not states:
        raise ValueError("weighted_average needs at least one state")
    if len(weights) != len(states):
        raise ValueError(f"got {len(states)} states but {len(weights)} weights")
    weight_list = [float(w) for w in weights]
    if any(not (w >= 0 and w < float("inf")) for w in weight_list):
        raise ValueError(f"weights must be finite and >= 0, got {weight_list}")
    total = sum(weight_list)
    if total <= 0:
        raise ValueError(f"weights must not all be zero, got {weight_list}")

    reference = states[0]
    for k, state in enumerate(states[1:], start=1):
        if state.keys() != reference.keys():
            missing = sorted(reference.keys() - state.keys())
            extra = sorted(state.keys() - reference.keys())
            key = (missing or extra)[0]
            raise ValueError(
                f"state {k} does not match state 0 at key {key!r} (missing from state {k}: {missing}, extra: {extra})"
            )
        for key, tensor in state.items():
            if tensor.shape != reference[key].shape:
                raise ValueError(
                    f"state {k} has shape {tuple(tensor.shape)} at key {key!r}, "
                    f"state 0 has {tuple(reference[key].shape)}"
                )

    result: StateDict = {}
    with torch.no_grad():
        for key, ref in reference.items():
            acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
            for state, w in zip(states, weight_list, strict=True):
                acc += (w / total) * state[key].to(device=ref.device, dtype=torch.float64)
            if not (ref.dtype.is_floating_point or ref.dtype.is_complex):
                acc = acc.round()
            result[key] = acc.to(ref.dtype)
    return result


def aggregate_sa(client_probs: Sequence[Probs]) -> Probs:
    """Simple aggregation, DS-FL eq. 16: the mean of the clients' outputs on the same open samples, (I, C)."""
    stacked = _stack_same_shape(client_probs, "client_probs")  # (K, I, C)
    return stacked.mean(dim=0)  # (I, C)


def aggregate_era(client_probs: Sequence[Probs], *, temperature: float = 0.1) -> Probs:
    """Entropy reduction aggregation, DS-FL eq. 13-15: ``softmax(mean_k T_k / temperature)`` per sample, (I, C).

    With ``temperature < 1`` the sharpened average has lower entropy than SA's when the clients disagree (non-IID
    data); the DS-FL default is 0.1. Each output row sums to 1.
    """
    if not temperature > 0:
        raise ConfigError(f"ERA temperature must be > 0, got {temperature}")
    return torch.softmax(aggregate_sa(client_probs) / temperature, dim=-1)


def fd_global_logits(
    client_class_probs: Sequence[Tensor], client_class_counts: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """FD global per-class average, DS-FL eq. 5; returns ``(global (C, C), contributors (C,) int64)``.

    Client k sends ``t_k`` (C, C), row n being its average output on its samples of class n (eq. 4), and its per-class
    sample counts (C,). Row n of the result averages row n over the clients with a sample of class n, the set ``K_n``;
    each such client counts once whatever its number of samples, as in eq. 5. ``contributors[n] = |K_n|``. A row
    with no contributor is zero.
    """
    if not client_class_probs:
        raise ValueError("fd_global_logits needs at least one client")
    if len(client_class_counts) != len(client_class_probs):
        raise ValueError(f"got {len(client_class_probs)} clients' outputs but {len(client_class_counts)} counts")
    probs = _stack_same_shape(client_class_probs, "client_class_probs")  # (K, C, C)
    if probs.dim() != 3 or probs.shape[1] != probs.shape[2]:
        raise ValueError(f"each client's per-class outputs must be (C, C), got {tuple(probs.shape[1:])}")
    num_classes = probs.shape[1]
    for k, counts in enumerate(client_class_counts):
        if counts.shape != (num_classes,):
            raise ValueError(f"client {k}'s class counts must have shape ({num_classes},), got {tuple(counts.shape)}")
        if bool((counts < 0).any()):
            raise ValueError(f"client {k}'s class counts must be >= 0, got {counts.tolist()}")
    holds = torch.stack([c.to(probs.device) > 0 for c in client_class_counts])  # (K, C)
    contributors = holds.sum(dim=0, dtype=torch.int64)  # (C,)
    # A client without samples of class n sends a zero row (eq. 4); masking also ignores a non-zero one.
    summed = (probs.double() * holds.unsqueeze(2)).sum(dim=0)  # (C, C)
    mean = summed / contributors.clamp_min(1).unsqueeze(1)  # (C, C); rows with |K_n| = 0 stay 0
    return mean.to(probs.dtype), contributors


def fd_leave_one_out(
    global_logits: Tensor,
    num_contributors: Tensor,
    own_logits: Tensor,
    own_counts: Tensor,
    *,
    own_included: bool = True,
) -> tuple[Tensor, Tensor]:
    """One client's FD distillation targets, DS-FL eq. 6; returns ``(targets (C, C), has_target (C,) bool)``.

    For a class n the client holds, row n is the average over the *other* clients of ``K_n``:
    ``(|K_n| t_g,n - t_k,n) / (|K_n| - 1)``. ``has_target[n]`` is true when row n comes from at least one other client.

    Cases the paper leaves open:

    - ``|K_n| = 1``, the client is the only holder: eq. 6 divides by zero; there is no other client's knowledge. Row
      n falls back to the global row, which equals the client's own, and ``has_target[n]`` is false so callers can
      skip distillation for that class (see the ``mask`` of :func:`fedge.learning.losses.fd_distillation_loss`).
    - The client holds no sample of class n: the global row is already an average over other clients only, so it is
      the target (never used for training, since no local sample has that label); true when ``|K_n| > 0``.
    - ``|K_n| = 0``: zero row, ``has_target[n]`` false.
    - ``own_included=False``: the client's outputs were not part of this global average (it did not report this
      round), so every global row is already others-only and is returned as is.

    Inputs that are softmax averages can come out with rounding-level negative entries where the others put no mass.
    """
    num_classes = global_logits.shape[0]
    if global_logits.shape != (num_classes, num_classes):
        raise ValueError(f"global_logits must be (C, C), got {tuple(global_logits.shape)}")
    if own_logits.shape != global_logits.shape:
        raise ValueError(
            f"own_logits must have the shape of global_logits {tuple(global_logits.shape)}, "
            f"got {tuple(own_logits.shape)}"
        )
    for name, vector in (("num_contributors", num_contributors), ("own_counts", own_counts)):
        if vector.shape != (num_classes,):
            raise ValueError(f"{name} must have shape ({num_classes},), got {tuple(vector.shape)}")
    contributors = num_contributors.to(device=global_logits.device, dtype=torch.int64)  # (C,)
    if not own_included:
        return global_logits.clone(), contributors > 0

    holds = own_counts.to(global_logits.device) > 0  # (C,)
    if bool((holds & (contributors < 1)).any()):
        bad = torch.nonzero(holds & (contributors < 1)).flatten().tolist()
        raise ValueError(
            f"classes {bad} have local samples but no contributor in the global average; "
            "pass own_included=False if this client's outputs were not aggregated"
        )
    leave_one_out = holds & (contributors >= 2)  # (C,)
    k = contributors.double().unsqueeze(1)  # (C, 1)
    # Safe denominator: rows where it would be 0 are replaced by the global row below.
    others = (k * global_logits.double() - own_logits.double()) / (k - 1).clamp_min(1)  # (C, C)
    targets = torch.where(leave_one_out.unsqueeze(1), others, global_logits.double())  # (C, C)
    has_target = leave_one_out | (~holds & (contributors > 0))
    return targets.to(global_logits.dtype), has_target


def _stack_same_shape(tensors: Sequence[Tensor], name: str) -> Tensor:
    if not tensors:
        raise ValueError(f"{name} must not be empty")
    shape = tensors[0].shape
    for k, tensor in enumerate(tensors):
        if tensor.shape != shape:
            raise ValueError(f"{name}[{k}] has shape {tuple(tensor.shape)}, {name}[0] has {tuple(shape)}")
    return torch.stack(list(tensors))
