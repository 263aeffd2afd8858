import math
import struct

import pytest
import torch

from fedge.errors import CodecError
from fedge.wire.message import TASK, UPDATE, Message, decode, encode


def _msg(**tensors: torch.Tensor) -> Message:
    return Message(
        UPDATE,
        3,
        run="r1",
        client="c001",
        params={"num_examples": "12", "lr": repr(0.1 * 0.99)},
        transport={"session": "abc"},
        tensors=tensors,
    )


def test_round_trip_keeps_tensors_metadata_and_params():
    w = torch.randn(4, 3)
    n = torch.arange(5, dtype=torch.int32)
    back = decode(encode(_msg(w=w, n=n)))
    assert (back.kind, back.round, back.run, back.client) == (UPDATE, 3, "r1", "c001")
    assert torch.equal(back.tensors["w"], w) and torch.equal(back.tensors["n"], n)
    assert back.params == {"num_examples": "12", "lr": repr(0.1 * 0.99)}
    assert back.transport == {"session": "abc"}  # kept apart from the algorithm's fields


def test_tensor_bytes_is_numel_times_itemsize():
    m = _msg(a=torch.zeros(10, 10), b=torch.zeros(3, dtype=torch.int64), c=torch.zeros(2, dtype=torch.float16))
    assert m.tensor_bytes == 400 + 24 + 4
    assert len(encode(m)) > m.tensor_bytes  # payload adds the header


def test_empty_message_round_trips():
    back = decode(encode(Message(TASK, 1, client="c000", params={"algorithm": "fedavg"})))
    assert back.tensors == {} and back.param("algorithm") == "fedavg"


def test_a_metadata_only_payload_is_checked_as_strictly_without_torch():
    # decode reads a message without tensors through safetensors' own layout checks, not torch's loader
    blob = encode(Message(TASK, 1, client="c000", params={"algorithm": "fedavg"}))
    with pytest.raises(CodecError, match="tensor data is malformed"):
        decode(blob + b"extra bytes")
    with pytest.raises(CodecError, match="exceeds the payload"):
        decode(blob[:-1])


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "too short"),
        (b"garbage!garbage", "exceeds the payload"),
        (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 2) + b"{}", "metadata is missing"),
    ],
)
def test_malformed_payloads_raise_codec_error(blob: bytes, reason: str):
    with pytest.raises(CodecError, match=reason):
        decode(blob)


def test_truncated_tensor_data_is_rejected():
    blob = encode(_msg(w=torch.randn(100)))
    with pytest.raises(CodecError, match="tensor data is malformed"):
        decode(blob[:-40])


def test_non_finite_values_are_rejected():
    with pytest.raises(CodecError, match="non-finite"):
        decode(encode(_msg(w=torch.tensor([1.0, math.nan]))))
    with pytest.raises(CodecError, match="non-finite"):
        decode(encode(_msg(w=torch.tensor([math.inf]))))


def test_a_float_dtype_torch_cannot_check_is_a_codec_error_not_a_traceback():
    # torch has no isfinite for float8: a peer's status or reply holding one must be refused like any bad payload.
    with pytest.raises(CodecError, match="cannot be checked"):
        decode(encode(_msg(w=torch.zeros(2).to(torch.float8_e4m3fn))))


def test_wrong_schema_and_missing_metadata():
    blob = encode(_msg(w=torch.ones(1)))
    with pytest.raises(CodecError, match="schema"):
        decode(blob.replace(b'"schema":"1"', b'"schema":"9"'))
    with pytest.raises(CodecError, match="round"):
        decode(blob.replace(b'"round":"3"', b'"round":"x"'))


def test_missing_param_and_tensor_name_what_is_missing():
    m = _msg(w=torch.ones(1))
    with pytest.raises(CodecError, match="'epochs'"):
        m.param("epochs")
    with pytest.raises(CodecError, match="lacks tensor 'v'"):
        m.tensor("v")


def test_params_must_be_strings():
    with pytest.raises(CodecError, match="metadata must map str to str, got 'lr': float"):
        Message(TASK, 1, params={"lr": 0.1})  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="metadata must map str to str, got 'session': float"):
        Message(TASK, 1, transport={"session": math.nan})  # type: ignore[dict-item]
