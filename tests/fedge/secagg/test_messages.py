"""Messages on the wire: every kind survives to_fields/from_fields and pack/unpack; malformed input is refused with
MessageError, never a crash."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from fedge.secagg.config import RoundConfig
from fedge.secagg.errors import MessageError, SecAggConfigError
from fedge.secagg.messages import (
    BUNDLE_BYTES,
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    NeighbourKeys,
    SecAggMessage,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
    message_from_fields,
    pack,
    unpack,
)
from fedge.secagg.shamir import PRIME, SHARE_BYTES

K1, K2 = b"\x01" * 32, b"\x02" * 32
BUNDLE = b"\x03" * BUNDLE_BYTES
SHARE = b"\x00" * SHARE_BYTES

SAMPLES: list[SecAggMessage] = [
    AdvertiseKeys(2, "c1", K1, K2),
    NeighbourKeys(2, "c1", ("c2", "c3"), (K1, K2), (K2, K1)),
    NeighbourKeys(2, "c1", (), (), ()),
    EncryptedShares(2, "c1", ("c2", "c3"), (BUNDLE, BUNDLE)),
    ShareDelivery(2, "c2", ("c1",), (BUNDLE,)),
    UnmaskRequest(2, "c2", ("c1", "c3")),
    UnmaskShares(2, "c2", ("c1",), (SHARE,), ("c3", "c4"), (SHARE, b"\x01" * SHARE_BYTES)),
]


def _same(a: SecAggMessage, b: SecAggMessage) -> bool:
    if isinstance(a, MaskedInput) and isinstance(b, MaskedInput):
        return (a.round, a.client) == (b.round, b.client) and np.array_equal(a.masked, b.masked)
    return a == b


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message: SecAggMessage) -> None:
    tensors, meta = message.to_fields()
    assert all(t.dtype in (np.uint8, np.int32) for t in tensors.values())
    assert all(isinstance(v, str) for v in meta.values())
    assert _same(message_from_fields(tensors, meta), message)
    assert _same(unpack(pack(message)), message)
    assert message.wire_bytes() == len(pack(message)) >= message.tensor_bytes()


def test_masked_input_travels_as_int32_bits() -> None:
    masked = np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32)
    message = MaskedInput(5, "c9", masked)
    tensors = message.to_fields()[0]
    assert tensors["masked"].dtype == np.int32 and tensors["masked"][3] == -1
    back = unpack(pack(message))
    assert isinstance(back, MaskedInput) and back.masked.dtype == np.uint32
    np.testing.assert_array_equal(back.masked, masked)
    assert message.tensor_bytes() == 16


def _fields(message: SecAggMessage) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    tensors, meta = message.to_fields()
    return dict(tensors), dict(meta)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t, m: m.update({"secagg.kind": "secagg.nope"}), "unknown"),
        (lambda t, m: m.update({"secagg.round": "-1"}), "round"),
        (lambda t, m: m.update({"secagg.round": "1e3"}), "round"),
        (lambda t, m: m.update({"secagg.client": "c/1"}), "client id"),
        (lambda t, m: m.update({"secagg.client": "x" * 65}), "client id"),
        (lambda t, m: m.update({"secagg.peers": "c3,c2"}), "sorted"),
        (lambda t, m: m.update({"secagg.peers": "c2,c2"}), "sorted"),
        (lambda t, m: m.update({"secagg.peers": "c2"}), "shape"),
        (lambda t, m: m.pop("secagg.peers"), "lacks"),
        (lambda t, m: t.update({"c_publics": t["c_publics"][:, :31]}), "shape"),
        (lambda t, m: t.update({"c_publics": t["c_publics"].astype(np.int32)}), "uint8"),
        (lambda t, m: t.update({"extra": np.zeros(1, np.uint8)}), "carries tensors"),
        (lambda t, m: t.pop("s_publics"), "carries tensors"),
    ],
)
def test_malformed_neighbour_keys_are_refused(edit: Callable[[dict, dict], object], match: str) -> None:
    tensors, meta = _fields(SAMPLES[1])
    edit(tensors, meta)
    with pytest.raises(MessageError, match=match):
        message_from_fields(tensors, meta)


def test_malformed_unmask_shares_are_refused() -> None:
    tensors, meta = _fields(SAMPLES[-1])
    tensors["s_shares"] = tensors["s_shares"].copy()
    tensors["s_shares"][0] = 0xFF  # 2^528 - 1 > p
    with pytest.raises(MessageError, match="outside the field"):
        message_from_fields(tensors, meta)
    with pytest.raises(MessageError, match="both shares"):
        UnmaskShares(2, "c2", ("c1",), (SHARE,), ("c1",), (SHARE,))
    big = (PRIME).to_bytes(SHARE_BYTES, "big")
    with pytest.raises(MessageError, match="outside the field"):
        UnmaskShares(2, "c2", ("c1",), (big,), (), ())


def test_malformed_masked_input_is_refused() -> None:
    meta = _fields(MaskedInput(1, "c1", np.zeros(4, dtype=np.uint32)))[1]
    for bad in (np.zeros(4, np.float32), np.zeros((2, 2), np.int32), np.zeros(0, np.int32)):
        with pytest.raises(MessageError):
            message_from_fields({"masked": bad}, meta)
    with pytest.raises(MessageError, match="expected"):
        MaskedInput.from_fields(*_fields(SAMPLES[0]))


def test_garbage_blobs_are_refused() -> None:
    for blob in (b"", b"\x00" * 7, b"\xff" * 100, pack(SAMPLES[0])[:-5]):
        with pytest.raises(MessageError):
            unpack(blob)


def _config(**overrides: object) -> RoundConfig:
    values: dict[str, object] = dict(
        run="r", session="s", round=4, clients=["c3", "c1", "c2", "c4"], round_seed=b"\x09" * 32, dim=10, bound=2.0
    )
    values.update(overrides)
    return RoundConfig.new(**values)  # type: ignore[arg-type]


def test_config_round_trip_and_defaults() -> None:
    config = _config()
    assert config.clients == ("c1", "c2", "c3", "c4")
    assert (config.degree, config.threshold, config.min_survivors) == (3, 2, 2)
    assert config.x_of("c1") == 1 and config.x_of("c4") == 4
    back = RoundConfig.from_fields(*config.to_fields())
    assert back == config and back.graph == config.graph


def test_config_refuses_inconsistent_values() -> None:
    with pytest.raises(SecAggConfigError, match="threshold"):
        _config(threshold=4)
    with pytest.raises(SecAggConfigError, match="degree"):
        _config(degree=4)
    with pytest.raises(SecAggConfigError, match="at least 2"):
        _config(clients=["c1"])
    with pytest.raises(SecAggConfigError, match="valid client id"):
        _config(clients=["c1", "c 2"])
    tensors, meta = _config().to_fields()
    for key, value in (("frac_bits", "40"), ("frac_bits", "99999999999"), ("bound", "nan"), ("clients", "c1,c1")):
        bad = dict(meta) | {f"secagg.config.{key}": value}
        with pytest.raises(MessageError):
            RoundConfig.from_fields(tensors, bad)
    with pytest.raises(MessageError, match="round_seed"):
        RoundConfig.from_fields({"secagg.round_seed": np.zeros(31, np.uint8)}, meta)
