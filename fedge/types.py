"""Type aliases that name intent."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import torch

ClientId: TypeAlias = str
"""A client's stable identifier, e.g. ``"c007"``; also its MQTT topic segment."""

StateDict: TypeAlias = dict[str, torch.Tensor]
"""Model weights by state-dict name (parameters plus batch-norm running statistics)."""

Tensors: TypeAlias = dict[str, torch.Tensor]
"""Named tensors carried by one message."""

Logits: TypeAlias = torch.Tensor
"""Pre-softmax outputs, shape (batch, classes)."""

Probs: TypeAlias = torch.Tensor
"""Softmax outputs, shape (batch, classes); what the DS-FL paper calls a "logit" F(d|w)."""

IndexArray: TypeAlias = np.ndarray
"""A 1-D integer array of sample indices."""
