"""The messages of a SecAgg+ round as plain data, and their wire form: named uint8/int32 arrays plus string metadata.

One frozen dataclass per message of Bonawitz et al. 2017 (Figure 4, rounds 0-3) as SecAgg+ (Bell et al. 2020,
Section 3) restricts it to a client's neighbours. ``client`` is the sender of an upload and the recipient of a
download. Each message turns into ``(tensors, metadata)`` with :meth:`to_fields`, which a transport carries as
safetensors tensors (uint8 and int32 only: the masked uint32 vector travels as its int32 bit pattern) and string
metadata under ``secagg.*`` keys; :func:`message_from_fields` reads any of them back. Parsing is where a peer's
bytes first meet the protocol, so it checks everything before the protocol sees it: the kind, every size and dtype
against the message's own counts, client ids (``[A-Za-z0-9._-]{1,64}``, strictly sorted lists), share values below
the field's prime; anything else raises :class:`MessageError`. Nothing is ever unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from fedge.secagg.errors import MessageError
from fedge.secagg.keys import KEY_BYTES, SEAL_OVERHEAD
from fedge.secagg.shamir import PRIME, SHARE_BYTES

PREFIX = "secagg."
KIND_KEY = PREFIX + "kind"
ROUND_KEY = PREFIX + "round"
CLIENT_KEY = PREFIX + "client"

CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""A client id the protocol accepts: safe in an MQTT topic, a file name and a comma-separated list."""

MAX_CLIENTS = 100_000
"""Most clients in one round (a complete graph over them is never what SecAgg+ builds, but stays parseable)."""

MAX_DIM = 1 << 30
"""Most coordinates of one masked vector (4 GiB as uint32)."""

BUNDLE_PLAINTEXT_BYTES = 2 * SHARE_BYTES
"""A share bundle: the share of the sender's self-mask seed b, then the share of its masking key s_sk."""

BUNDLE_BYTES = BUNDLE_PLAINTEXT_BYTES + SEAL_OVERHEAD
"""A sealed share bundle on the wire: nonce, ciphertext, tag."""

Fields: TypeAlias = tuple[dict[str, np.ndarray], dict[str, str]]
"""A message on the wire: named arrays and string metadata."""

M = TypeVar("M", bound="SecAggMessage")


