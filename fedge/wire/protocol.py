"""The MQTT protocol of a deployment, as pure functions: topics, client status messages and wire-byte formulas.

Nothing here touches a socket; :mod:`fedge_io.mqtt` does the I/O. See ``docs/protocol.md`` for the whole protocol.

Topics, all under ``fedge/<run>/`` (``<run>`` names one federation, given to the coordinator and every client):
  ``task/<client>``    coordinator -> one client: a TASK (and, on a resend, that round's BROADCAST)
  ``broadcast``        coordinator -> every client, published once and fanned out by the broker
  ``update/<client>``  client -> coordinator: an UPDATE, or an ERROR saying why the client could not do its task
  ``status/<client>``  client -> coordinator, retained: the hello (state ``online``), the last will (``offline``);
                       an empty retained message clears it when a client leaves cleanly
  ``run-status``       coordinator -> monitors, retained: the run's live status (:mod:`fedge.wire.run_status`)

Wire bytes follow MQTT 3.1.1 (OASIS standard, sec. 2-3): every packet is a fixed header (1 byte of type and flags,
then the "remaining length" as a 1-4 byte varint) plus the remaining length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

from fedge.errors import CodecError, ConfigError
from fedge.wire import fields as wire
from fedge.wire.message import Message, decode, encode

ROOT = "fedge"
DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883  # MQTT over TLS (IANA "secure-mqtt")

# Message kinds of the deployment protocol, on top of fedge.wire.message' TASK / BROADCAST / UPDATE.
STATUS = "status"  # a client's hello (online) or last will (offline); metadata only
ERROR = "error"  # a client could not do its task; metadata only, the reason in param "error"
REFUSED = "refused"  # coordinator -> client, on its task topic: not admitted to the run, the reason in param "reason"
CANCELLED = "cancelled"  # coordinator -> client, on its task topic: the run cannot start; params "reason", "at"
# and INSTANCE
INSTANCE = "instance"  # a client process's random id: in its hello's extra, echoed in a cancelled notice to it
# (the Unix time it was sent: a client ignores one older than its own process, queued for an earlier life)

Channel = Literal["task", "broadcast", "update", "status"]
CHANNELS: tuple[Channel, ...] = ("task", "broadcast", "update", "status")
ClientState = Literal["online", "offline"]

# Transport-level parameters the MQTT roles add to messages; algorithms never read them.
# Transport metadata (``Message.transport``), apart from the algorithm's fields.
BROADCAST_ROUND = "broadcast_round"  # in a task: wait for this round's broadcast before computing
SESSION = "session"  # in tasks and broadcasts: one coordinator run; a new one resets a client's state
RAW_BYTES = "codec-raw"  # in coded messages: the bytes of their tensors as float32 (the ledger's uncompressed column)
COMPUTE_S = "compute_s"  # in an update: wall seconds of the client step
COMPUTE_CPU_S = "compute_cpu_s"  # in an update: CPU seconds of the client step (this process)
STATE_ROUND = "state_round"  # in an update: the round the client's own state came from (0: it had none)
DEADLINE = "deadline"  # in a task: Unix time (s) when the coordinator stops waiting for the round's replies


# --- names and topics -------------------------------------------------------------------------------------------


def check_name(name: str, what: str) -> str:
    """``name`` if it can be one topic level (a run or client id), else a ConfigError saying why not."""
    if not name:
        raise ConfigError(f"{what} must not be empty")
    bad = sorted({ch for ch in name if ch in "/+#\0" or ord(ch) < 32})
    if bad:
        raise ConfigError(f"{what} {name!r} contains {bad}; use letters, digits, '-', '_' or '.'")
    if name.startswith("$"):
        raise ConfigError(f"{what} {name!r} must not start with '$' (reserved for broker topics such as $SYS)")
    if len(name.encode()) > 128:
        raise ConfigError(f"{what} {name!r} is longer than 128 bytes")
    return name


@dataclass(frozen=True)
class Topics:
    """The topic names of one run."""

    run: str

    def __post_init__(self) -> None:
        check_name(self.run, "run name")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.run}"

    def task(self, client: str) -> str:
        return f"{self.prefix}/task/{check_name(client, 'client id')}"

    @property
    def broadcast(self) -> str:
        return f"{self.prefix}/broadcast"

    def update(self, client: str) -> str:
        return f"{self.prefix}/update/{check_name(client, 'client id')}"

    def status(self, client: str) -> str:
        return f"{self.prefix}/status/{check_name(client, 'client id')}"

    @property
    def run_status(self) -> str:
        """The coordinator's retained run status (round, phase, clients), read by monitors: fedge.wire.run_status."""
        return f"{self.prefix}/run-status"

    @property
    def all_updates(self) -> str:
        """Subscription filter for every client's updates."""
        return f"{self.prefix}/update/+"

    @property
    def all_statuses(self) -> str:
        """Subscription filter for every client's status."""
        return f"{self.prefix}/status/+"

    def parse(self, topic: str) -> tuple[Channel, str | None]:
        """(channel, client) of a topic of this run; client is None for the broadcast. CodecError for anything else."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise CodecError(f"topic {topic!r} is not under {head!r}")
        parts = topic[len(head) :].split("/")
        if parts == ["broadcast"]:
            return "broadcast", None
        if len(parts) == 2 and parts[0] in ("task", "update", "status") and parts[1]:
            return parts[0], parts[1]  # type: ignore[return-value]
        raise CodecError(f"topic {topic!r} is not a fedge topic (expected {head}task|update|status/<client>)")


# --- broker addresses -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerAddress:
    """Where a broker listens and how to log in: ``mqtt://HOST:PORT``, or ``mqtts://HOST:PORT`` for TLS.

    ``port`` 0 means the scheme's default (1883, or 8883 with TLS). ``ca_file`` (None: the system's trusted CAs),
    ``cert_file``/``key_file`` (a client certificate for mutual TLS) and ``verify_hostname`` only apply to TLS.
    The password never appears in ``url``, ``str``, ``repr`` or an error message, so an address can be logged.
    """

    host: str
    port: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify_hostname: bool = True
    # Where this address came from, for a connection error's hint (e.g. a fleet bundle and the broker it names).
    origin: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("broker host must not be empty")
        if self.port == 0:
            object.__setattr__(self, "port", DEFAULT_TLS_PORT if self.tls else DEFAULT_PORT)
        if not 0 < self.port < 65536:
            raise ConfigError(f"broker port must be in 1..65535, got {self.port}")
        if self.password is not None and not self.username:
            raise ConfigError(f"broker {self.url}: a password needs a user name")
        if self.username is not None and (not self.username or ":" in self.username):
            raise ConfigError(f"broker {self.url}: user name {self.username!r} must be non-empty and without ':'")
        tls_files = {"CA file": self.ca_file, "certificate": self.cert_file, "key": self.key_file}
        if not self.tls and any(tls_files.values()):
            given = ", ".join(k for k, v in tls_files.items() if v)
            raise ConfigError(f"broker {self.url}: a TLS {given} is given but the URL is not TLS; use mqtts://")
        if self.key_file and not self.cert_file:
            raise ConfigError(f"broker {self.url}: a client key needs its certificate (cert_file)")

    @property
    def scheme(self) -> str:
        return "mqtts" if self.tls else "mqtt"

    @property
    def url(self) -> str:
        """``scheme://host:port``, without user name or password (safe to log and to write into a run's config)."""
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return self.url

    def with_login(self, username: str, password: str | None) -> BrokerAddress:
        """This address with another user name and password."""
        return replace(self, username=username, password=password)

    def with_tls(
        self,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        verify_hostname: bool = True,
    ) -> BrokerAddress:
        """This address over TLS (same port) with the given CA file and optional client certificate and key."""
        return replace(
            self, tls=True, ca_file=ca_file, cert_file=cert_file, key_file=key_file, verify_hostname=verify_hostname
        )

    @classmethod
    def parse(cls, text: str) -> BrokerAddress:
        """``mqtt://[user[:password]@]host[:port]`` (also ``tcp://`` or no scheme), or ``mqtts://`` / ``ssl://``.

        User name and password are percent-decoded (write ``%40`` for ``@``); without a port, 1883 or 8883 (TLS).
        """
        raw = text.strip()
        if "://" not in raw:
            raw = "mqtt://" + raw
        parts = urlsplit(raw)
        shown = _redact(raw, parts)  # what error messages may repeat
        if parts.scheme in ("ws", "wss"):
            raise ConfigError(f"broker URL {shown!r}: websockets are not supported; use mqtt:// or mqtts://")
        if parts.scheme not in ("mqtt", "tcp", "mqtts", "ssl"):
            raise ConfigError(f"broker URL {shown!r} must look like mqtt://HOST:PORT or mqtts://HOST:PORT")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"broker URL {shown!r} must not have a path or query; write mqtt://HOST:PORT")
        try:
            port = parts.port or 0
        except ValueError as exc:
            raise ConfigError(f"broker URL {shown!r} has an invalid port: {exc}") from None
        if not parts.hostname:
            raise ConfigError(f"broker URL {shown!r} lacks a host, e.g. mqtt://127.0.0.1:1883")
        username = unquote(parts.username) if parts.username is not None else None
        password = unquote(parts.password) if parts.password is not None else None
        tls = parts.scheme in ("mqtts", "ssl")
        return cls(parts.hostname, port, tls=tls, username=username or None, password=password)


