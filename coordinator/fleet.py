"""The fleet kit: everything a secure deployment of one run needs, generated in one directory.

Security is enforced by the broker (mosquitto >= 2.0), not by fedge: TLS, one random password per device, client ids
bound to user names (``use_username_as_clientid``) and a least-privilege ACL. The kit::

    <out>/broker/        mosquitto.conf, passwd (mosquitto's own $7$ PBKDF2-SHA512 format), acl,
                         amqtt-passwd + acl.json (the same users and ACL for the embedded broker), ca.crt,
                         server.crt, server.key
    <out>/ca/            ca.crt, ca.key: the private CA; keep it offline, it is only needed to issue more certificates
    <out>/coordinator/   a bundle: bundle.json, password, ca.crt [, client.crt, client.key]
    <out>/monitor/       the same for ``fedge status``: a login that can only read the run status
    <out>/clients/<id>/  one bundle per client, to copy onto that device

A bundle is read with :func:`fedge_io.credentials.load_bundle`. User names are ``fedge-<run>-<client>`` and
``fedge-<run>-coordinator``, the MQTT client ids the roles have always used; the broker makes every connection's
client id its user name, so nobody can take over another device's connection.

Least privilege, per run: client X publishes only ``update/X`` and ``status/X`` (its hello and last will) and
reads only ``task/X`` and ``broadcast``; the coordinator publishes tasks, broadcasts and the run status and reads
updates, statuses and the broker's ``$SYS`` byte counters; the monitor reads the run status; nobody else reads or
writes anything under ``fedge/<run>/``.

Secrets come from :mod:`secrets`; every file holding one is created with mode 0600 (directories 0700), and no
secret is ever logged or put on a command line. Certificates (ECDSA P-256) are made with ``cryptography``.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.broker_counters import SYS_FILTERS
from coordinator.presence import Admit
from fedge.errors import ConfigError
from fedge.wire.protocol import ClientStatus, Topics, publish_packet_bytes
from fedge_io.credentials import BUNDLE_FILE, BUNDLE_FORMAT
from fedge_io.mqtt import MIN_PACKET_SIZE

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
MONITOR = "monitor"  # the read-only login of `fedge status`: it reads the run status and nothing else
PASSWORD_FILE = "password"
# mosquitto_passwd 2.0 writes 101 iterations; the broker reads the count from the file. The passwords are 256-bit
# random secrets, so the iteration count adds nothing against guessing; 1,000 cost about 1 ms per CONNECT.
PBKDF2_ITERATIONS = 1000
SALT_BYTES = 12  # mosquitto 2.0 rejects any other salt length (src/security_default.c, unpwd__decode_passwords)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # safe in a topic, a user name, a file name and mosquitto's files
_HOST = re.compile(r"^[A-Za-z0-9.-]{1,253}$")  # a DNS name; IP addresses are checked by ipaddress


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def fleet_username(run: str, client: str | None) -> str:
    """The user name (and MQTT client id) of ``client`` in ``run``; ``None`` names the coordinator, ``MONITOR``
    the read-only monitor."""
    return f"fedge-{run}-{client or COORDINATOR}"


@dataclass(frozen=True)
class FleetSpec:
    """What a fleet kit is made for. ``max_message_bytes`` is the payload size of the run's largest legitimate
    message (the encoded task, broadcast or update with the full model); the broker closes the connection of anyone
    who sends a bigger one. With ``chunk_packet_size`` the broker's limit is that many bytes instead: it announces
    it to MQTT 5 clients (CONNACK Maximum Packet Size), and fedge's roles send larger messages as chunks."""

    run: str
    clients: Sequence[str]  # kept as a tuple
    broker_hosts: Sequence[str]  # names/IPs devices reach the broker by: the first goes into the bundles' URL
    max_message_bytes: int
    port: int = 8883
    bind_address: str | None = None  # None: every interface of the broker host
    tls: bool = True  # False only for a loopback laptop run: passwords would cross the network in clear
    client_certificates: bool = False  # mutual TLS: every device also needs its certificate
    cert_days: int = 365
    headroom: float = 0.10  # on top of the largest message: metadata varies by a few bytes per round
    sys_interval: int = 10  # seconds between the broker's $SYS counter updates
    chunk_packet_size: int | None = None  # mosquitto's max_packet_size when messages travel as chunks

    def __post_init__(self) -> None:
        for attr in ("clients", "broker_hosts"):  # accept any sequence, but never one string as many names
            value = getattr(self, attr)
            object.__setattr__(self, attr, (value,) if isinstance(value, str) else tuple(value))
        for name, what in [(self.run, "run name"), *((c, "client id") for c in self.clients)]:
            if not _NAME.match(name):
                raise ConfigError(f"{what} {name!r} for a fleet kit: use 1-64 letters, digits, '.', '_' or '-'")
        if not self.clients:
            raise ConfigError("a fleet kit needs at least one client id")
        if len(set(self.clients)) != len(self.clients):
            raise ConfigError("client ids of a fleet kit must be unique")
        for reserved in (COORDINATOR, MONITOR):
            if reserved in self.clients:
                raise ConfigError(f"{reserved!r} is the name of the kit's {reserved} login; choose another client id")
        if not self.broker_hosts:
            raise ConfigError("a fleet kit needs the broker's host name or IP address (what devices connect to)")
        for host in self.broker_hosts:
            if not _HOST.match(host) and not _is_ip(host):
                raise ConfigError(f"broker host {host!r} is neither a DNS name nor an IP address")
        if self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"broker port must be in 1..65535, got {self.port}")
        if self.bind_address is not None and not (_HOST.match(self.bind_address) or _is_ip(self.bind_address)):
            raise ConfigError(f"bind address {self.bind_address!r} is neither an IP address nor a host name")
        if self.client_certificates and not self.tls:
            raise ConfigError("client certificates need TLS")
        if self.chunk_packet_size is not None and self.chunk_packet_size < MIN_PACKET_SIZE:
            raise ConfigError(f"a chunk packet size must be >= {MIN_PACKET_SIZE} bytes, got {self.chunk_packet_size}")
        if self.cert_days < 1 or self.headroom < 0 or self.sys_interval < 1:
            raise ConfigError("cert_days and sys_interval must be >= 1 and headroom >= 0")

    @property
    def topics(self) -> Topics:
        return Topics(self.run)

    @property
    def max_packet_size(self) -> int:
        """mosquitto's ``max_packet_size``: ``chunk_packet_size`` when set, else a QoS-1 PUBLISH of the largest
        message on the longest topic, plus headroom."""
        if self.chunk_packet_size is not None:
            return self.chunk_packet_size
        longest = max((self.topics.task(c) for c in self.clients), key=len)
        return int(publish_packet_bytes(longest, self.max_message_bytes, 1) * (1 + self.headroom)) + 1

    @property
    def broker_url(self) -> str:
        host = self.broker_hosts[0]
        host = f"[{host}]" if ":" in host else host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"