class SecAggMessage:
    """What every protocol message offers: its wire form and its size."""

    KIND: ClassVar[str] = ""
    round: int
    client: str

    def to_fields(self) -> Fields:
        """The message as named uint8/int32 arrays plus ``secagg.*`` string metadata."""
        raise NotImplementedError

    @classmethod
    def from_fields(cls: type[M], tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> M:
        """The message from :meth:`to_fields` output; MessageError for anything malformed."""
        raise NotImplementedError

    def tensor_bytes(self) -> int:
        """Bytes of array data (numel x itemsize), what the papers count."""
        return sum(int(a.nbytes) for a in self.to_fields()[0].values())

    def wire_bytes(self) -> int:
        """Bytes of the message as one safetensors blob (:func:`pack`): arrays, metadata and header."""
        return len(pack(self))

    def _base_meta(self) -> dict[str, str]:
        return {KIND_KEY: self.KIND, ROUND_KEY: str(self.round), CLIENT_KEY: self.client}


@dataclass(frozen=True)
class AdvertiseKeys(SecAggMessage):
    """Stage 0, up: a client's two public keys, c (share encryption) and s (mask agreement)."""

    KIND: ClassVar[str] = "secagg.advertise"
    round: int
    client: str
    c_public: bytes
    s_public: bytes

    def __post_init__(self) -> None:
        _check_head(self)
        _check_bytes(self.c_public, KEY_BYTES, "c_public")
        _check_bytes(self.s_public, KEY_BYTES, "s_public")

    def to_fields(self) -> Fields:
        return {"c_public": _u8(self.c_public), "s_public": _u8(self.s_public)}, self._base_meta()

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> AdvertiseKeys:
        rnd, client = _parse_head(cls, tensors, meta, {"c_public", "s_public"})
        c = _rows(tensors, "c_public", None, KEY_BYTES)
        s = _rows(tensors, "s_public", None, KEY_BYTES)
        return _build(cls, round=rnd, client=client, c_public=c[0], s_public=s[0])


@dataclass(frozen=True)
class NeighbourKeys(SecAggMessage):
    """Stage 1, down: the public keys of the recipient's neighbours that advertised (sorted by id)."""

    KIND: ClassVar[str] = "secagg.neighbour-keys"
    round: int
    client: str
    peers: tuple[str, ...]
    c_publics: tuple[bytes, ...]
    s_publics: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_head(self)
        _check_ids(self.peers, "peers")
        _check_rows(self.c_publics, len(self.peers), KEY_BYTES, "c_publics")
        _check_rows(self.s_publics, len(self.peers), KEY_BYTES, "s_publics")

    def to_fields(self) -> Fields:
        meta = self._base_meta() | {PREFIX + "peers": ",".join(self.peers)}
        return {
            "c_publics": _u8_rows(self.c_publics, KEY_BYTES),
            "s_publics": _u8_rows(self.s_publics, KEY_BYTES),
        }, meta

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> NeighbourKeys:
        rnd, client = _parse_head(cls, tensors, meta, {"c_publics", "s_publics"})
        peers = _parse_ids(meta, PREFIX + "peers")
        return _build(
            cls,
            round=rnd,
            client=client,
            peers=peers,
            c_publics=_rows(tensors, "c_publics", len(peers), KEY_BYTES),
            s_publics=_rows(tensors, "s_publics", len(peers), KEY_BYTES),
        )


@dataclass(frozen=True)
class EncryptedShares(SecAggMessage):
    """Stage 1, up: one sealed share bundle per neighbour, in ``recipients`` order, for the server to relay."""

    KIND: ClassVar[str] = "secagg.encrypted-shares"
    round: int
    client: str
    recipients: tuple[str, ...]
    bundles: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_head(self)
        _check_ids(self.recipients, "recipients")
        _check_rows(self.bundles, len(self.recipients), BUNDLE_BYTES, "bundles")

    def to_fields(self) -> Fields:
        meta = self._base_meta() | {PREFIX + "recipients": ",".join(self.recipients)}
        return {"bundles": _u8_rows(self.bundles, BUNDLE_BYTES)}, meta

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> EncryptedShares:
        rnd, client = _parse_head(cls, tensors, meta, {"bundles"})
        recipients = _parse_ids(meta, PREFIX + "recipients")
        bundles = _rows(tensors, "bundles", len(recipients), BUNDLE_BYTES)
        return _build(cls, round=rnd, client=client, recipients=recipients, bundles=bundles)


@dataclass(frozen=True)
class ShareDelivery(SecAggMessage):
    """Stage 2, down: the bundles the recipient's neighbours sealed for it; ``senders`` is the recipient's
    neighbourhood in U2, the clients it masks against."""

    KIND: ClassVar[str] = "secagg.share-delivery"
    round: int
    client: str
    senders: tuple[str, ...]
    bundles: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_head(self)
        _check_ids(self.senders, "senders")
        _check_rows(self.bundles, len(self.senders), BUNDLE_BYTES, "bundles")

    def to_fields(self) -> Fields:
        meta = self._base_meta() | {PREFIX + "senders": ",".join(self.senders)}
        return {"bundles": _u8_rows(self.bundles, BUNDLE_BYTES)}, meta

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> ShareDelivery:
        rnd, client = _parse_head(cls, tensors, meta, {"bundles"})
        senders = _parse_ids(meta, PREFIX + "senders")
        bundles = _rows(tensors, "bundles", len(senders), BUNDLE_BYTES)
        return _build(cls, round=rnd, client=client, senders=senders, bundles=bundles)


@dataclass(frozen=True, eq=False)
class MaskedInput(SecAggMessage):
    """Stage 2, up: the client's encoded vector plus its self mask and pairwise masks, in Z_{2^ring_bits}."""

    KIND: ClassVar[str] = "secagg.masked-input"
    round: int
    client: str
    masked: npt.NDArray[np.uint32]  # (d,)

    def __post_init__(self) -> None:
        _check_head(self)
        m = self.masked
        if not isinstance(m, np.ndarray) or m.dtype != np.uint32 or m.ndim != 1:
            raise MessageError("a masked input is a 1-D uint32 array")
        if not 1 <= m.shape[0] <= MAX_DIM:
            raise MessageError(f"a masked input has between 1 and {MAX_DIM} coordinates, got {m.shape[0]}")

    def to_fields(self) -> Fields:
        # int32, not uint32: the same 32 bits, in a dtype every tensor library and safetensors reader has.
        return {"masked": np.ascontiguousarray(self.masked).view(np.int32)}, self._base_meta()

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> MaskedInput:
        rnd, client = _parse_head(cls, tensors, meta, {"masked"})
        a = tensors["masked"]
        if not isinstance(a, np.ndarray) or a.dtype not in (np.int32, np.uint32) or a.ndim != 1:
            raise MessageError("tensor 'masked' must be a 1-D int32 array")
        return _build(cls, round=rnd, client=client, masked=np.ascontiguousarray(a).view(np.uint32))


@dataclass(frozen=True)
class UnmaskRequest(SecAggMessage):
    """Stage 3, down: which of the recipient's U2 neighbours uploaded (U3); the others in its ShareDelivery dropped."""

    KIND: ClassVar[str] = "secagg.unmask-request"
    round: int
    client: str
    survivors: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_head(self)
        _check_ids(self.survivors, "survivors")

    def to_fields(self) -> Fields:
        return {}, self._base_meta() | {PREFIX + "survivors": ",".join(self.survivors)}

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> UnmaskRequest:
        rnd, client = _parse_head(cls, tensors, meta, set())
        return _build(cls, round=rnd, client=client, survivors=_parse_ids(meta, PREFIX + "survivors"))


@dataclass(frozen=True)
class UnmaskShares(SecAggMessage):
    """Stage 3, up: the holder's share of b_u for each surviving neighbour u (``b_owners``) and of s_sk_v for each
    dropped neighbour v (``s_owners``); never both for one neighbour. Share values are 66-byte big-endian integers;
    their x is the holder's index plus one."""

    KIND: ClassVar[str] = "secagg.unmask-shares"
    round: int
    client: str
    b_owners: tuple[str, ...]
    b_shares: tuple[bytes, ...]
    s_owners: tuple[str, ...]
    s_shares: tuple[bytes, ...]

    def __post_init__(self) -> None:
        _check_head(self)
        _check_ids(self.b_owners, "b_owners")
        _check_ids(self.s_owners, "s_owners")
        if set(self.b_owners) & set(self.s_owners):
            raise MessageError("an unmask reply may not hold both shares of one client")
        for owners, shares, name in (
            (self.b_owners, self.b_shares, "b_shares"),
            (self.s_owners, self.s_shares, "s_shares"),
        ):
            _check_rows(shares, len(owners), SHARE_BYTES, name)
            if any(int.from_bytes(s, "big") >= PRIME for s in shares):
                raise MessageError(f"a value of {name} lies outside the field")

    def to_fields(self) -> Fields:
        meta = self._base_meta() | {
            PREFIX + "b_owners": ",".join(self.b_owners),
            PREFIX + "s_owners": ",".join(self.s_owners),
        }
        tensors = {"b_shares": _u8_rows(self.b_shares, SHARE_BYTES), "s_shares": _u8_rows(self.s_shares, SHARE_BYTES)}
        return tensors, meta

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> UnmaskShares:
        rnd, client = _parse_head(cls, tensors, meta, {"b_shares", "s_shares"})
        b_owners = _parse_ids(meta, PREFIX + "b_owners")
        s_owners = _parse_ids(meta, PREFIX + "s_owners")
        return _build(
            cls,
            round=rnd,
            client=client,
            b_owners=b_owners,
            b_shares=_rows(tensors, "b_shares", len(b_owners), SHARE_BYTES),
            s_owners=s_owners,
            s_shares=_rows(tensors, "s_shares", len(s_owners), SHARE_BYTES),
        )


MESSAGE_TYPES: dict[str, type[SecAggMessage]] = {
    cls.KIND: cls
    for cls in (AdvertiseKeys, NeighbourKeys, EncryptedShares, ShareDelivery, MaskedInput, UnmaskRequest, UnmaskShares)
}
"""Every message class by its ``secagg.kind``."""


def message_from_fields(tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> SecAggMessage:
    """Whichever message ``meta[secagg.kind]`` names, parsed and validated."""
    kind = meta.get(KIND_KEY)
    if kind not in MESSAGE_TYPES:
        raise MessageError(f"unknown secure-aggregation message kind {_show(kind)}")
    return MESSAGE_TYPES[kind].from_fields(tensors, meta)


def pack(message: SecAggMessage) -> bytes:
    """The message as one safetensors blob (arrays plus metadata), for transports without their own framing."""
    from safetensors.numpy import save  # here: only transports without their own framing need it

    tensors, meta = message.to_fields()
    return save(tensors, metadata=meta)


def unpack(data: bytes) -> SecAggMessage:
    """A message from :func:`pack` output; MessageError for anything malformed."""
    from safetensors.numpy import load

    from fedge.errors import CodecError
    from fedge.wire.message import read_header

    try:
        header = read_header(data)
    except CodecError as exc:
        raise MessageError(str(exc)) from None
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise MessageError("metadata is missing or not a table of strings")
    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own error type for any malformed body
        raise MessageError(f"tensor data is malformed: {exc}") from None
    return message_from_fields(tensors, meta)


# --- validation helpers ----------------------------------------------------------------------------------------------


def check_client_id(client: object, what: str = "client id") -> str:
    """``client`` if it is a valid client id; MessageError otherwise."""
    if not isinstance(client, str) or not CLIENT_ID.fullmatch(client):
        raise MessageError(f"{what} {_show(client)} is not a valid client id ([A-Za-z0-9._-], 1-64 characters)")
    return client


def _check_head(message: SecAggMessage) -> None:
    if not isinstance(message.round, int) or isinstance(message.round, bool) or not 0 <= message.round < 2**53:
        raise MessageError(f"round must be an integer in [0, 2^53), got {message.round!r}")
    check_client_id(message.client)


def _check_ids(ids: tuple[str, ...], what: str) -> None:
    if not isinstance(ids, tuple) or len(ids) > MAX_CLIENTS:
        raise MessageError(f"{what} must be a tuple of at most {MAX_CLIENTS} client ids")
    for c in ids:
        check_client_id(c, f"{what} entry")
    if any(a >= b for a, b in pairwise(ids)):
        raise MessageError(f"{what} must be sorted and free of repeats")


def _check_bytes(value: bytes, size: int, what: str) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise MessageError(f"{what} must be {size} bytes")


def _check_rows(rows: tuple[bytes, ...], count: int, size: int, what: str) -> None:
    if not isinstance(rows, tuple) or len(rows) != count:
        raise MessageError(f"{what} must be a tuple of {count} entries, one per client listed")
    for row in rows:
        _check_bytes(row, size, f"each entry of {what}")


def _u8(value: bytes) -> np.ndarray:
    return np.frombuffer(value, dtype=np.uint8).copy()


def _u8_rows(rows: tuple[bytes, ...], size: int) -> np.ndarray:
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), size).copy()


