"""The one message type every role exchanges, and its wire codec.

A message is a safetensors blob: named tensors plus a ``__metadata__`` table of strings that carries the schema
version, the message kind, run id, round, client id, the algorithm's typed fields (``param.<name>``, see
:mod:`fedge.wire.fields`) and, kept apart, the transport's own metadata (``transport.<name>``: session, timings), which
algorithms never see. Decoding never unpickles anything: the header is JSON and the tensor bytes are read by
safetensors, which checks the offsets.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from safetensors import deserialize

from fedge.errors import CodecError

if TYPE_CHECKING:
    import torch

# torch is imported where a message has tensors, not here: `fedge status` and the monitor read metadata-only run
# status messages, and start in a fraction of a second without it (importing torch takes seconds).

SCHEMA_VERSION = "1"
MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB: larger than any model here; guards against absurd headers
_PARAM_PREFIX = "param."
_TRANSPORT_PREFIX = "transport."
_RESERVED = ("schema", "kind", "run", "round", "client")

# Message kinds. Down = coordinator -> clients, up = clients -> coordinator.
TASK = "task"  # down, one client: what to compute this round
BROADCAST = "broadcast"  # down, every client of the round: global weights / soft labels / FD global logits
UPDATE = "update"  # up: a client's result for a task


@dataclass(frozen=True)
class Message:
    """One unit of communication: named tensors plus string metadata."""

    kind: str
    round: int
    run: str = ""
    client: str = ""  # recipient of a task, sender of an update, "" for a broadcast
    params: Mapping[str, str] = field(default_factory=dict)  # the algorithm's fields
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    transport: Mapping[str, str] = field(default_factory=dict)  # the transport's metadata, apart from params

    def __post_init__(self) -> None:
        if not self.kind:
            raise CodecError("a message needs a kind")
        if self.round < 0:
            raise CodecError(f"round must be >= 0, got {self.round}")
        for table in (self.params, self.transport):
            for key, value in table.items():
                if not isinstance(key, str) or not isinstance(value, str):
                    raise CodecError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (numel x itemsize): what the papers count."""
        return tensor_bytes(self.tensors)

    def param(self, name: str, default: str | None = None) -> str:
        """A hyperparameter by name; a missing one without default is a CodecError naming it."""
        if name in self.params:
            return self.params[name]
        if default is not None:
            return default
        raise CodecError(f"{self.kind} message for round {self.round} lacks the parameter {name!r}")

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor by name; a missing one is a CodecError naming what is there."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CodecError(
                f"{self.kind} message for round {self.round} lacks tensor {name!r} (has {sorted(self.tensors)})"
            ) from None


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """numel x itemsize summed over tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def encode(message: Message) -> bytes:
    """Serialize to safetensors bytes with string metadata."""
    metadata = {
        "schema": SCHEMA_VERSION,
        "kind": message.kind,
        "run": message.run,
        "round": str(message.round),
        "client": message.client,
    }
    metadata.update({_PARAM_PREFIX + k: v for k, v in message.params.items()})
    metadata.update({_TRANSPORT_PREFIX + k: v for k, v in message.transport.items()})
    from safetensors.torch import save  # here, not at the top: see the imports

    # safetensors wants contiguous tensors that share no storage; clone only when needed.
    tensors = {k: (t if t.is_contiguous() else t.contiguous()).detach().cpu() for k, t in message.tensors.items()}
    return save(tensors, metadata=metadata)


def read_header(data: bytes) -> dict[str, object]:
    """Parse the JSON header of a safetensors blob without touching tensor data."""
    if len(data) < 8:
        raise CodecError(f"payload of {len(data)} bytes is too short to be a safetensors message")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise CodecError(f"payload of {len(data)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise CodecError(f"header length {header_len} exceeds the payload ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    return header


def decode(data: bytes, *, check_finite: bool = True) -> Message:
    """Parse and validate a payload; any defect raises CodecError with the reason."""
    header = read_header(data)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CodecError("metadata is missing or not a table of strings")
    missing = [k for k in _RESERVED if k not in meta]
    if missing:
        raise CodecError(f"metadata lacks {missing}")
    if meta["schema"] != SCHEMA_VERSION:
        raise CodecError(f"schema version {meta['schema']!r} is not supported (this build speaks {SCHEMA_VERSION!r})")
    try:
        rnd = int(meta["round"])
    except ValueError as exc:
        raise CodecError(f"round {meta['round']!r} is not an integer") from exc
    tensors: dict[str, torch.Tensor] = {}
    try:
        if any(k != "__metadata__" for k in header):
            from safetensors.torch import load  # here, not at the top: see the imports

            tensors = load(bytes(data))
        else:
            deserialize(bytes(data))  # no tensors: safetensors' checks of the layout all the same, without torch
    except Exception as exc:  # safetensors raises its own SafetensorError for any malformed body
        raise CodecError(f"tensor data is malformed: {exc}") from exc
    if check_finite and tensors:
        import torch  # here, not at the top: see the imports

        for name, t in tensors.items():
            try:
                finite = not t.is_floating_point() or bool(torch.isfinite(t).all())
            except (RuntimeError, NotImplementedError, TypeError):  # e.g. float8: torch has no isfinite for it
                raise CodecError(f"tensor {name!r} has a dtype whose values cannot be checked ({t.dtype})") from None
            if not finite:
                raise CodecError(f"tensor {name!r} holds non-finite values")
    params = {k[len(_PARAM_PREFIX) :]: v for k, v in meta.items() if k.startswith(_PARAM_PREFIX)}
    transport = {k[len(_TRANSPORT_PREFIX) :]: v for k, v in meta.items() if k.startswith(_TRANSPORT_PREFIX)}
    return Message(
        kind=meta["kind"],
        round=rnd,
        run=meta["run"],
        client=meta["client"],
        params=params,
        tensors=tensors,
        transport=transport,
    )