@dataclass(frozen=True)
class Grant:
    """What one user may do: publish to ``write`` and subscribe to and receive ``read`` (MQTT topic filters)."""

    write: tuple[str, ...]
    read: tuple[str, ...]


def fleet_acl(run: str, clients: Sequence[str]) -> dict[str, Grant]:
    """The least-privilege ACL of a run, by user name (the coordinator first, then the monitor)."""
    t = Topics(run)
    acl = {
        fleet_username(run, None): Grant(
            write=(f"{t.prefix}/task/+", t.broadcast, t.run_status),
            read=(t.all_updates, t.all_statuses, *SYS_FILTERS),
        ),
        fleet_username(run, MONITOR): Grant(write=(), read=(t.run_status,)),
    }
    for c in clients:
        acl[fleet_username(run, c)] = Grant(write=(t.update(c), t.status(c)), read=(t.task(c), t.broadcast))
    return acl


def admit_provisioned(clients: Sequence[str], then: Admit | None = None) -> Admit:
    """An admission rule for the coordinator: refuse any client id not in the kit, then apply ``then``."""
    known = frozenset(clients)

    def admit(status: ClientStatus) -> str | None:
        if status.client not in known:
            return "not provisioned in this run's fleet kit"
        return then(status) if then is not None else None

    return admit


# --- files ---------------------------------------------------------------------------------------------------------


def mosquitto_password_line(
    username: str, password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """``username:$7$<iterations>$<salt>$<hash>``: mosquitto 2.0's PBKDF2-HMAC-SHA512 entry, as mosquitto_passwd
    writes it (apps/mosquitto_passwd/mosquitto_passwd.c: 12-byte salt, 64-byte key, both in standard base64)."""
    salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
    if len(salt) != SALT_BYTES:
        raise ConfigError(f"mosquitto needs a {SALT_BYTES}-byte salt, got {len(salt)}")
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, dklen=64)
    b64 = base64.b64encode
    return f"{username}:$7${iterations}${b64(salt).decode()}${b64(digest).decode()}"


def amqtt_password_line(username: str, password: str) -> str:
    """``username:<argon2 hash>`` for amqtt's FileAuthPlugin (which reads Argon2 or the deprecated sha512-crypt)."""
    from pwdlib import PasswordHash  # amqtt's own hashing library
    from pwdlib.hashers.argon2 import Argon2Hasher

    # Cheapest Argon2 parameters: the secret is 256 random bits, so a costly hash would only slow every CONNECT
    # down (amqtt verifies on its event loop) without making the secret any harder to guess.
    hasher = PasswordHash((Argon2Hasher(time_cost=1, memory_cost=1024, parallelism=1),))
    return f"{username}:{hasher.hash(password)}"