def _parse_head(
    cls: type[SecAggMessage], tensors: Mapping[str, np.ndarray], meta: Mapping[str, str], names: set[str]
) -> tuple[int, str]:
    if meta.get(KIND_KEY) != cls.KIND:
        raise MessageError(f"expected a {cls.KIND} message, got kind {_show(meta.get(KIND_KEY))}")
    if set(tensors) != names:
        raise MessageError(f"a {cls.KIND} message carries tensors {sorted(names)}, got {sorted(tensors)}")
    raw = meta.get(ROUND_KEY)
    if not isinstance(raw, str) or not re.fullmatch(r"[0-9]{1,16}", raw):
        raise MessageError(f"round {_show(raw)} is not a non-negative integer")
    return int(raw), check_client_id(meta.get(CLIENT_KEY))


def _parse_ids(meta: Mapping[str, str], key: str) -> tuple[str, ...]:
    raw = meta.get(key)
    if not isinstance(raw, str):
        raise MessageError(f"metadata lacks {key!r}")
    if raw == "":
        return ()
    items = raw.split(",", MAX_CLIENTS)
    if len(items) > MAX_CLIENTS:
        raise MessageError(f"{key!r} lists more than {MAX_CLIENTS} clients")
    return tuple(items)  # the dataclass checks each id and the order


def _rows(tensors: Mapping[str, np.ndarray], name: str, count: int | None, size: int) -> tuple[bytes, ...]:
    a = tensors[name]
    shape = (size,) if count is None else (count, size)
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.shape != shape:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise MessageError(f"tensor {name!r} must be uint8 of shape {shape}, got {got}")
    data = np.ascontiguousarray(a).tobytes()
    return (data,) if count is None else tuple(data[i * size : (i + 1) * size] for i in range(count))


def _build(cls: type[M], **values: object) -> M:
    try:
        return cls(**values)
    except MessageError:
        raise
    except (TypeError, ValueError) as exc:
        raise MessageError(f"invalid {cls.__name__}: {exc}") from None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
