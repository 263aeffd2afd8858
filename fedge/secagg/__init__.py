"""Secure aggregation: the server learns the sum of the cohort's vectors and nothing about any one of them.

SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS) on top of
SecAgg (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning", CCS), as pure
functions and state machines with no I/O:

- :mod:`~fedge.secagg.shamir`: t-of-n secret sharing over GF(2^521 - 1);
- :mod:`~fedge.secagg.encoding`: clip, fixed point, stochastic rounding into Z_{2^ring_bits} (uint32), and back;
- :mod:`~fedge.secagg.masks`: ChaCha20 mask expansion;
- :mod:`~fedge.secagg.keys`: X25519, HKDF-SHA256 and AES-GCM share sealing;
- :mod:`~fedge.secagg.graph`: the public neighbour graph, degree and threshold;
- :mod:`~fedge.secagg.messages` and :mod:`~fedge.secagg.config`: the messages and round parameters as plain data;
- :mod:`~fedge.secagg.protocol`: :class:`SecAggClient` and :class:`SecAggServer`;
- :mod:`~fedge.secagg.driver`: :func:`run_round` / :func:`run_configured`, a whole round in one process (the
  simulator's entry points), and :func:`serve_round`, the server's side of a round whatever carries its messages;
- :mod:`~fedge.secagg.remote`: the messages in fedge's frame, a client's party on its device, the transport interface.

Threat model: an honest-but-curious server (and broker) that follows the protocol; clients may drop at any stage.
A server that lies about who dropped is bounded by t > k/2 and the client's refusal to reveal both shares of a peer,
but the consistency-check round that fully defends against a malicious server is not implemented.
"""

from fedge.secagg.config import RoundConfig
from fedge.secagg.driver import RoundResult, run_configured, run_round, serve_round
from fedge.secagg.encoding import RingPlan, decode, encode, ring_plan, ring_sum
from fedge.secagg.errors import (
    DecryptionError,
    EncodingError,
    KeyAgreementError,
    MessageError,
    ProtocolViolation,
    ReconstructionError,
    RoundAbandoned,
    SecAggConfigError,
    SecAggError,
    ShareError,
)
from fedge.secagg.graph import default_degree, default_threshold, neighbour_graph, recovery_risk
from fedge.secagg.messages import (
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
from fedge.secagg.protocol import STAGES, AggregateResult, SecAggClient, SecAggServer, Stage

__all__ = [
    "STAGES",
    "AdvertiseKeys",
    "AggregateResult",
    "DecryptionError",
    "EncodingError",
    "EncryptedShares",
    "KeyAgreementError",
    "MaskedInput",
    "MessageError",
    "NeighbourKeys",
    "ProtocolViolation",
    "ReconstructionError",
    "RingPlan",
    "RoundAbandoned",
    "RoundConfig",
    "RoundResult",
    "SecAggClient",
    "SecAggConfigError",
    "SecAggError",
    "SecAggMessage",
    "SecAggServer",
    "ShareDelivery",
    "ShareError",
    "Stage",
    "UnmaskRequest",
    "UnmaskShares",
    "decode",
    "default_degree",
    "default_threshold",
    "encode",
    "message_from_fields",
    "neighbour_graph",
    "pack",
    "recovery_risk",
    "ring_plan",
    "ring_sum",
    "run_configured",
    "run_round",
    "serve_round",
    "unpack",
]
