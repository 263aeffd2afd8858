"""Codec throughput: encode and decode MB/s of real messages, against a raw memory copy measured in the same run.

    .venv/bin/python benchmarks/codec_throughput.py [--repeats 30] [--json out.json]

Messages: the DS-FL MNIST CNN's weights (what FedAvg broadcasts and uploads, 584,458 float32 values), DS-FL soft
labels (1,000 x 10 float32) and FD per-class logits (10 x 10). "memcpy" copies the same number of bytes from one
buffer to another (numpy), the floor any serializer pays once. Ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fedge.learning.models import build_model, exchanged_state
from fedge.wire.message import BROADCAST, UPDATE, Message, decode, encode


def best_and_median(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) wall seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times), statistics.median(times)


def messages() -> dict[str, Message]:
    weights = exchanged_state(build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0))
    g = torch.Generator().manual_seed(0)
    return {
        "fedavg weights (dsfl_mnist_cnn)": Message(BROADCAST, 1, run="bench", tensors=weights),
        "dsfl soft labels 1000x10": Message(
            UPDATE, 1, run="bench", client="c000", tensors={"soft_labels": torch.rand(1000, 10, generator=g)}
        ),
        "fd logits 10x10 + counts": Message(
            UPDATE,
            1,
            run="bench",
            client="c000",
            tensors={"logits": torch.rand(10, 10, generator=g), "counts": torch.ones(10)},
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core, as on a client; and steadier numbers on a shared machine
    rows = []
    for name, msg in messages().items():
        blob = encode(msg)
        mb = len(blob) / 1e6
        src = np.frombuffer(blob, dtype=np.uint8).copy()
        dst = np.empty_like(src)
        copy_best, _ = best_and_median(lambda src=src, dst=dst: np.copyto(dst, src), args.repeats)
        enc_best, enc_med = best_and_median(lambda msg=msg: encode(msg), args.repeats)
        dec_best, dec_med = best_and_median(lambda blob=blob: decode(blob), args.repeats)
        raw_best, _ = best_and_median(lambda blob=blob: decode(blob, check_finite=False), args.repeats)
        rows.append(
            {
                "message": name,
                "payload_bytes": len(blob),
                "tensor_bytes": msg.tensor_bytes,
                "memcpy_MBps": mb / copy_best,
                "encode_MBps": mb / enc_best,
                "decode_MBps": mb / dec_best,
                "decode_unchecked_MBps": mb / raw_best,
                "encode_median_ms": 1e3 * enc_med,
                "decode_median_ms": 1e3 * dec_med,
                "encode_vs_memcpy": copy_best / enc_best,
                "decode_vs_memcpy": copy_best / dec_best,
            }
        )
    header = f"{'message':34s} {'payload':>10s} {'memcpy':>9s} {'encode':>9s} {'decode':>9s} {'dec-nochk':>9s}"
    print(header + "   encode/memcpy decode/memcpy  (MB/s, best of repeats)")
    for r in rows:
        print(
            f"{r['message']:34s} {r['payload_bytes']:>10,d} {r['memcpy_MBps']:9.0f} {r['encode_MBps']:9.0f} "
            f"{r['decode_MBps']:9.0f} {r['decode_unchecked_MBps']:9.0f}   {r['encode_vs_memcpy']:13.3f} "
            f"{r['decode_vs_memcpy']:13.3f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
