"""Tensor codecs: hand-computed cases, round trips within each stated bound, error feedback, hostile inputs."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fedge.compression.codecs import (
    MAX_K,
    Residual,
    Scheme,
    TensorSpec,
    coded_bytes,
    coded_specs,
    decode,
    encode,
    encode_with_feedback,
    raw_bytes,
    specs,
)
from fedge.errors import CodecError, ConfigError

ROWS_INT8 = Scheme("int8", granularity="row", offset=True)
ROWS_TOPK2 = Scheme("topk", granularity="row", k=2)


def _round_trip(tensors: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    enc = encode(tensors, scheme)
    return decode(enc.tensors, enc.meta, specs(tensors), scheme=scheme)


def _probs(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(rows, cols, generator=g), dim=1)  # (N, C)


# --- the scheme ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme",
    [
        Scheme(),
        Scheme("float16", delta=True),
        ROWS_INT8,
        Scheme("int8", granularity="block", block=4096, stochastic=True, side="float16", delta=True),
        ROWS_TOPK2,
        Scheme("topk", density=0.01, delta=True),
    ],
)
def test_scheme_round_trips_through_metadata(scheme: Scheme) -> None:
    meta = scheme.to_meta()
    assert all(k.startswith("codec.") and isinstance(v, str) for k, v in meta.items())
    assert Scheme.from_meta(meta) == scheme
    assert Scheme.from_meta(scheme.to_meta("up."), "up.") == scheme


def test_metadata_holds_only_the_name_and_what_differs_from_defaults() -> None:
    assert Scheme().to_meta() == {"codec.name": "float32"}
    assert ROWS_TOPK2.to_meta() == {"codec.name": "topk", "codec.granularity": "row", "codec.k": "2"}
    assert ROWS_TOPK2.label == "topk(granularity=row, k=2)"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"name": "zstd"}, "unknown compression scheme 'zstd'"),
        ({"name": "int8", "granularity": "block"}, "int8 needs block > 0 exactly when"),  # block size missing
        ({"name": "int8", "block": 64}, "int8 needs block > 0 exactly when"),  # without block granularity
        ({"name": "int8", "k": 3}, "scheme 'int8' takes no k"),  # a top-k field on int8
        ({"name": "float16", "side": "float16"}, "scheme 'float16' takes no side"),
        ({"name": "topk"}, "topk needs exactly one of k > 0 or density"),  # neither
        ({"name": "topk", "k": 2, "density": 0.5}, "topk needs exactly one of k > 0 or density"),  # both
        ({"name": "topk", "granularity": "block", "block": 8, "k": 1}, "scheme 'topk' takes no block"),
        ({"name": "int8", "side": "bfloat16"}, "side dtype must be float32 or float16, got 'bfloat16'"),
        ({"name": "topk", "k": MAX_K + 1}, f"k in 0..{MAX_K}"),
        ({"name": "topk", "density": 1.5}, "density must be in [0, 1], got 1.5"),
    ],
)
def test_invalid_schemes_are_refused_naming_the_field(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        Scheme(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({}, "declares no compression scheme"),
        ({"codec.name": "lzma"}, "unknown compression scheme"),
        ({"codec.name": "topk", "codec.k": str(MAX_K + 1)}, "outside"),
        ({"codec.name": "topk", "codec.k": "9" * 30}, "not an integer"),
        ({"codec.name": "topk", "codec.density": "nan"}, "not a finite number"),
        ({"codec.name": "int8", "codec.offset": "yes"}, "must be 0 or 1"),
        ({"codec.name": "int8", "codec.bits": "4"}, "unknown compression fields"),
    ],
)
def test_hostile_scheme_metadata_is_a_codec_error(meta: dict[str, str], reason: str) -> None:
    with pytest.raises(CodecError, match=reason):
        Scheme.from_meta(meta)


# --- float16 ------------------------------------------------------------------------------------------------------


def test_float16_relative_error_bound() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=g) * torch.logspace(-9, 4, 5000)  # (5000,) subnormal to large
    back = _round_trip({"x": x}, Scheme("float16"))["x"]
    assert back.dtype == torch.float32
    assert bool(((back - x).abs() <= 2**-11 * x.abs() + 2**-25).all())


def test_float16_refuses_values_beyond_its_range() -> None:
    with pytest.raises(CodecError, match="float16's range"):
        encode({"x": torch.tensor([1.0, 70000.0])}, Scheme("float16"))


# --- int8 ---------------------------------------------------------------------------------------------------------


def test_int8_symmetric_hand_computed() -> None:
    x = torch.tensor([127.0, -3.4, 2.5, 0.6])  # max |x| = 127: scale 1
    enc = encode({"w": x}, Scheme("int8"))
    assert enc.tensors["w"].dtype == torch.int8
    assert enc.tensors["w"].tolist() == [127, -3, 2, 1]  # 2.5 rounds half to even
    assert enc.tensors["w:scale"].tolist() == [1.0]
    back = decode(enc.tensors, enc.meta, specs({"w": x}))["w"]
    assert back.tolist() == [127.0, -3.0, 2.0, 1.0]  # errors 0, 0.4, 0.5, 0.4 <= scale / 2


def test_int8_offset_hand_computed() -> None:
    x = torch.tensor([[10.0, 265.0, 110.4, 17.5]])  # min 10, max 265: offset 10, scale 1
    enc = encode({"p": x}, ROWS_INT8)
    assert enc.tensors["p"].dtype == torch.uint8
    assert enc.tensors["p"].tolist() == [[0, 255, 100, 8]]
    assert (enc.tensors["p:offset"].tolist(), enc.tensors["p:scale"].tolist()) == ([10.0], [1.0])
    assert decode(enc.tensors, enc.meta, specs({"p": x}))["p"].tolist() == [[10.0, 265.0, 110.0, 18.0]]


def _scale_per_value(enc_scale: torch.Tensor, numel: int, unit: int) -> torch.Tensor:
    return enc_scale.float().repeat_interleave(unit)[:numel]  # (n,)


@pytest.mark.parametrize(
    ("scheme", "shape", "unit"),
    [
        (Scheme("int8"), (37, 29), 37 * 29),
        (Scheme("int8", granularity="block", block=100), (37, 29), 100),  # 1073 values: a short last block
        (Scheme("int8", granularity="block", block=64, side="float16"), (7, 3, 5), 64),
        (ROWS_INT8, (50, 10), 10),
        (Scheme("int8", granularity="row", offset=True, side="float16"), (50, 10), 10),
        (Scheme("int8", granularity="row"), (50, 10), 10),
    ],
)
def test_int8_error_is_at_most_half_the_scale(scheme: Scheme, shape: tuple[int, ...], unit: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g) * 0.3 + (0.5 if scheme.offset else 0.0)
    enc = encode({"x": x}, scheme)
    back = decode(enc.tensors, enc.meta, specs({"x": x}), scheme=scheme)["x"]
    scale = _scale_per_value(enc.tensors["x:scale"], x.numel(), unit)  # (n,) the scale on the wire
    err = (back - x).abs().reshape(-1)  # (n,)
    assert bool((err <= scale / 2 * (1 + 1e-5) + 1e-6).all())
    # The scale (and offset) each unit needs, computed here from the values: a float16 side rounds the scale up and
    # the offset down, by at most one float16 step; float32 keeps them.
    units = x.reshape(-1).split(unit)
    if scheme.offset:
        need = torch.stack([(u.max() - u.min()) / 255 for u in units])  # (units,)
        lo, wire_lo = torch.stack([u.min() for u in units]), enc.tensors["x:offset"].float()
        torch.testing.assert_close(wire_lo, lo, rtol=2**-10, atol=0)
        assert bool((wire_lo <= lo).all())
    else:
        need = torch.stack([u.abs().max() / 127 for u in units])  # (units,)
    wire = enc.tensors["x:scale"].float()
    torch.testing.assert_close(wire, need, rtol=2**-10 if scheme.side == "float16" else 1e-6, atol=0)
    assert bool((wire >= need * (1 - 1e-6)).all())
    assert enc.tensor_bytes == coded_bytes(specs({"x": x}), scheme)


def test_int8_stochastic_rounding_is_seeded_unbiased_and_within_one_scale() -> None:
    scheme = Scheme("int8", granularity="block", block=16, stochastic=True)
    x = torch.linspace(-1, 1, 64)  # (64,)
    runs = []
    for seed in range(400):
        enc = encode({"x": x}, scheme, generator=torch.Generator().manual_seed(seed))
        back = decode(enc.tensors, enc.meta, specs({"x": x}))["x"]
        scale = _scale_per_value(enc.tensors["x:scale"], 64, 16)
        assert bool(((back - x).abs() < scale * (1 + 1e-6)).all())
        runs.append(back)
    again = encode({"x": x}, scheme, generator=torch.Generator().manual_seed(7)).tensors["x"]
    assert torch.equal(again, encode({"x": x}, scheme, generator=torch.Generator().manual_seed(7)).tensors["x"])
    mean = torch.stack(runs).mean(0)  # (64,)
    assert float((mean - x).abs().max()) < 0.25 * float(x.abs().max()) / 127  # 400 draws: bias far below a step
    with pytest.raises(ConfigError, match="Generator"):
        encode({"x": x}, scheme)


def test_int8_float16_side_refuses_scales_beyond_its_range() -> None:
    with pytest.raises(CodecError, match="side='float32'"):
        encode({"x": torch.tensor([1e8, -1e8])}, Scheme("int8", side="float16"))


# --- top-k --------------------------------------------------------------------------------------------------------


def test_topk_row_hand_computed_spreads_the_dropped_mass() -> None:
    p = torch.tensor([[0.125, 0.5, 0.0625, 0.3125]])  # sums to 1; k = 2 keeps classes 1 and 3
    enc = encode({"p": p}, ROWS_TOPK2)
    assert enc.tensors["p:index"].tolist() == [[1, 3]] and enc.tensors["p:index"].dtype == torch.uint8
    assert enc.tensors["p"].tolist() == [[0.5, 0.3125]]
    assert enc.tensors["p:mass"].tolist() == [0.1875]
    back = decode(enc.tensors, enc.meta, specs({"p": p}))["p"]
    assert back.tolist() == [[0.09375, 0.5, 0.09375, 0.3125]]


@pytest.mark.parametrize("cols", [10, 1000])
def test_topk_rows_keep_values_exactly_and_stay_probability_vectors(cols: int) -> None:
    p = _probs(200, cols)  # (200, C)
    scheme = Scheme("topk", granularity="row", k=3)
    enc = encode({"p": p}, scheme)
    assert enc.tensors["p:index"].dtype == (torch.uint8 if cols <= 256 else torch.int16)
    back = decode(enc.tensors, enc.meta, specs({"p": p}), scheme=scheme)["p"]
    top = p.topk(3, dim=1).indices  # (200, 3)
    assert torch.equal(back.gather(1, top), p.gather(1, top))  # kept entries exact
    assert torch.allclose(back.sum(1), torch.ones(200), atol=1e-6)
    assert bool((back >= 0).all())
    dropped = back.scatter(1, top, -1.0)  # (200, C) kept entries masked
    assert bool((dropped.max(1).values <= back.gather(1, top).min(1).values).all())  # still the same top 3


def test_topk_rows_of_logits_keep_their_sum() -> None:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(40, 10, generator=g) * 4  # (40, 10) logits, negative entries too
    back = _round_trip({"z": z}, Scheme("topk", granularity="row", density=0.3))["z"]
    assert torch.allclose(back.sum(1), z.sum(1), atol=1e-4)


def test_topk_float16_side_bounds_and_byte_count() -> None:
    p = _probs(1000, 10)
    scheme = Scheme("topk", granularity="row", k=2, side="float16")
    enc = encode({"p": p}, scheme)
    assert (enc.tensor_bytes, enc.raw_bytes) == (1000 * 2 * 2 + 1000 * 2 * 1 + 1000 * 2, 40_000)  # values, idx, mass
    back = decode(enc.tensors, enc.meta, specs({"p": p}))["p"]
    top = p.topk(2, dim=1).indices
    kept, true = back.gather(1, top), p.gather(1, top)
    assert bool(((kept - true).abs() <= 2**-11 * true + 2**-25).all())
    assert torch.allclose(back.sum(1), torch.ones(1000), atol=2e-3) and bool((back >= 0).all())


def test_topk_tensor_keeps_the_largest_magnitudes_and_zeros_the_rest() -> None:
    d = torch.tensor([[0.1, -3.0, 0.2], [2.0, -0.05, 0.0]])  # density 1/3 of 6 values: k = 2
    scheme = Scheme("topk", density=1 / 3, delta=True)
    enc = encode({"d": d}, scheme, reference={"d": torch.zeros(2, 3)})
    assert enc.tensors["d:index"].tolist() == [[1, 3]]
    back = decode(enc.tensors, enc.meta, scheme=scheme, reference={"d": torch.zeros(2, 3)})["d"]
    assert back.tolist() == [[0.0, -3.0, 0.0], [2.0, 0.0, 0.0]]


# --- deltas and error feedback ------------------------------------------------------------------------------------


def test_delta_is_taken_against_the_reference_and_added_back() -> None:
    g = torch.Generator().manual_seed(4)
    ref = {"w": torch.randn(300, generator=g), "b": torch.randn(4, generator=g)}
    new = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in ref.items()}
    scheme = Scheme("int8", delta=True)
    enc = encode(new, scheme, reference=ref)
    back = decode(enc.tensors, enc.meta, scheme=scheme, reference=ref)
    for k in new:
        assert float((back[k] - new[k]).abs().max()) <= float(enc.tensors[f"{k}:scale"]) / 2 + 1e-6
    assert float(enc.tensors["w:scale"]) < 0.05 / 127  # the scale follows the small delta, not the weights
    with pytest.raises(CodecError, match="no reference"):
        decode(enc.tensors, enc.meta, specs(new))


@pytest.mark.parametrize(
    "scheme",
    [Scheme("topk", density=0.05, delta=True), Scheme("int8", granularity="block", block=32, stochastic=True)],
)
def test_error_feedback_sent_plus_residual_equals_the_true_deltas(scheme: Scheme) -> None:
    g = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(20, 10, generator=g), "b": torch.randn(10, generator=g)}
    residual, sent_total, true_total = Residual(), {}, {}
    for _ in range(6):
        delta = {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        local = {k: base[k] + delta[k] for k in base}
        ref = base if scheme.delta else None
        values = local if scheme.delta else delta
        enc, residual = encode_with_feedback(values, scheme, residual, reference=ref, generator=g)
        got = decode(enc.tensors, enc.meta, specs(base), scheme=scheme, reference=ref)
        for k in base:
            sent = got[k] - base[k] if scheme.delta else got[k]
            sent_total[k] = sent_total.get(k, 0) + sent
            true_total[k] = true_total.get(k, 0) + delta[k]
        base = {k: base[k] + 0.5 * delta[k] for k in base}  # the next round's broadcast
    for k in base:
        assert torch.allclose(sent_total[k] + residual.tensors[k], true_total[k], atol=1e-5)
        assert float(residual.tensors[k].abs().max()) > 0  # something was held back


def test_residual_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ConfigError, match="residual"):
        encode_with_feedback({"w": torch.zeros(3)}, Scheme("int8"), Residual({"w": torch.zeros(4)}))


# --- what the receiver refuses ------------------------------------------------------------------------------------


def test_wrong_or_absent_declared_scheme_is_rejected_with_a_reason() -> None:
    p = _probs(8, 10)
    enc = encode({"p": p}, ROWS_INT8)
    with pytest.raises(CodecError, match=r"declares compression int8\(granularity=row, offset\), expected topk"):
        decode(enc.tensors, enc.meta, specs({"p": p}), scheme=ROWS_TOPK2)
    with pytest.raises(CodecError, match="declares no compression scheme"):
        decode(enc.tensors, {}, specs({"p": p}), scheme=ROWS_INT8)
    # A peer that lies about its scheme: int8 codes declared as float16 do not have float16's layout.
    lying = {"codec.name": "float16"}
    with pytest.raises(CodecError, match="unexpected"):
        decode(enc.tensors, lying, specs({"p": p}))


def _coded(scheme: Scheme, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(encode({"x": x}, scheme).tensors)


@pytest.mark.parametrize(
    ("scheme", "tamper", "reason"),
    [
        (ROWS_INT8, lambda t: t.pop("x:offset"), "missing"),
        (ROWS_INT8, lambda t: t.update({"x:extra": torch.zeros(1)}), "unexpected"),
        (ROWS_INT8, lambda t: t.update({"y": torch.zeros(1)}), "unexpected"),
        (ROWS_INT8, lambda t: t.update({"x": t["x"][:4]}), "must be"),  # fewer rows than expected
        (ROWS_INT8, lambda t: t.update({"x": t["x"].to(torch.int8)}), "must be"),
        (ROWS_INT8, lambda t: t.update({"x:scale": -t["x:scale"]}), "negative"),
        (ROWS_INT8, lambda t: t["x:scale"].__setitem__(0, math.inf), "non-finite"),
        (ROWS_TOPK2, lambda t: t["x:index"].__setitem__((0, 0), 11), "outside"),
        (ROWS_TOPK2, lambda t: t["x:index"].__setitem__((0, 1), int(t["x:index"][0, 0])), "repeats"),
        (ROWS_TOPK2, lambda t: t["x:mass"].__setitem__(0, math.nan), "non-finite"),
        (ROWS_TOPK2, lambda t: t.update({"x:index": t["x:index"].to(torch.int32)}), "must be"),
    ],
)
def test_inconsistent_coded_tensors_are_rejected(scheme: Scheme, tamper: object, reason: str) -> None:
    x = _probs(8, 10)
    coded = _coded(scheme, x)
    tamper(coded)  # type: ignore[operator]
    with pytest.raises(CodecError, match=reason):
        decode(coded, scheme.to_meta(), specs({"x": x}), scheme=scheme)


def test_mass_with_nothing_dropped_is_rejected() -> None:
    x = _probs(2, 3)
    scheme = Scheme("topk", granularity="row", k=3)
    coded = _coded(scheme, x)
    coded["x:mass"] = torch.tensor([0.5, 0.0])
    with pytest.raises(CodecError, match="no entry was dropped"):
        decode(coded, scheme.to_meta(), specs({"x": x}))


def test_decoded_overflow_is_rejected() -> None:
    scheme = Scheme("int8")
    coded = {"x": torch.tensor([127, 127], dtype=torch.int8), "x:scale": torch.tensor([3e38])}
    with pytest.raises(CodecError, match="non-finite"):
        decode(coded, scheme.to_meta(), {"x": TensorSpec((2,))})


# --- bytes and pass-through ---------------------------------------------------------------------------------------


def test_byte_counts_for_a_soft_label_block() -> None:
    expect = {"p": TensorSpec((1000, 10))}
    assert raw_bytes(expect) == 40_000
    assert coded_bytes(expect, Scheme("float16")) == 20_000
    assert coded_bytes(expect, ROWS_INT8) == 10_000 + 2 * 4_000  # codes, scale and offset per row
    assert coded_bytes(expect, Scheme("int8", granularity="row", offset=True, side="float16")) == 14_000
    assert coded_bytes(expect, ROWS_TOPK2) == 1000 * (2 * 4 + 2 + 4)
    assert set(coded_specs(expect, ROWS_TOPK2)) == {"p", "p:index", "p:mass"}


def test_other_dtypes_and_empty_tensors_travel_as_they_are() -> None:
    tensors = {
        "w": torch.randn(5, 4),
        "n": torch.arange(3, dtype=torch.int64),
        "h": torch.ones(2, dtype=torch.float16),
        "e": torch.zeros(0, 4),
    }
    for scheme in (Scheme("int8", granularity="row", offset=True), Scheme("topk", k=1), Scheme("float16")):
        enc = encode(tensors, scheme)
        for name in ("n", "h", "e"):
            assert enc.tensors[name] is not None and torch.equal(enc.tensors[name], tensors[name])
        back = decode(enc.tensors, enc.meta, specs(tensors), scheme=scheme)
        assert back["n"].dtype == torch.int64 and torch.equal(back["n"], tensors["n"])
        assert back["w"].dtype == torch.float32 and back["e"].shape == (0, 4)


def test_non_finite_input_and_reserved_names_are_refused() -> None:
    with pytest.raises(CodecError, match="non-finite"):
        encode({"w": torch.tensor([1.0, math.nan])}, Scheme("int8"))
    with pytest.raises(CodecError, match="must not contain"):
        encode({"w:scale": torch.zeros(2)}, Scheme("int8"))
