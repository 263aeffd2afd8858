"""Compression between the algorithms and the transports: what a round's messages carry when a run compresses.

An algorithm never sees a coded tensor. On the server, :class:`fedge.algorithms.compressed.CompressedStrategy`
wraps the algorithm's strategy with the run's :class:`Compression`: it encodes the round's broadcast, tells every task
which scheme its reply must use, and decodes each reply (refusing one that declares another scheme, or whose coded
tensors do not fit) before the algorithm's own checks and aggregation see it. On a client, :func:`decode_broadcast`
and :func:`encode_update` do the same around the client half (see :func:`fedge.algorithms.run_client_step`).

What travels, in a message's params (besides the coded tensors, see :mod:`fedge.compression.codecs`):

- broadcast: ``codec.*`` (its scheme) and ``codec-shape.<name>`` for each compressed tensor (a client has no other
  way to know the shape of, e.g., DS-FL's soft labels before decoding them);
- task: ``codec.up.*``, the scheme of the reply, and ``codec-feedback`` = ``1`` when the client keeps error feedback;
- update and broadcast: ``codec-raw``, the bytes of the uncompressed float32 tensors (the ledger's "uncompressed"
  column; informative only).

Weight uploads travel as deltas against the round's broadcast *as the client decoded it* (both sides hold it), with
zeros as the reference of tensors that have no counterpart in the broadcast; top-k weight uploads keep client-side
error feedback (:class:`fedge.compression.codecs.Residual`) in the client's store, which a new coordinator session
resets. Aggregation works on decoded float32 tensors; sampling and seeds never depend on compression.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace

import torch

from fedge.compression import codecs as cz
from fedge.compression.codecs import Residual, Scheme, TensorSpec
from fedge.errors import CodecError, ConfigError
from fedge.wire.message import MAX_PAYLOAD_BYTES, Message
from fedge.wire.protocol import RAW_BYTES, SESSION

UPLOAD_PREFIX = "codec.up."
SHAPE_PREFIX = "codec-shape."
FEEDBACK = "codec-feedback"
_RESIDUAL = "codec.residual."
_SESSION_KEY = "codec.session"
_MAX_VALUES = MAX_PAYLOAD_BYTES // 4  # a declared shape never makes a client allocate more than a message may hold


@dataclass(frozen=True)
class Compression:
    """The schemes of one run: uploads (client -> server) and the broadcast (server -> clients)."""

    upload: Scheme = field(default_factory=Scheme)
    broadcast: Scheme = field(default_factory=Scheme)
    weights: bool = True  # the algorithm exchanges model weights (uploads are deltas) rather than outputs

    @classmethod
    def parse(cls, upload_codec: str, broadcast_codec: str, *, weights: bool) -> Compression:
        """The schemes ``--upload-codec`` and ``--broadcast-codec`` name, for an algorithm that exchanges model
        weights (``weights``) or outputs; ConfigError for one that cannot apply (:attr:`fedge.config.RunConfig.
        compression` is a run's)."""
        # Outputs (soft labels, logits) are compressed row by row unless told otherwise; weights per tensor.
        unit = "tensor" if weights else "row"
        upload = Scheme.parse(upload_codec, granularity=unit)
        broadcast = Scheme.parse(broadcast_codec, granularity=unit)
        if weights and broadcast.name not in ("float32", "float16"):
            raise ConfigError(
                f"--broadcast-codec {broadcast_codec}: a weight broadcast can be float32 or float16 only "
                "(a client sampled for the first time holds no earlier model to decode a delta against)"
            )
        if weights and upload.name != "float32":
            upload = replace(upload, delta=True)  # an update's change is small and centred: quantize that
        return cls(upload, broadcast, weights)

    @property
    def active(self) -> bool:
        return self.upload.name != "float32" or self.broadcast.name != "float32"

    @property
    def feedback(self) -> bool:
        """Clients keep what a top-k weight upload did not send (error feedback)."""
        return self.weights and self.upload.name == "topk"

    def probability_error(self) -> float:
        """The largest error the upload scheme adds to one value in [0, 1] (probability rows): what an
        algorithm's row-sum check must allow per entry."""
        s = self.upload
        if s.name == "float16":
            return 2.0**-11
        if s.name == "int8":
            step = 1.0 / 255.0 if s.offset else 1.0 / 127.0
            step *= 1.0 + 2.0**-10 if s.side == "float16" else 1.0  # the scale rounded up to float16
            return step if s.stochastic else step / 2.0
        return 0.0  # float32; top-k keeps each row's sum and its values' order


# --- both sides -----------------------------------------------------------------------------------------------------


def delta_reference(expect: Mapping[str, TensorSpec], broadcast: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a weight upload is a delta against: the broadcast's tensor of the same name and shape, else zeros."""
    out = {}
    for name, spec in expect.items():
        if spec.dtype != torch.float32:
            continue
        ref = broadcast.get(name)
        fits = ref is not None and ref.dtype == torch.float32 and tuple(ref.shape) == spec.shape
        out[name] = ref if fits and ref is not None else torch.zeros(spec.shape)
    return out


def _declared_specs(message: Message) -> dict[str, TensorSpec]:
    """The tensors a coded broadcast stands for: declared shapes of the compressed ones, the rest as they came."""
    expect: dict[str, TensorSpec] = {}
    total = 0
    for key, raw in message.params.items():
        if not key.startswith(SHAPE_PREFIX):
            continue
        name = key[len(SHAPE_PREFIX) :]
        try:
            shape = tuple(int(d) for d in raw.split(",")) if raw else ()
        except ValueError:
            raise CodecError(f"broadcast declares a malformed shape for {name[:60]!r}") from None
        if len(shape) > 8 or any(d < 0 for d in shape):
            raise CodecError(f"broadcast declares an impossible shape for {name[:60]!r}")
        total += math.prod(shape)
        if total > _MAX_VALUES:
            raise CodecError("broadcast declares more values than a message may hold")
        expect[name] = TensorSpec(shape)
    for name, t in message.tensors.items():
        if cz.PART_SEP not in name and name not in expect:
            expect[name] = TensorSpec.of(t)  # not compressed (integer tensors travel as they are)
    return expect


def without_codec(params: Mapping[str, str]) -> dict[str, str]:
    """``params`` without the codec's entries."""
    return {k: v for k, v in params.items() if not k.startswith(("codec.", "codec-"))}


def encode_message(message: Message, scheme: Scheme, encoded: cz.Encoded, shapes: bool) -> Message:
    """``message`` carrying ``encoded`` (and, with ``shapes``, the shapes of its float32 tensors) instead of its own
    tensors."""
    params = dict(message.params)
    params.update(encoded.meta)
    params[RAW_BYTES] = str(encoded.raw_bytes)
    if shapes:
        for name, t in message.tensors.items():
            if t.dtype == torch.float32:
                params[SHAPE_PREFIX + name] = ",".join(str(d) for d in t.shape)
    return replace(message, params=params, tensors=encoded.tensors)


# --- client side ----------------------------------------------------------------------------------------------------


def decode_broadcast(broadcast: Message) -> Message:
    """``broadcast`` with float32 tensors, decoded under the scheme it declares (itself when it declares none)."""
    if cz.META_PREFIX + "name" not in broadcast.params:
        return broadcast
    declared = Scheme.from_meta(broadcast.params)
    if declared.delta:
        raise CodecError("a broadcast cannot be a delta: clients hold no common reference")
    tensors = cz.decode(broadcast.tensors, broadcast.params, _declared_specs(broadcast))
    return replace(broadcast, params=without_codec(broadcast.params), tensors=tensors)


def _session_tensor(session: str) -> torch.Tensor:
    return torch.tensor(list(session.encode()), dtype=torch.uint8)


def encode_update(
    task: Message, update: Message, broadcast: Message | None, store: MutableMapping[str, torch.Tensor]
) -> Message:
    """``update`` coded under the scheme ``task`` asks for (itself when it asks for none).

    Weight deltas are taken against ``broadcast`` (already decoded); with error feedback, what this round does not
    send is kept in ``store`` for the next one, and dropped when the coordinator's session changes (a restarted
    coordinator's model is not the one the residual was left against) or the model's shapes do.
    """
    if UPLOAD_PREFIX + "name" not in task.params:
        return update
    scheme = Scheme.from_meta(task.params, UPLOAD_PREFIX)
    expect = cz.specs(update.tensors)
    # Stochastic rounding draws from the task's own shuffle seed: the same task gives the same bytes anywhere.
    seed = int(task.params.get("seed", "0")) if task.params.get("seed", "0").isdigit() else 0
    generator = torch.Generator().manual_seed(seed) if scheme.stochastic else None
    reference = delta_reference(expect, broadcast.tensors if broadcast else {}) if scheme.delta else None
    if task.params.get(FEEDBACK) == "1":
        session = _session_tensor(task.transport.get(SESSION, ""))
        previous = store.get(_SESSION_KEY)
        kept = {k[len(_RESIDUAL) :]: v for k, v in store.items() if k.startswith(_RESIDUAL)}
        same_session = previous is not None and torch.equal(previous, session)
        fits = all(k in expect and TensorSpec.of(v) == expect[k] for k, v in kept.items())
        residual = Residual(kept if same_session and fits else {})
        encoded, left = cz.encode_with_feedback(
            update.tensors, scheme, residual, reference=reference, generator=generator
        )
        for k in [k for k in store if k.startswith(_RESIDUAL)]:
            del store[k]
        store.update({_RESIDUAL + k: v for k, v in left.tensors.items()})
        store[_SESSION_KEY] = session
    else:
        encoded = cz.encode(update.tensors, scheme, reference=reference, generator=generator)
    return encode_message(update, scheme, encoded, shapes=False)
