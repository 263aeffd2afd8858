"""Who is who in a fleet kit: user names, the kit's settings (:class:`FleetSpec`), each login's grants (the ACL) and
the admission rule that lets in provisioned devices only."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.broker_counters import SYS_FILTERS
from coordinator.presence import Admit
from fedge.errors import ConfigError
from fedge.wire.protocol import ClientStatus, Topics, publish_packet_bytes
from fedge_io.mqtt import MIN_PACKET_SIZE

COORDINATOR = "coordinator"
MONITOR = "monitor"  # the read-only login of `fedge status`: it reads the run status and nothing else
MONITOR_LOGINS = 8
"""Read-only logins in the kit's monitor bundle, so that as many viewers (``fedge status``, its web page) watch at
once: the broker binds a connection to its user name (``use_username_as_clientid``), so two viewers on one name push
each other off. They share the bundle's one password; each connection takes one of the names
(:class:`fedge_io.mqtt.MqttLink`'s ``logins``)."""
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


def monitor_names(count: int = MONITOR_LOGINS) -> tuple[str, ...]:
    """The monitor pool's names, as client ids are named: ``monitor``, ``monitor-2``, ... (reserved in every kit)."""
    return (MONITOR, *(f"{MONITOR}-{k}" for k in range(2, count + 1)))


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
    signed_programs: bool = False  # devices load only programs whose manifest the kit's CA signed
    cert_days: int = 365
    headroom: float = 0.10  # on top of the largest message: metadata varies by a few bytes per round
    sys_interval: int = 10  # seconds between the broker's $SYS counter updates
    chunk_packet_size: int | None = None  # mosquitto's max_packet_size when messages travel as chunks
    monitors: int = MONITOR_LOGINS  # read-only logins of the monitor bundle: viewers at once

    def __post_init__(self) -> None:
        for attr in ("clients", "broker_hosts"):  # accept any sequence, but never one string as many names
            value = getattr(self, attr)
            object.__setattr__(self, attr, (value,) if isinstance(value, str) else tuple(value))
        for name, what in [(self.run, "run name"), *((c, "client id") for c in self.clients)]:
            if not _NAME.fullmatch(name):  # not match: "$" also matches before a final newline
                raise ConfigError(f"{what} {name!r} for a fleet kit: use 1-64 letters, digits, '.', '_' or '-'")
        if not self.clients:
            raise ConfigError("a fleet kit needs at least one client id")
        if len(set(self.clients)) != len(self.clients):
            raise ConfigError("client ids of a fleet kit must be unique")
        if self.monitors < 1:
            raise ConfigError(f"a fleet kit needs at least one monitor login, got {self.monitors}")
        for reserved in (COORDINATOR, *monitor_names(self.monitors)):
            if reserved in self.clients:
                role = COORDINATOR if reserved == COORDINATOR else MONITOR
                raise ConfigError(f"{reserved!r} is the name of the kit's {role} login; choose another client id")
        if not self.broker_hosts:
            raise ConfigError("a fleet kit needs the broker's host name or IP address (what devices connect to)")
        for host in self.broker_hosts:
            if not _HOST.fullmatch(host) and not _is_ip(host):
                raise ConfigError(f"broker host {host!r} is neither a DNS name nor an IP address")
        if self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"broker port must be in 1..65535, got {self.port}")
        if self.bind_address is not None and not (_HOST.fullmatch(self.bind_address) or _is_ip(self.bind_address)):
            raise ConfigError(f"bind address {self.bind_address!r} is neither an IP address nor a host name")
        if self.client_certificates and not self.tls:
            raise ConfigError("client certificates need TLS")
        if self.signed_programs and not self.tls:
            raise ConfigError("signed programs need the kit's CA, which only a TLS kit has")
        if self.chunk_packet_size is not None and self.chunk_packet_size < MIN_PACKET_SIZE:
            raise ConfigError(f"a chunk packet size must be >= {MIN_PACKET_SIZE} bytes, got {self.chunk_packet_size}")
        if self.cert_days < 1 or self.headroom < 0 or self.sys_interval < 1:
            raise ConfigError("cert_days and sys_interval must be >= 1 and headroom >= 0")

    @property
    def topics(self) -> Topics:
        return Topics(self.run)

    @property
    def monitor_logins(self) -> tuple[str, ...]:
        """The monitor bundle's user names. With client certificates the broker takes the login from the certificate
        (its common name), so the bundle's one certificate makes one login, and one viewer at a time."""
        return tuple(
            fleet_username(self.run, m) for m in monitor_names(1 if self.client_certificates else self.monitors)
        )

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


def fleet_acl(run: str, clients: Sequence[str], monitors: Sequence[str] | None = None) -> dict[str, Grant]:
    """The least-privilege ACL of a run, by user name (the coordinator first, then the monitor logins: ``monitors``,
    default the kit's :func:`monitor_names`)."""
    t = Topics(run)
    acl = {
        fleet_username(run, None): Grant(
            write=(f"{t.prefix}/task/+", t.broadcast, t.run_status),
            read=(t.all_updates, t.all_statuses, *SYS_FILTERS),
        ),
    }
    for user in monitors if monitors is not None else [fleet_username(run, m) for m in monitor_names()]:
        acl[user] = Grant(write=(), read=(t.run_status,))
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