def _redact(raw: str, parts: SplitResult) -> str:
    """``raw`` with the password of its user-info replaced by ``***``."""
    if parts.password is None:
        return raw
    user_info, _, rest = parts.netloc.rpartition("@")
    user = user_info.split(":", 1)[0]
    return raw.replace(parts.netloc, f"{user}:***@{rest}", 1)


# --- client status (hello / last will) --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientStatus:
    """What a client announces about itself (hello) or what its last will says (offline)."""

    client: str
    state: ClientState
    runtime: str = ""  # "torch", later "onnxruntime" / "executorch"
    device: str = ""  # "cpu", "cuda", "cuda:0" ...
    dataset_size: int = 0  # labeled private samples
    model: str = ""
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    open_size: int = 0  # DS-FL open-set samples held locally (0 = none)
    capabilities: tuple[str, ...] = ()  # algorithms the client can run
    reason: str = ""  # why offline: "connection lost" (last will)
    extra: dict[str, str] = field(default_factory=dict)  # free-form facts: host name, torch version ...

    def __post_init__(self) -> None:
        if self.state not in ("online", "offline"):
            raise CodecError(f"client state must be online|offline, got {self.state!r}")

    @property
    def online(self) -> bool:
        return self.state == "online"


def encode_status(status: ClientStatus, run: str) -> bytes:
    """A status as a metadata-only safetensors message."""
    params = {
        "state": status.state,
        "runtime": status.runtime,
        "device": status.device,
        "dataset_size": str(status.dataset_size),
        "model": status.model,
        "input_shape": ",".join(str(d) for d in status.input_shape),
        "num_classes": str(status.num_classes),
        "open_size": str(status.open_size),
        "capabilities": ",".join(status.capabilities),
        "reason": status.reason,
    }
    params.update({f"extra.{k}": v for k, v in status.extra.items()})
    return encode(Message(STATUS, 0, run=run, client=status.client, params=params))


def decode_status(payload: bytes) -> ClientStatus:
    """Parse a status message with bounded fields; CodecError for anything that is not one."""
    msg = decode(payload)
    if msg.kind != STATUS:
        raise CodecError(f"expected a {STATUS!r} message, got {msg.kind[:40]!r}")
    p = msg.params

    def text(name: str) -> str:
        return str(wire.parse_value(name, p.get(name, ""), str))

    def count(name: str, hi: int) -> int:
        return int(wire.parse_value(name, p.get(name, "0"), int, wire.bounded(0, hi)))

    shape = wire.parse_value("input_shape", p.get("input_shape", ""), tuple[int, ...], wire.bounded(0, 2**31))
    if len(shape) > 8:
        raise CodecError(f"input_shape has {len(shape)} dimensions, at most 8 allowed")
    extra = {k[6:]: v for k, v in p.items() if k.startswith("extra.")}
    if len(extra) > 16 or any(len(k) > 64 or len(v) > wire.MAX_STRING for k, v in extra.items()):
        raise CodecError("too many or too long extra fields in a status")
    return ClientStatus(
        client=msg.client,
        state=text("state"),  # type: ignore[arg-type]  # checked in __post_init__
        runtime=text("runtime"),
        device=text("device"),
        dataset_size=count("dataset_size", 2**40),
        model=text("model"),
        input_shape=shape,
        num_classes=count("num_classes", 1_000_000),
        open_size=count("open_size", 2**40),
        capabilities=tuple(c for c in text("capabilities").split(",") if c),
        reason=text("reason"),
        extra=extra,
    )


def task_deadline(task: Message) -> float | None:
    """The Unix time after which ``task``'s reply would be refused as late; None when the task carries no deadline
    (a coordinator from before deadlines) or a malformed one (a peer's bytes: never trusted to stop work)."""
    text = task.transport.get(DEADLINE)
    if text is None or len(text) > 32:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < 1e11 else None  # finite and before the year 5138


def error_message(task: Message, reason: str) -> Message:
    """What a client sends instead of an update when it cannot do ``task``; like every reply, it names the session
    of the task it answers."""
    session = {SESSION: task.transport[SESSION]} if SESSION in task.transport else {}
    return Message(
        ERROR,
        task.round,
        run=task.run,
        client=task.client,
        params={"error": reason[: wire.MAX_STRING]},
        transport=session,
    )


# --- wire bytes (MQTT 3.1.1) -------------------------------------------------------------------------------------

MAX_REMAINING_LENGTH = 268_435_455  # 4 varint bytes: the largest packet MQTT can carry (256 MiB)
PUBACK_BYTES = 4  # fixed header (2) + packet id (2)
CONNACK_BYTES = 4
PINGREQ_BYTES = PINGRESP_BYTES = DISCONNECT_BYTES = 2


def varint_size(value: int) -> int:
    """Bytes of MQTT's "remaining length" encoding of ``value`` (7 bits per byte, at most 4 bytes)."""
    if value < 0 or value > MAX_REMAINING_LENGTH:
        raise CodecError(f"remaining length {value} is outside 0..{MAX_REMAINING_LENGTH} (MQTT's 256 MiB limit)")
    size = 1
    while value >= 128:
        value >>= 7
        size += 1
    return size


def _packet(remaining: int) -> int:
    return 1 + varint_size(remaining) + remaining


def publish_packet_bytes(topic: str, payload_bytes: int, qos: int = 1) -> int:
    """One PUBLISH packet: fixed header, topic (2-byte length + UTF-8), packet id when QoS > 0, payload."""
    if qos not in (0, 1, 2):
        raise CodecError(f"QoS must be 0, 1 or 2, got {qos}")
    return _packet(2 + len(topic.encode()) + (2 if qos else 0) + payload_bytes)


def publish_acks_bytes(qos: int) -> int:
    """Acknowledgement bytes of one delivered PUBLISH: PUBACK (QoS 1), PUBREC+PUBREL+PUBCOMP (QoS 2)."""
    return (0, PUBACK_BYTES, 3 * PUBACK_BYTES)[qos]


def delivery_wire_bytes(topic: str, payload_bytes: int, *, subscribers: int, qos: int = 1) -> int:
    """Every byte one published message puts on the wire, through a broker, to ``subscribers`` subscribers.

    The publisher's PUBLISH and its acknowledgement, plus one PUBLISH and acknowledgement per subscriber (the broker's
    fan-out copies; subscriptions are at the same QoS, so every copy carries a packet id).
    """
    one = publish_packet_bytes(topic, payload_bytes, qos) + publish_acks_bytes(qos)
    return one * (1 + subscribers)


def connect_packet_bytes(
    client_id: str,
    *,
    will_topic: str | None = None,
    will_payload_bytes: int = 0,
    username: str | None = None,
    password: bytes | None = None,
) -> int:
    """A CONNECT packet (3.1.1): protocol name "MQTT", level, flags, keepalive, then the payload fields."""
    remaining = 10 + 2 + len(client_id.encode())
    if will_topic is not None:
        remaining += 2 + len(will_topic.encode()) + 2 + will_payload_bytes
    if username is not None:
        remaining += 2 + len(username.encode())
    if password is not None:
        remaining += 2 + len(password)
    return _packet(remaining)


def subscribe_packet_bytes(filters: Iterable[str]) -> int:
    """A SUBSCRIBE packet: packet id, then per filter its length-prefixed UTF-8 and a QoS byte."""
    return _packet(2 + sum(2 + len(f.encode()) + 1 for f in filters))


def suback_packet_bytes(num_filters: int) -> int:
    return _packet(2 + num_filters)
