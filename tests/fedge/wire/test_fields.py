"""fedge.wire.fields: the first code a peer's text meets. Round trips exact, everything else a CodecError naming the
field."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.errors import CodecError, ConfigError
from fedge.wire.fields import (
    MAX_LIST,
    MAX_STRING,
    bounded,
    format_value,
    from_params,
    parse_value,
    printable,
    server_only,
    to_params,
    wire_fields,
)


@dataclasses.dataclass(frozen=True)
class Task:
    epochs: int = dataclasses.field(default=1, metadata=bounded(1, 100))
    lr: float = dataclasses.field(default=0.1, metadata=bounded(0.0, 10.0))
    shuffle: bool = True
    name: str = "a"
    classes: tuple[int, ...] = dataclasses.field(default=(), metadata=bounded(0, 9))
    seed: int | None = None
    how: str = dataclasses.field(default="mean", metadata=server_only())

    def __post_init__(self) -> None:
        if self.name == "forbidden":
            raise ConfigError("name may not be 'forbidden'")


def test_round_trip_keeps_every_type_exactly() -> None:
    task = Task(epochs=7, lr=0.1 + 0.2, shuffle=False, name="é x", classes=(0, 3, 9), seed=-5)
    params = to_params(task, prefix="t.")
    assert params == {
        "t.epochs": "7",
        "t.lr": repr(0.1 + 0.2),
        "t.shuffle": "0",
        "t.name": "é x",
        "t.classes": "0,3,9",
        "t.seed": "-5",
    }
    assert from_params(Task, params, prefix="t.") == task


def test_server_only_fields_stay_home_and_none_is_left_out() -> None:
    assert [f.name for f in wire_fields(Task)] == ["epochs", "lr", "shuffle", "name", "classes", "seed"]
    params = to_params(Task(how="median"))
    assert "how" not in params and "seed" not in params
    # a peer cannot set a server-only field, even by sending it
    assert from_params(Task, {**params, "how": "median"}).how == "mean"


def test_absent_fields_take_defaults_or_are_refused() -> None:
    assert from_params(Task, {}) == Task()
    with pytest.raises(CodecError, match="missing field 'epochs'"):
        from_params(Task, {}, defaults=False)


def test_empty_tuple_round_trips() -> None:
    assert from_params(Task, to_params(Task(classes=()))).classes == ()


@pytest.mark.parametrize(
    ("key", "raw", "message"),
    [
        ("epochs", "0", r"'epochs' = 0 is outside \[1, 100\]"),
        ("epochs", "101", "outside"),
        ("epochs", "1.0", "not an integer"),
        ("epochs", "--5", "not an integer"),
        ("epochs", "-", "not an integer"),
        ("epochs", "", "not an integer"),
        ("epochs", " 5", "not an integer"),
        ("epochs", "5_0", "not an integer"),
        ("epochs", "²", "not an integer"),  # str.isdigit() says yes, int() says no
        ("epochs", "٣", "not an integer"),  # int() would read Arabic-Indic 3
        ("epochs", "9" * 5000, "not an integer"),  # refused before int() parses it
        ("seed", str(2**53 + 1), "outside"),
        ("lr", "nan", "not a finite number"),
        ("lr", "inf", "not a finite number"),
        ("lr", "1e999", "not finite"),
        ("lr", "0x1p-3", "not a finite number"),
        ("lr", "1_0", "not a finite number"),
        ("lr", " 0.5", "not a finite number"),
        ("lr", "-0.5", r"'lr' = -0.5 is outside \[0.0, 10.0\]"),
        ("lr", "1" * 41, "not a finite number"),
        ("shuffle", "true", "must be 0 or 1"),
        ("shuffle", "2", "must be 0 or 1"),
        ("name", "x" * (MAX_STRING + 1), f"at most {MAX_STRING}"),
        ("classes", "1,,2", "not an integer"),
        ("classes", "1,10", "outside"),
        ("classes", ",".join(["1"] * (MAX_LIST + 1)), f"more than {MAX_LIST} items"),
        ("name", "forbidden", "invalid Task: name may not be 'forbidden'"),
    ],
)
def test_hostile_text_is_a_codec_error_naming_the_field(key: str, raw: str, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        from_params(Task, {key: raw})


def test_non_string_value_is_refused() -> None:
    with pytest.raises(CodecError, match="'epochs' is not a string"):
        parse_value("epochs", 5, int)  # type: ignore[arg-type]


def test_unsupported_field_type_is_refused() -> None:
    with pytest.raises(CodecError, match="unsupported type"):
        parse_value("x", "1", list)


def test_error_messages_shorten_and_escape_peer_text() -> None:
    with pytest.raises(CodecError) as info:
        from_params(Task, {"shuffle": "\n" + "y" * 100})
    text = str(info.value)
    assert "\n" not in text and "..." in text and len(text) < 120


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_never_sent(value: float) -> None:
    with pytest.raises(CodecError, match="non-finite"):
        format_value(value)


def test_unsendable_type_is_refused() -> None:
    with pytest.raises(CodecError, match="cannot send a dict field"):
        format_value({})


@given(st.integers(min_value=-(2**53), max_value=2**53))
def test_every_integer_in_range_round_trips(value: int) -> None:
    assert parse_value("n", format_value(value), int) == value


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_finite_float_round_trips_bit_exactly(value: float) -> None:
    back = parse_value("x", format_value(value), float)
    assert back == value and math.copysign(1.0, back) == math.copysign(1.0, value)


@given(st.text(max_size=64))
def test_any_text_parses_or_is_a_codec_error(raw: str) -> None:
    for hint in (int, float, bool, tuple[int, ...]):
        with contextlib.suppress(CodecError):
            parse_value("f", raw, hint)


def test_printable_escapes_control_characters_and_caps_length() -> None:
    assert printable("ok\nforged line\x1b[31m") == "ok\\nforged line\\x1b[31m"
    long = printable("z" * 1000, limit=50)
    assert len(long) == 50 and long.endswith("...")


def test_printable_keeps_ordinary_text() -> None:
    assert printable("client c003 (Jetson)") == "client c003 (Jetson)"
