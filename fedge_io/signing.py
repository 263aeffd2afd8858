"""Detached signatures of export manifests by the fleet kit's CA, so that a device can check who produced a program.

The manifest (:mod:`fedge_io.manifest`) lists the SHA-256 of every exported file, so one signature over its exact
bytes covers them all. Whoever holds the kit's CA key (``<kit>/ca/ca.key``, kept offline) signs with
``fedge export --sign-key``; a device checks with the CA certificate it already has for TLS (``clients/<id>/ca.crt``).
Everything here is the ``cryptography`` package's: the algorithm follows the key type (ECDSA with SHA-256 for the
kit's P-256 key, RSA-PSS with SHA-256, Ed25519 / Ed448). Key material is never printed: errors name the file only.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa

from fedge.errors import ConfigError

SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey
MAX_PEM_BYTES = 64 << 10  # a key or certificate file; a larger one is not a PEM key or certificate
MAX_SIGNATURE_BYTES = 1024  # RSA-8192 signs in 1024 bytes; ECDSA P-256 in about 72
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def _read_pem(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_PEM_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_PEM_BYTES} bytes: not a PEM {what}")
    return raw


def _in_kit(path: Path, name: str) -> Path:
    """``path`` itself, or ``name`` in it when it is a directory: a kit root (``ca/name``) or the folder holding it."""
    if not path.is_dir():
        return path
    for candidate in (path / name, path / "ca" / name):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{path} is a directory without {name} (nor ca/{name}): pass the file or a fleet kit")


def load_signing_key(path: Path) -> SigningKey:
    """The private key at ``path`` (PEM, unencrypted), or a fleet kit's CA key when ``path`` is the kit directory."""
    file = _in_kit(path, "ca.key")
    raw = _read_pem(file, "signing key")
    try:
        key = serialization.load_pem_private_key(raw, password=None)
    except TypeError:
        raise ConfigError(f"{file} is an encrypted key; sign with an unencrypted copy kept offline") from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"{file} is not a PEM private key") from None
    if not isinstance(
        key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)
    ):
        raise ConfigError(f"{file}: a {type(key).__name__} cannot sign manifests (EC, RSA, Ed25519 or Ed448 can)")
    return key


def load_trusted_ca(path: Path) -> x509.Certificate:
    """The CA certificate at ``path`` (PEM), or ``ca.crt`` in a kit's device bundle or kit root (a directory)."""
    file = _in_kit(path, "ca.crt")
    raw = _read_pem(file, "CA certificate")
    try:
        cert = x509.load_pem_x509_certificate(raw)
        cert.public_key()
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(f"{file} is not a PEM X.509 certificate") from None
    return cert


def sign(key: SigningKey, data: bytes) -> bytes:
    """The signature of ``data`` by ``key``, with the algorithm of its type."""
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _PSS, hashes.SHA256())
    return key.sign(data)


def signed_by(cert: x509.Certificate, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made with the private key of ``cert``."""
    return signed_by_key(cert.public_key(), data, signature)


def signed_by_key(public: object, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``data`` was made with the private key of the public key ``public``."""
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, data, _PSS, hashes.SHA256())
        elif isinstance(public, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
            public.verify(signature, data)
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True
