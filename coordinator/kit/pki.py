"""The kit's private CA and the certificates it issues (ECDSA P-256, made with ``cryptography``)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedge.errors import ConfigError


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def make_ca(run: str, now: dt.datetime, days: int) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fedge fleet CA of run {run}")])
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # a device clock a little behind still accepts it
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, cert)


def issue(ca: Issued, common_name: str, *, hosts: Sequence[str], server: bool, now: dt.datetime, days: int) -> Issued:
    """A leaf certificate signed by ``ca``: for a server (``hosts`` in its subject alternative names) or a client."""
    key = ec.generate_private_key(ec.SECP256R1())
    purpose = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([purpose]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def issue_certificate(
    ca_dir: str | os.PathLike[str],
    common_name: str,
    *,
    hosts: Sequence[str] = (),
    days: int = 365,
    issued_at: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """A new certificate and key (PEM) from a kit's CA (``<kit>/ca``): for the broker when ``hosts`` are given
    (renewal, or another host name), else for a device (mutual TLS; ``common_name`` = its user name)."""
    folder = Path(ca_dir)
    try:
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the fleet CA from {folder} (ca.key, ca.crt): {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{folder / 'ca.key'} is not the EC key of a fedge fleet CA")
    now = issued_at or dt.datetime.now(dt.timezone.utc)
    leaf = issue(Issued(key, cert), common_name, hosts=hosts, server=bool(hosts), now=now, days=days)
    return leaf.cert_pem, leaf.key_pem
