"""Compression throughput: encode and decode MB/s of every codec, against a raw memory copy measured in the same run.

    .venv/bin/python benchmarks/compression_throughput.py [--repeats 20] [--json out.json]

Inputs: a weight delta of the DS-FL MNIST CNN (584,458 float32 values, 2.3 MB; the codecs take the delta against the
broadcast and add it back, as a FedAvg upload does) and a 1,000 x 10 block of DS-FL soft labels (softmax rows).
MB/s count the uncompressed float32 bytes processed per second; "memcpy" copies that many bytes from one buffer to
another (numpy). Also: splitting an encoded 2.3 MB message into 1 MB chunks and reassembling it (SHA-256 included).
Ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fedge.compression.codecs import Residual, Scheme, decode, encode, encode_with_feedback, specs
from fedge.learning.models import build_model, exchanged_state
from fedge.wire.chunking import Reassembler, split
from fedge.wire.message import UPDATE, Message
from fedge.wire.message import encode as encode_message

DELTA_SCHEMES = {
    "float16": Scheme("float16", delta=True),
    "int8 per tensor": Scheme("int8", delta=True),
    "int8 block 4096": Scheme("int8", granularity="block", block=4096, delta=True),
    "int8 block 4096 stochastic": Scheme("int8", granularity="block", block=4096, stochastic=True, delta=True),
    "topk 1%": Scheme("topk", density=0.01, delta=True),
}
SOFT_LABEL_SCHEMES = {
    "float16": Scheme("float16"),
    "int8 per row": Scheme("int8", granularity="row", offset=True),
    "int8 per row, fp16 side": Scheme("int8", granularity="row", offset=True, side="float16"),
    "topk k=2": Scheme("topk", granularity="row", k=2),
    "topk k=2, fp16 side": Scheme("topk", granularity="row", k=2, side="float16"),
}


def best_and_median(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) wall seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times), statistics.median(times)


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return best_and_median(lambda: np.copyto(dst, src), repeats)[0]


def inputs() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, Scheme]]]:
    """(tensors, reference, schemes) per input."""
    g = torch.Generator().manual_seed(0)
    weights = exchanged_state(build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0))
    local = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in weights.items()}  # after local training
    labels = {"soft_labels": torch.softmax(3 * torch.randn(1000, 10, generator=g), dim=1)}  # (1000, 10)
    return {
        "weight delta (dsfl_mnist_cnn)": (local, weights, DELTA_SCHEMES),
        "soft labels 1000x10": (labels, None, SOFT_LABEL_SCHEMES),
    }


def row(what: str, codec: str, raw: int, coded: int, err: float, copy_s: float, enc_s: float, dec_s: float) -> dict:
    mb = raw / 1e6
    return {
        "input": what,
        "codec": codec,
        "raw_bytes": raw,
        "coded_bytes": coded,
        "max_abs_error": err,
        "memcpy_MBps": mb / copy_s,
        "encode_MBps": mb / enc_s,
        "decode_MBps": mb / dec_s,
        "encode_vs_memcpy": copy_s / enc_s,
        "decode_vs_memcpy": copy_s / dec_s,
    }


def measure_codec(
    what: str,
    codec: str,
    scheme: Scheme,
    tensors: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor] | None,
    copy_s: float,
    repeats: int,
) -> list[dict]:
    """Encode and decode timings of one codec on one input (and encode with error feedback for top-k deltas)."""
    gen = torch.Generator().manual_seed(1)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    expect = specs(tensors)
    enc = encode(tensors, scheme, reference=reference, generator=gen)
    back = decode(enc.tensors, enc.meta, expect, scheme=scheme, reference=reference)
    err = max(float((back[k] - tensors[k]).abs().max()) for k in tensors)
    enc_s, _ = best_and_median(lambda: encode(tensors, scheme, reference=reference, generator=gen), repeats)
    dec_s, _ = best_and_median(
        lambda: decode(enc.tensors, enc.meta, expect, scheme=scheme, reference=reference), repeats
    )
    rows = [row(what, codec, raw, enc.tensor_bytes, err, copy_s, enc_s, dec_s)]
    if scheme.name == "topk" and scheme.delta:  # as a client sends it, with error feedback
        residual = Residual({k: torch.zeros_like(v) for k, v in tensors.items()})
        ef_s, _ = best_and_median(lambda: encode_with_feedback(tensors, scheme, residual, reference=reference), repeats)
        rows.append(row(what, codec + " + error feedback", raw, enc.tensor_bytes, err, copy_s, ef_s, dec_s))
    return rows


def measure_chunking(what: str, tensors: dict[str, torch.Tensor], repeats: int) -> dict:
    """Split a whole float32 message into 1 MB chunks (EMQX's default limit) and reassemble it."""
    blob = encode_message(Message(UPDATE, 1, run="bench", client="c000", tensors=tensors))

    def round_trip() -> bytes | None:
        r = Reassembler()
        return [r.add("c000", c, now=0.0) for c in split(blob, 1 << 20, message_id=1)][-1].payload

    assert round_trip() == blob
    rt_s, _ = best_and_median(round_trip, repeats)
    copy_s = memcpy_seconds(len(blob), repeats)
    return row(what, "chunk split+reassemble, 1 MB", len(blob), len(blob), 0.0, copy_s, rt_s, math.nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core, as on a client; and steadier numbers on a shared machine
    rows = []
    for what, (tensors, reference, schemes) in inputs().items():
        copy_s = memcpy_seconds(sum(t.numel() * t.element_size() for t in tensors.values()), args.repeats)
        for codec, scheme in schemes.items():
            rows += measure_codec(what, codec, scheme, tensors, reference, copy_s, args.repeats)
        if reference is not None:
            rows.append(measure_chunking(what, tensors, args.repeats))
    print(
        f"{'input':30s} {'codec':34s} {'coded/raw':>9s} {'max err':>9s} {'memcpy':>8s} {'encode':>8s} {'decode':>8s}"
        "   enc/memcpy dec/memcpy  (MB/s of float32 input, best of repeats)"
    )
    for r in rows:
        print(
            f"{r['input']:30s} {r['codec']:34s} {r['coded_bytes'] / r['raw_bytes']:9.3f} {r['max_abs_error']:9.2e} "
            f"{r['memcpy_MBps']:8.0f} {r['encode_MBps']:8.0f} {r['decode_MBps']:8.0f}   "
            f"{r['encode_vs_memcpy']:10.4f} {r['decode_vs_memcpy']:10.4f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
