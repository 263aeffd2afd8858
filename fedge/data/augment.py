"""Training-data augmentation on the host, before a batch reaches any runtime: FedNTD's data pipeline (appendix B).

The FedNTD authors' MNIST train transform (their ``train_tools/preprocessing/mnist/loader.py``) is, per image:
``RandomCrop(28, padding=4)`` (zero padding), ``RandomHorizontalFlip()`` (p = 0.5), ``ToTensor``,
``Normalize(0.1307, 0.3081)`` and then ``Cutout(16)``: a square of side 16 centred at a uniformly drawn pixel
(clipped at the borders) set to 0 *after* normalization. Test images are only normalized. fedge's loaders already
normalize with those constants (:mod:`fedge.data.datasets`), so the batch transform here is crop, flip and cutout on
normalized images, with the crop's padding filled with the normalized value of a black pixel (the lowest value of each
channel in
the client's data: black for MNIST-like images), as zero padding before normalization gives.

:data:`PRESETS` names the pipelines; ``paper`` scales the crop padding and the Cutout side to the image size
(4 and 16 at 28 pixels; 1 and 5 on the 8-pixel digits). Everything is drawn from one ``torch.Generator`` per batch,
seeded from the task's shuffle seed and the batch's position, so every runtime, executor and transport gives the same
batches, and evaluation data never pass through here. A teacher's logits (FedNTD, FedLSD, FedCAD) are computed on the
same augmented batch the student trains on, as the authors' code does (``TrainRequest.with_batch_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedge.errors import ConfigError

PRESETS = ("none", "paper")
"""Names of the augmentation pipelines (``TrainConfig.augment``)."""


@dataclass(frozen=True)
class Augmentation:
    """Random crop with ``padding``, horizontal flip with probability ``flip``, Cutout of side ``cutout`` (0: off)."""

    padding: int = 0
    flip: float = 0.0
    cutout: int = 0

    def __post_init__(self) -> None:
        if self.padding < 0 or self.cutout < 0 or not 0.0 <= self.flip <= 1.0:
            raise ConfigError(f"augmentation needs padding, cutout >= 0 and flip in [0, 1], got {self}")

    @property
    def active(self) -> bool:
        return bool(self.padding or self.flip or self.cutout)


def preset(name: str, input_shape: tuple[int, ...]) -> Augmentation:
    """The augmentation called ``name`` for images of ``input_shape`` (C, H, W); ConfigError for other inputs."""
    if name == "none":
        return Augmentation()
    if name != "paper":
        raise ConfigError(f"unknown augmentation {name!r}; choose one of {', '.join(PRESETS)}")
    if len(input_shape) != 3:
        raise ConfigError(f"augmentation 'paper' needs images (C, H, W), not inputs of shape {input_shape}")
    side = min(input_shape[1:])
    return Augmentation(padding=round(4 * side / 28), flip=0.5, cutout=round(16 * side / 28))


def augment_batch(x: torch.Tensor, aug: Augmentation, fill: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A new tensor: each image of ``x`` (N, C, H, W) randomly cropped, flipped and cut out as ``aug`` says.

    ``fill`` (C,) is the value of the crop's padding per channel. Draws, in this order and all from ``generator``:
    crop offsets (N, 2) in [0, 2 * padding], flips (N,), Cutout centres (N, 2) in [0, H) x [0, W).
    """
    n, c, h, w = x.shape
    out = x
    if aug.padding:
        p = aug.padding
        padded = fill.to(x.dtype).view(1, c, 1, 1).expand(n, c, h + 2 * p, w + 2 * p).clone()
        padded[:, :, p : p + h, p : p + w] = x
        offsets = torch.randint(0, 2 * p + 1, (n, 2), generator=generator)
        rows = (offsets[:, :1] + torch.arange(h))[:, :, None]  # (N, H, 1)
        cols = (offsets[:, 1:] + torch.arange(w))[:, None, :]  # (N, 1, W)
        out = padded.permute(0, 2, 3, 1)[torch.arange(n)[:, None, None], rows, cols].permute(0, 3, 1, 2)
    if aug.flip:
        flips = torch.rand(n, generator=generator) < aug.flip
        out = torch.where(flips[:, None, None, None], out.flip(-1), out)
    if aug.cutout:
        half = aug.cutout // 2
        centres = torch.stack(
            [torch.randint(0, h, (n,), generator=generator), torch.randint(0, w, (n,), generator=generator)], dim=1
        )
        top, bottom = (centres[:, 0] - half).clamp(0, h), (centres[:, 0] + half).clamp(0, h)
        left, right = (centres[:, 1] - half).clamp(0, w), (centres[:, 1] + half).clamp(0, w)
        r, k = torch.arange(h), torch.arange(w)
        in_rows = (r >= top[:, None]) & (r < bottom[:, None])  # (N, H)
        in_cols = (k >= left[:, None]) & (k < right[:, None])  # (N, W)
        out = out.masked_fill((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)
    return out.contiguous() if out is not x else x.clone()


def black_level(x: torch.Tensor) -> torch.Tensor:
    """Per channel, the lowest value in ``x`` (N, C, H, W): a black pixel after normalization (the crop's padding)."""
    return x.amin(dim=(0, 2, 3)) if len(x) else torch.zeros(x.shape[1])
