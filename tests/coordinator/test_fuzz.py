"""Fuzzing the coordinator's reply path: >= 10,000 mutated updates through the one reply policy and aggregation.

Every payload a client could send reaches :func:`coordinator.replies.judge_reply` (both transports call it) and, if
accepted, the strategy's aggregation. The mutations start from real updates of a real client: bit flips,
truncations, header edits (numbers huge, tiny, negative, not numbers; strings long or full of control characters;
dtypes, shapes and offsets changed), tensor values set to NaN, infinities, 3e38, subnormals or scaled, tensors added
or removed, junk appended. The test asserts: nothing escapes as an exception, each payload is either rejected with a
category and a clean reason or accepted only when it is valid and within bounds, aggregation of accepted updates never
fails and stays finite, and memory stays flat.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import struct
import time

import torch

from coordinator.replies import CATEGORIES, RoundContext, judge_reply
from edge_client.client import EdgeClient
from fedge.aggregation.robust import state_norm, update_norm
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.wire.message import decode, encode
from fedge_io.experiment import prepare

MUTANTS = 10_000
NASTY_NUMBERS = [
    "1" * 400,
    "-1",
    "-0",
    "0",
    "nan",
    "inf",
    "-inf",
    "1e400",
    "3e38",
    "1e-45",
    "9" * 20,
    "0x10",
    " 5",
    "5 ",
]
NASTY_STRINGS = ["", "\n\nforged log line", "\x00\x1b[2J", "é" * 300, "A" * 5_000_000, "c001\r\nround 9"]
NASTY_VALUES = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-45]


def _setting():
    config = RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=1,
        train=TrainConfig(local_epochs=1, batch_size=32),
        algo=FedAvgSettings(robust="median"),
    )
    exp = prepare(config)
    strategy = exp.strategy("fuzz")
    plan = strategy.configure(1, sorted(exp.parts))
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    replies = {}
    for cid in sorted(exp.parts):
        client = EdgeClient(cid, exp.client_data(cid), backend)
        replies[cid] = encode(client.handle(plan.tasks[cid], plan.broadcast))
    sizes = {cid: len(idx) for cid, idx in exp.parts.items()}
    return strategy, replies, sizes


def _split(payload: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8 : 8 + n]), payload[8 + n :]


def _join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _mutate(payload: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(9)
    data = bytearray(payload)
    if kind == 0:  # bit flips anywhere
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 1:  # truncation
        return bytes(data[: rng.randrange(len(data))])
    if kind == 2:  # random bytes, or junk appended (oversize)
        return rng.randbytes(rng.randint(0, 64)) if rng.random() < 0.5 else payload + rng.randbytes(200_000)
    header, body = _split(payload)
    meta = header["__metadata__"]
    if kind == 3:  # metadata numbers and strings
        key = rng.choice(["param.num_examples", "param.loss", "round", "schema", "run", "client", "kind"])
        meta[key] = rng.choice(NASTY_NUMBERS + NASTY_STRINGS)
        if rng.random() < 0.3:
            meta[rng.choice(["param.extra", "transport.compute_s", "param." + "x" * 1000])] = rng.choice(NASTY_STRINGS)
        return _join(header, body)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    if kind == 4:  # dtype, shape, offsets
        what = rng.randrange(3)
        if what == 0:
            entry["dtype"] = rng.choice(["F16", "F64", "I64", "BOOL", "U8", "BF16", "F8_E4M3", "XYZ"])
        elif what == 1:
            entry["shape"] = rng.choice([[], [0], [-1], [10**12], entry["shape"] + [1], entry["shape"][::-1]])
        else:
            start, end = entry["data_offsets"]
            entry["data_offsets"] = rng.choice([[end, start], [start, end + 4], [0, 10**15], [-4, end], [start, start]])
        return _join(header, body)
    if kind == 5:  # a tensor removed, or an extra one added
        if rng.random() < 0.5 and len(names) > 1:
            start, end = header.pop(name)["data_offsets"]
            return _join(header, body)  # its bytes stay, unreferenced
        header["intruder"] = {"dtype": "F32", "shape": [2], "data_offsets": [len(body), len(body) + 8]}
        return _join(header, body + struct.pack("<2f", 1.0, 2.0))
    if kind == 6:  # nasty values inside a tensor
        start, end = entry["data_offsets"]
        if entry["dtype"] == "F32" and end > start:
            values = torch.frombuffer(bytearray(body[start:end]), dtype=torch.float32).clone()
            idx = torch.randint(0, len(values), (rng.randint(1, 4),))
            values[idx] = rng.choice(NASTY_VALUES)
            body = body[:start] + values.numpy().tobytes() + body[end:]
        return _join(header, body)
    if kind == 7:  # the whole update scaled: a model-replacement attack (DS-FL eq. 19)
        msg = decode(payload)
        scale = rng.choice([1e3, 1e6, -50.0, 1e30])
        tensors = {k: v * scale for k, v in msg.tensors.items()}
        return encode(type(msg)(msg.kind, msg.round, msg.run, msg.client, msg.params, tensors, msg.transport))
    meta["param.num_examples"] = str(rng.choice([10**12, 2**40, 2**41, 10**6]))  # a claim beyond its data
    return _join(header, body)


def _rss_bytes() -> int:
    """Resident memory of this process (Linux), after glibc returned freed heap pages: held memory, not arenas."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_ten_thousand_mutated_updates_never_crash_and_only_valid_ones_pass() -> None:
    logging.getLogger("coordinator.replies").setLevel(logging.ERROR)  # 10,000 warnings would dominate the time
    strategy, replies, sizes = _setting()
    reference = strategy.global_weights()
    bound = strategy.settings.max_update_ratio * max(state_norm(reference), 1.0)
    rng = random.Random(0)
    clients = sorted(replies)
    accepted: list = []  # the last few accepted updates (kept few: memory must stay flat)
    categories: set[str] = set()
    n_accepted = 0
    started = time.perf_counter()
    baseline = None
    for i in range(MUTANTS):
        if i == 1000:
            baseline = _rss_bytes()
        sender = rng.choice(clients)
        payload = _mutate(replies[sender], rng)
        ctx = RoundContext(
            1,
            frozenset(clients),
            lambda c, m: strategy.accept(1, c, m),
            known=lambda c: c in sizes,
            declared=sizes.get,
            max_payload=100_000,
        )
        judged = judge_reply(payload, sender, ctx)  # must never raise
        if judged.rejection is not None:
            r = judged.rejection
            assert r.category in CATEGORIES, r
            assert r.detail.isprintable() and len(r.detail) <= 200, r.detail[:100]
            categories.add(r.category)
            continue
        msg = judged.message
        assert msg is not None and judged.checked is not None
        # Accepted only when valid and within bounds, judged independently of the policy's code.
        assert set(msg.tensors) == set(reference)
        for k, v in msg.tensors.items():
            assert v.shape == reference[k].shape and v.dtype == reference[k].dtype
            assert bool(torch.isfinite(v).all())
        assert 0 <= int(msg.params["num_examples"]) <= sizes[sender]
        assert update_norm(dict(msg.tensors), reference) <= bound
        accepted = [*accepted[-2:], judged.checked]
        n_accepted += 1
        if n_accepted % 3 == 0:  # aggregation of accepted updates must not fail either
            batch = {f"c{j}": m for j, m in enumerate(accepted)}
            strategy.aggregate(1, batch)
            assert all(bool(torch.isfinite(v).all()) for v in strategy.global_weights().values())
            strategy._weights = reference  # judge the next ones against the same broadcast
    elapsed = time.perf_counter() - started
    assert elapsed < 600, f"{MUTANTS} payloads took {elapsed:.1f} s"  # a hang guard, not a speed gate: 15-70 s
    assert baseline is not None
    grown = _rss_bytes() - baseline
    assert grown < 64_000_000, f"memory grew by {grown / 1e6:.0f} MB over 9,000 payloads"
    # The mutations reach every kind of refusal a single client can cause.
    assert {"unparseable", "invalid", "oversize", "wrong sender", "wrong round"} <= categories, categories
    assert n_accepted, "some mutations (e.g. flipped low bits of a weight) are still valid updates"