def mosquitto_acl(run: str, acl: dict[str, Grant]) -> str:
    """The ACL in mosquitto's acl_file format: explicit topics per user, no patterns, nothing for anyone else."""
    lines = [
        f"# fedge fleet ACL of run {run!r} (mosquitto acl_file). Generated: edit the kit's inputs, not this file.",
        "# No line before the first 'user' line: anonymous clients and unknown users get nothing.",
    ]
    for user, grant in acl.items():
        lines += ["", f"user {user}"]
        lines += [f"topic write {t}" for t in grant.write]
        lines += [f"topic read {t}" for t in grant.read]
    return "\n".join(lines) + "\n"


def mosquitto_conf(spec: FleetSpec, broker_dir: Path) -> str:
    """mosquitto.conf for the kit; ``broker_dir`` is where its files will be on the broker host."""
    d = broker_dir
    listener = f"listener {spec.port}" + (f" {spec.bind_address}" if spec.bind_address else "")
    lines = [
        f"# mosquitto >= 2.0 configuration of fedge run {spec.run!r}, generated by fedge's fleet kit.",
        f"# Files are read from {d}: if you move them, change the paths below. They must be readable by",
        "# the user mosquitto runs as (started as root it becomes user 'mosquitto': chown mosquitto them).",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {d / 'passwd'}",
        f"acl_file {d / 'acl'}",
        "# Clients keep persistent sessions (QoS 1): their subscriptions and undelivered tasks, broadcasts and updates",
        "# are saved here and survive a broker restart. The directory must be writable by the user mosquitto runs as.",
        "persistence true",
        f"persistence_location {d}/",
        *(
            [
                f"# The largest legitimate packet: a {spec.max_message_bytes}-byte message plus {spec.headroom:.0%} "
                "headroom;",
                "# a bigger one closes the sender's connection before the broker buffers it.",
            ]
            if spec.chunk_packet_size is None
            else [
                "# The largest packet: MQTT 5 clients learn it from the CONNACK, and fedge sends larger messages as",
                "# chunks; a bigger packet closes the sender's connection before the broker buffers it.",
            ]
        ),
        f"max_packet_size {spec.max_packet_size}",
        "# A round queues one task per client at once, and the coordinator gets every update at once.",
        f"max_queued_messages {max(1000, 4 * len(spec.clients))}",
        "# Send small packets at once: with Nagle's algorithm a message that follows a PUBACK waits for a delayed ACK.",
        "set_tcp_nodelay true",
        f"sys_interval {spec.sys_interval}",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "",
        listener,
        "protocol mqtt",
        "# The MQTT client id of every connection is its user name: nobody can take over another's connection.",
        "use_username_as_clientid true",
    ]
    if spec.tls:
        lines += [
            f"cafile {d / 'ca.crt'}",
            f"certfile {d / 'server.crt'}",
            f"keyfile {d / 'server.key'}",
            "tls_version tlsv1.2",  # the oldest version accepted
            f"require_certificate {'true' if spec.client_certificates else 'false'}",
        ]
        if spec.client_certificates:
            lines += [
                "# The login is the certificate's common name (the device's user name): one device's certificate",
                "# with another device's password connects as the certificate's owner, never as the other.",
                "use_identity_as_username true",
            ]
    return "\n".join(lines) + "\n"


def _write(path: Path, data: str | bytes, *, private: bool = False) -> None:
    """Create ``path`` (never overwrite); a private file is 0600 from the moment it exists."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def _mkdir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=False)
    return path


# --- certificates ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Issued:
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


def _make_ca(run: str, now: dt.datetime, days: int) -> _Issued:
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
    return _Issued(key, cert)


def _issue(
    ca: _Issued, common_name: str, *, hosts: Sequence[str], server: bool, now: dt.datetime, days: int
) -> _Issued:
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
    return _Issued(key, builder.sign(ca.key, hashes.SHA256()))


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
    leaf = _issue(_Issued(key, cert), common_name, hosts=hosts, server=bool(hosts), now=now, days=days)
    return leaf.cert_pem, leaf.key_pem


# --- the kit -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetKit:
    """Where a generated kit's parts are."""

    root: Path
    spec: FleetSpec
    client_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def broker_dir(self) -> Path:
        return self.root / "broker"

    @property
    def coordinator_dir(self) -> Path:
        return self.root / COORDINATOR

    @property
    def mosquitto_conf(self) -> Path:
        return self.broker_dir / "mosquitto.conf"


