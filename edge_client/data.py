"""A client's local data as a file: what ``fedge client --data PATH`` reads, and what the laptop runner writes.

Format: one safetensors file with tensors ``x`` (N, *input_shape) float32 and ``y`` (N,) int64, and optionally
``open_x`` (DS-FL's unlabeled open set) and ``eval_x`` / ``eval_y`` (local test data, used by FD). Metadata (strings):
``format`` = ``fedge-client-data``, ``version``, ``client``, ``model``, ``input_shape`` ("1,28,28"), ``num_classes``,
and optionally ``shared`` = the name of a sibling safetensors file holding the large tensors many clients have in
common (the open set, the test set), so a laptop with 20 clients does not write them 20 times. Never pickle.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fedge.algorithms.base import ClientData
from fedge.errors import DatasetError

FORMAT = "fedge-client-data"
VERSION = "1"
SHARED_TENSORS = ("open_x", "eval_x", "eval_y")


@dataclass(frozen=True)
class ClientDataInfo:
    """What a client data file says about the model it is for."""

    client: str
    model: str
    input_shape: tuple[int, ...]
    num_classes: int


def save_client_data(
    path: str | Path, data: ClientData, info: ClientDataInfo, *, shared: str | Path | None = None
) -> Path:
    """Write ``data``; with ``shared`` (written by :func:`save_shared_data`) the shared tensors are not repeated."""
    path = Path(path)
    tensors = {"x": data.x.to(torch.float32).contiguous(), "y": data.y.to(torch.int64).contiguous()}
    if shared is None:
        for name in SHARED_TENSORS:
            value = getattr(data, name)
            if value is not None:
                tensors[name] = value.contiguous()
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "client": info.client,
        "model": info.model,
        "input_shape": ",".join(str(d) for d in info.input_shape),
        "num_classes": str(info.num_classes),
    }
    if shared is not None:
        shared = Path(shared)
        if shared.parent.resolve() != path.parent.resolve():
            raise DatasetError(f"the shared data file {shared} must sit beside {path} (it is referenced by name)")
        metadata["shared"] = shared.name
    save_file(tensors, str(path), metadata=metadata)
    return path


def save_shared_data(path: str | Path, data: ClientData) -> Path:
    """Write the tensors many clients share (open set, test set) once."""
    tensors = {n: getattr(data, n).contiguous() for n in SHARED_TENSORS if getattr(data, n) is not None}
    save_file(tensors, str(path), metadata={"format": FORMAT + "-shared", "version": VERSION})
    return Path(path)


def load_client_data(path: str | Path) -> tuple[ClientData, ClientDataInfo]:
    """Read a client data file (and its shared file); DatasetError says what is missing or malformed."""
    path = Path(path)
    meta = _metadata(path)
    if meta.get("format") != FORMAT:
        raise DatasetError(
            f"{path} is not a fedge client data file (format {meta.get('format')!r}, expected {FORMAT!r})"
        )
    if meta.get("version") != VERSION:
        raise DatasetError(f"{path} has client-data version {meta.get('version')!r}; this build reads {VERSION!r}")
    tensors = _load(path)
    if "shared" in meta:
        shared_path = path.parent / meta["shared"]
        if not shared_path.exists():
            raise DatasetError(f"{path} refers to the shared data file {shared_path}, which does not exist")
        tensors.update(_load(shared_path))
    try:
        info = ClientDataInfo(
            client=meta.get("client", ""),
            model=meta["model"],
            input_shape=tuple(int(d) for d in meta["input_shape"].split(",")),
            num_classes=int(meta["num_classes"]),
        )
    except (KeyError, ValueError) as exc:
        raise DatasetError(f"{path}: metadata model/input_shape/num_classes is missing or malformed ({exc})") from None
    for name in ("x", "y"):
        if name not in tensors:
            raise DatasetError(f"{path} lacks the tensor {name!r}")
    x, y = tensors["x"], tensors["y"]
    if tuple(x.shape[1:]) != info.input_shape or len(x) != len(y):
        raise DatasetError(
            f"{path}: x is {list(x.shape)} and y is {list(y.shape)}, expected (N, {info.input_shape}) and (N,)"
        )
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= info.num_classes):
        raise DatasetError(f"{path}: labels must lie in 0..{info.num_classes - 1}")
    data = ClientData(
        x=x,
        y=y,
        num_classes=info.num_classes,
        open_x=tensors.get("open_x"),
        eval_x=tensors.get("eval_x"),
        eval_y=tensors.get("eval_y"),
    )
    return data, info


def _metadata(path: Path) -> dict[str, str]:
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(min(n, 1 << 24)))
    except FileNotFoundError:
        raise DatasetError(f"client data file {path} does not exist") from None
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path} is not a safetensors file: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc
