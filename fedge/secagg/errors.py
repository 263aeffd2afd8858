"""The errors of secure aggregation: one root, a subclass per way a round can go wrong.

A transport catches :class:`SecAggError` at its boundary. :class:`RoundAbandoned` is the one a coordinator expects in
normal operation (too many dropouts): it logs the reason and starts the next round with fresh keys.
"""

from __future__ import annotations

from fedge.errors import CodecError, ConfigError, FedgeError


class SecAggError(FedgeError):
    """Root of every error the secure-aggregation core raises on purpose."""


class SecAggConfigError(SecAggError, ConfigError):
    """The round's parameters do not fit together (ring too small for the cohort, threshold above the degree, ...)."""


class ShareError(SecAggError, ValueError):
    """Shamir shares that cannot be combined: too few, a repeated x, a value outside the field."""


class EncodingError(SecAggError, ValueError):
    """A vector that cannot be encoded into the ring: non-finite values, wrong shape or length."""


class KeyAgreementError(SecAggError, ValueError):
    """A peer's public key is malformed or of low order (the Diffie-Hellman result would be all zeros)."""


class DecryptionError(SecAggError):
    """An encrypted share bundle failed authentication: tampered, misrouted, or from another round or run."""


class MessageError(SecAggError, CodecError):
    """A protocol message failed validation (sizes, lengths, client ids, kind)."""


class ProtocolViolation(SecAggError):
    """A party asked for something the protocol forbids: a stage out of order, a message of another round, a request
    that would reveal both secrets of one peer, or a second, different message from the same client."""


class RoundAbandoned(SecAggError):
    """The round cannot finish: too few survivors at ``stage``, or too few shares to remove someone's masks."""

    def __init__(self, reason: str, *, stage: str = "") -> None:
        super().__init__(f"secure aggregation round abandoned{f' at stage {stage!r}' if stage else ''}: {reason}")
        self.reason = reason
        self.stage = stage


class ReconstructionError(RoundAbandoned):
    """A reconstructed secret is inconsistent (a key that does not match its advertised public key, a self-mask seed
    outside its range): some share was tampered with, so the round cannot finish."""