def generate_fleet_kit(
    spec: FleetSpec,
    out: str | os.PathLike[str],
    *,
    broker_config_dir: str | os.PathLike[str] | None = None,
    issued_at: dt.datetime | None = None,
) -> FleetKit:
    """Write a fleet kit for ``spec`` into the new (or empty) directory ``out``.

    ``broker_config_dir``: where the broker's files will be on the broker host (default: ``out/broker``, absolute),
    written into mosquitto.conf. ``issued_at``: the certificates' start of validity (default: now).
    """
    root = Path(out).absolute()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} exists and is not empty; a fleet kit is written into a new directory")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    now = issued_at or dt.datetime.now(dt.timezone.utc)
    broker = _mkdir(root / "broker")
    conf_dir = Path(broker_config_dir) if broker_config_dir is not None else broker
    users = [None, MONITOR, *spec.clients]
    passwords = {fleet_username(spec.run, c): secrets.token_urlsafe(32) for c in users}

    acl = fleet_acl(spec.run, spec.clients)
    _write(broker / "passwd", "".join(mosquitto_password_line(u, p) + "\n" for u, p in passwords.items()), private=True)
    _write(
        broker / "amqtt-passwd", "".join(amqtt_password_line(u, p) + "\n" for u, p in passwords.items()), private=True
    )
    _write(broker / "acl", mosquitto_acl(spec.run, acl))
    _write(broker / "acl.json", json.dumps({u: {"write": g.write, "read": g.read} for u, g in acl.items()}, indent=1))
    _write(broker / "mosquitto.conf", mosquitto_conf(spec, conf_dir))

    ca: _Issued | None = None
    if spec.tls:
        ca = _make_ca(spec.run, now, days=max(spec.cert_days, 3650))
        _write(_mkdir(root / "ca") / "ca.key", ca.key_pem, private=True)
        _write(root / "ca" / "ca.crt", ca.cert_pem)
        server = _issue(ca, spec.broker_hosts[0], hosts=spec.broker_hosts, server=True, now=now, days=spec.cert_days)
        _write(broker / "ca.crt", ca.cert_pem)
        _write(broker / "server.crt", server.cert_pem)
        _write(broker / "server.key", server.key_pem, private=True)

    dirs: dict[str, Path] = {}
    _mkdir(root / "clients")
    for client in users:
        role = COORDINATOR if client is None else MONITOR if client == MONITOR else "client"
        folder = _mkdir(root / role if role != "client" else root / "clients" / str(client))
        username = fleet_username(spec.run, client)
        bundle: dict[str, object] = {
            "format": BUNDLE_FORMAT,
            "role": role,
            "run": spec.run,
            "client_id": client if role == "client" else None,
            "username": username,
            "broker": spec.broker_url,
            "password_file": PASSWORD_FILE,
        }
        _write(folder / PASSWORD_FILE, passwords[username] + "\n", private=True)
        if ca is not None:
            _write(folder / "ca.crt", ca.cert_pem)
            bundle.update(ca_file="ca.crt", verify_hostname=True)
            if spec.client_certificates:
                leaf = _issue(ca, username, hosts=(), server=False, now=now, days=spec.cert_days)
                _write(folder / "client.crt", leaf.cert_pem)
                _write(folder / "client.key", leaf.key_pem, private=True)
                bundle.update(cert_file="client.crt", key_file="client.key")
        if client is None:
            bundle["clients"] = list(spec.clients)
        elif role == "client":
            dirs[client] = folder
        _write(folder / BUNDLE_FILE, json.dumps(bundle, indent=1) + "\n")
    _write(root / "README.txt", _readme(spec, conf_dir))
    log.info("fleet kit of run %r for %d clients written to %s", spec.run, len(spec.clients), root)
    return FleetKit(root, spec, dirs)


def _readme(spec: FleetSpec, conf_dir: Path) -> str:
    """What to copy where: the kit explains itself to whoever opens it."""
    lines = [
        f"fedge fleet kit of run {spec.run!r}: {len(spec.clients)} clients, broker {spec.broker_url}",
        "",
        f"broker/       -> the broker host, at {conf_dir}; chown it to the user mosquitto runs as (started as",
        "                 root, mosquitto reads its files as user 'mosquitto')",
        f"                 then: mosquitto -c {conf_dir / 'mosquitto.conf'}",
        "coordinator/  -> the machine of the coordinator (its bundle: fedge reads it with --bundle)",
        "monitor/      -> wherever you watch the run from: fedge status --bundle monitor (reads the run status only)",
        "clients/<id>/ -> device <id>, one directory each (copy it whole, keep its mode: scp -rp)",
    ]
    if spec.tls:
        lines.append("ca/           -> keep offline: ca.key only serves to issue new certificates (issue_certificate)")
    lines += [
        "",
        "Every 'password' and '*.key' file is a secret: never commit, mail or paste it. A new kit makes new ones.",
    ]
    return "\n".join(lines) + "\n"
