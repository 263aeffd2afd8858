"""A fedge plugin: a small tabular model and scikit-learn's bundled wine data (178 samples, 13 features, 3 cultivars).

Use it with ``--plugin examples/custom_model/wine_plugin.py`` (or ``FEDGE_PLUGINS=...``) on any fedge command. It
registers:

- model ``wine_mlp``: 13 features -> 32 -> 32 -> 3 logits, with LayerNorm (it exports to ONNX and ExecuTorch);
- dataset ``wine``: the arrays, split 75/25 stratified by the run's seed and standardized with the train split's
  statistics (nothing is downloaded: the data ships inside scikit-learn);
- dataset ``wine_files``: the same kind of data read from a directory of files (``--data-dir DIR`` holding
  ``train/<class>/*.npy`` and ``test/<class>/*.npy``; ``make_wine_files.py`` writes one).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedge.plugins import DatasetArrays, load_class_folders, register_dataset, register_model


class WineMLP(nn.Module):
    """Two hidden layers of 32 with LayerNorm and ReLU; ``forward(x)`` returns logits ``(N, num_classes)``."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"wine_mlp takes feature vectors (one dimension), got per-sample shape {input_shape}")
        self.input_shape = tuple(input_shape)  # read by fedge's exporters for their example input
        self.net = nn.Sequential(
            nn.Linear(input_shape[0], 32),
            nn.LayerNorm(32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (N, num_classes)


def load_wine_arrays(data_dir: Path | None, seed: int) -> DatasetArrays:
    """scikit-learn's wine data, split 75/25 stratified by ``seed``, standardized with the train split's mean/std."""
    # Imported here: a device with only fedge[client] (no scikit-learn) imports this plugin to build wine_mlp and
    # never loads the data (its client data file holds its share).
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    wine = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(
        wine.data, wine.target, test_size=0.25, random_state=seed, stratify=wine.target
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    return DatasetArrays(
        x_train=((x_train - mean) / std).astype(np.float32),
        y_train=y_train,
        x_test=((x_test - mean) / std).astype(np.float32),
        y_test=y_test,
        num_classes=3,
    )


def load_wine_files(data_dir: Path | None, seed: int) -> DatasetArrays:
    """The files ``make_wine_files.py`` wrote (already standardized): one ``.npy`` per sample, a folder per class."""
    return load_class_folders(data_dir)


register_model("wine_mlp", WineMLP)
register_dataset("wine", load_wine_arrays, default_model="wine_mlp")
register_dataset("wine_files", load_wine_files, default_model="wine_mlp")
