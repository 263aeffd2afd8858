"""One MQTT connection for either role: connect with retries, an explicit reconnect loop, a thread-safe inbox.

This is the one module of the core that does network I/O. It lives here rather than in ``coordinator`` or
``edge_client`` because both roles need exactly the same connection handling and neither role package may depend on
the other; everything protocol-specific (topics, messages, byte formulas) stays pure in :mod:`fedge.wire.protocol`.

Threading: paho's network loop runs in one background thread owned by :class:`MqttLink`; it only moves packets and
puts received messages into a :class:`queue.Queue`. The owner reads the queue from its own thread, so no algorithm
code ever runs inside a paho callback. ``publish`` may be called from any thread: it only queues the packet, and
the network thread alone reads and writes the socket (a TLS connection must never be used by two threads at once).

Security (see ``coordinator/kit/`` for the kit that sets it up; TLS and the refusal texts are
:mod:`fedge_io.broker_security`): TLS 1.2+ with hostname verification for
``mqtts://`` addresses, user name and password from the address (the URL, a credential file or an environment
variable: :func:`fedge_io.credentials.with_credentials`), and a device's whole connection from its fleet bundle
(:func:`fedge_io.credentials.load_bundle`).
Every way a secured broker can turn a connection away (unknown CA, expired certificate, wrong password, refused
subscription) ends :meth:`MqttLink.start` with a one-line :class:`TransportError` naming the cause and the fix.
What MQTT 3.1.1 cannot report: a publish the broker's ACL denies is acknowledged and dropped without a word. MQTT 5
would say so (mosquitto 2.0.11 answers such a PUBLISH with PUBACK 0x87 "Not authorized"), but fedge stays on 3.1.1:
its wire-byte formulas are 3.1.1's and the embedded amqtt broker speaks nothing newer. mosquitto 2.0 also grants
every SUBSCRIBE and applies its ACL on delivery instead, so a denied subscription is silent there too; amqtt answers
it with SUBACK 0x80, which :meth:`MqttLink.start` reports.

Packet limits: a broker may refuse packets above a size (mosquitto's ``max_packet_size``, EMQX's 1 MB default) and
closes the connection of a client that sends one. Only MQTT 5 lets a broker say its limit (CONNACK Maximum Packet
Size), so before its 3.1.1 connection :meth:`MqttLink.start` asks with one short MQTT 5 CONNECT (same client id,
login and TLS; no will, no subscriptions; a 3.1.1-only broker such as amqtt answers "unsupported protocol version"
and the limit stays unknown). :meth:`MqttLink.send` then splits a message that would not fit into chunks
(:mod:`fedge.wire.chunking`), and :meth:`MqttLink.publish` refuses a packet the broker announced it would refuse
(:class:`PacketTooLarge`) instead of being disconnected and resending it after every reconnect.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import paho.mqtt.client as paho

from fedge.errors import ConfigError, TransportError
from fedge.wire import chunking
from fedge.wire.protocol import PUBACK_BYTES, BrokerAddress, publish_packet_bytes
from fedge_io.broker_security import (
    early_close,
    in_handshake,
    login_refusal,
    subscription_refusal,
    tls_context,
    tls_failure,
)
from fedge_io.login_claims import LoginClaim

log = logging.getLogger(__name__)

START_HINT = (
    "start one with `mosquitto -p PORT` (apt-get install mosquitto), "
    "or run `fedge sim --transport mqtt` without --broker for an embedded broker"
)


def start_hint(address: BrokerAddress) -> str:
    """What to do about a broker that refuses connections: for an address from a fleet bundle, the kit's broker and
    the port it listens on (a wrong --broker port, or the kit's broker not started); else how to start one."""
    if not address.origin:
        return START_HINT
    return (
        f"This address is from {address.origin}: start the kit's broker with the commands `fedge provision` printed "
        "(or its broker unit), and give --broker only for a broker that listens elsewhere"
    )


PROBE_TIMEOUT_S = 1.5
"""How long the MQTT 5 probe waits for its CONNACK before the limit counts as unknown. An MQTT 5 broker answers in
milliseconds; a 3.1.1-only one usually closes the connection at once, but amqtt behind TLS does neither, so every
connection to it pays this once."""
MIN_PACKET_SIZE = 1024
"""The smallest packet limit fedge accepts: a hello (~500 bytes) must travel whole, and a chunk needs its header."""

PacketLimit = int | Literal["auto", "off"]
"""The largest MQTT packet to send: ``auto`` (the broker's announced limit, else none), a number of bytes (capped by
the broker's announced limit), or ``off`` (never chunk; a message the broker would refuse is an error)."""


class PacketTooLarge(TransportError):
    """A message does not fit the broker's packet limit and chunking is off (or the packet is not chunkable)."""


def parse_packet_limit(text: str) -> PacketLimit:
    """``auto``, ``off`` or a number of bytes (``1000000``, ``1MB``, ``256kB``, ``1MiB``), as a CLI takes it."""
    value = text.strip().lower()
    if value in ("auto", "off"):
        return value  # type: ignore[return-value]  # one of the two literals
    units = {"kib": 1024, "mib": 1 << 20, "kb": 1000, "mb": 1_000_000, "b": 1, "k": 1000, "m": 1_000_000}
    number, scale = value, 1
    for unit, factor in units.items():
        if value.endswith(unit):
            number, scale = value[: -len(unit)], factor
            break
    try:
        size = int(float(number) * scale) if number.strip() else -1
    except (ValueError, OverflowError):
        size = -1
    if size < MIN_PACKET_SIZE:
        raise ConfigError(
            f"max packet size {text!r}: use auto, off, or a number of bytes >= {MIN_PACKET_SIZE} (e.g. 1MB)"
        )
    return size


@dataclass(frozen=True)
class Inbound:
    """A received message."""

    topic: str
    payload: bytes
    retain: bool
    qos: int
    received_at: float  # time.monotonic() when paho handed it over


@dataclass(frozen=True)
class Will:
    """The last will the broker publishes if the connection dies without a DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


class MqttLink:
    """A paho client with a reconnect loop, subscriptions restored after every reconnect, and byte counters.

    ``address`` says how to connect: TLS for ``mqtts://`` (its CA file, optional client certificate, hostname
    verification unless turned off), and its user name and password. A fleet broker binds MQTT client ids to user
    names, so with a fleet bundle pass ``client_id=bundle.username``.

    ``logins``: user names interchangeable with ``address``'s, with its password (a fleet kit's monitor bundle: one
    per viewer watching at once). Since a fleet broker binds a connection to its user name, two viewers on one name
    push each other off: with ``logins``, each connection logs in as one that no other viewer on this machine holds
    (:mod:`fedge_io.login_claims`), else at random; after a lost connection never the one it had, so viewers (of
    other machines) that met on one name part at the next try.
    """

    def __init__(
        self,
        address: BrokerAddress,
        client_id: str,
        *,
        subscriptions: Sequence[tuple[str, int]] = (),
        will: Will | None = None,
        on_ready: Callable[[MqttLink], None] | None = None,
        keepalive: int = 30,
        backoff: tuple[float, float] = (0.2, 10.0),
        max_packet_size: PacketLimit = "auto",
        clean_session: bool = True,
        logins: Sequence[str] = (),
    ) -> None:
        """``clean_session=False`` asks the broker to keep this client's subscriptions and undelivered QoS-1
        messages while it is away (a flaky link, a broker restarted with persistence), under a fixed client id."""
        if isinstance(max_packet_size, int) and max_packet_size < MIN_PACKET_SIZE:
            raise ConfigError(f"max packet size must be >= {MIN_PACKET_SIZE} bytes, got {max_packet_size}")
        self.address = address
        self.client_id = client_id
        self._logins = tuple(logins)
        self._claim = LoginClaim(f"{address.host}:{address.port}") if logins else None
        self.keepalive = keepalive
        self._subscriptions = list(subscriptions)
        self._on_ready = on_ready
        self._backoff = backoff
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self._ready = threading.Event()  # connected and subscribed
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending_sub: int | None = None
        self._pending_filters: list[tuple[str, int]] = []
        self._will_topic = will.topic if will is not None else None
        self._refused: str | None = None  # why start() must give up: the cause and the fix, in one line
        self._connack = False  # a CONNACK arrived on the current connection
        self._started = False  # start() returned: from now on failures are retried and logged, not raised
        self._last_error = ""  # paho's last error line, e.g. the TLS alert of a broker that dropped us
        self.connections = 0  # successful connections, so reconnects = connections - 1
        self.connected_at = 0.0  # time.monotonic() of the latest successful connection
        self.bytes_out = 0  # PUBLISH and PUBACK bytes this side wrote (by the MQTT 3.1.1 formulas)
        self.bytes_in = 0
        self.max_packet_size = max_packet_size
        self.broker_max_packet_size: int | None = None  # announced in an MQTT 5 CONNACK (see _probe_limit)
        self.chunked = 0  # messages sent as chunks

        # MQTT 3.1.1: the byte formulas of fedge.wire.protocol are for it, and amqtt speaks nothing newer.
        self._client = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=paho.MQTTv311,
            reconnect_on_failure=False,  # our own loop below reconnects, with logging and backoff
        )
        self._client.max_inflight_messages_set(1000)  # a round publishes one task per client at once
        self._client.max_queued_messages_set(0)  # unlimited: keep QoS-1 messages while reconnecting
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        if address.username is not None:
            self._client.username_pw_set(address.username, address.password)
        if address.tls:
            self._client.tls_set_context(tls_context(address))
        self._client.on_log = self._handle_log
        # Without a write callback, paho writes a packet from the thread that publishes it, while the network thread
        # may be reading: on a TLS socket that corrupts the session ("[SSL: BAD_LENGTH]", "unexpected eof"). With
        # one, it only queues the packet and wakes the network loop, which does all the writing.
        self._client.on_socket_register_write = lambda client, userdata, sock: None
        self._client.on_socket_open = _no_delay
        self._client.on_connect = self._handle_connect
        self._client.on_subscribe = self._handle_subscribe
        self._client.on_message = self._handle_message
        self._client.on_disconnect = self._handle_disconnect

    def set_will(self, will: Will) -> None:
        """Set the last will of every connection from now on (the first one when called before :meth:`start`)."""
        self._will_topic = will.topic
        self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> MqttLink:
        """Connect (retrying until ``timeout``), subscribe, and start the network thread."""
        deadline = time.monotonic() + timeout
        delay = self._backoff[0]
        probed = False
        self._take_login()
        while True:
            try:
                if not probed:  # before our own connection: a broker that binds ids to users would replace it
                    self.broker_max_packet_size = self._probe_limit(min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
                    probed = True
                self._client.connect(self.address.host, self.address.port, keepalive=self.keepalive)
                break
            except ssl.SSLError as exc:  # an OSError too, but one that waiting cannot fix
                raise TransportError(tls_failure(self.address, exc)) from exc
            except OSError as exc:
                if self.address.tls and in_handshake(exc):  # something listens there, but does not speak TLS
                    raise TransportError(
                        f"TLS handshake with broker {self.address} failed: the listener "
                        f"{'did not answer' if isinstance(exc, TimeoutError) else 'reset the connection'}; is port "
                        f"{self.address.port} its TLS listener? (use mqtt:// for a plain one)"
                    ) from exc
                if time.monotonic() + delay > deadline:
                    raise TransportError(
                        f"cannot reach broker at {self.address}: {exc}; is it running? {start_hint(self.address)}"
                    ) from exc
                log.info("broker %s not reachable yet (%s); retrying in %.1f s", self.address, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
        self._thread = threading.Thread(target=self._network_loop, name=f"mqtt-{self.client_id}", daemon=True)
        self._thread.start()
        while not self._ready.wait(0.05):
            if self._refused:
                self.close(wait=0)
                raise TransportError(self._refused)
            if time.monotonic() > deadline:
                self.close(wait=0)
                raise TransportError(
                    f"connected to {self.address} but got no CONNACK/SUBACK in {timeout:.0f} s; is it an MQTT broker?"
                )
        self._started = True
        return self

    def close(self, *, final: Sequence[tuple[str, bytes, bool]] = (), wait: float = 2.0) -> None:
        """Publish ``final`` (topic, payload, retain) messages, wait up to ``wait`` s for them, and disconnect."""
        infos = [self._client.publish(t, p, qos=1, retain=r) for t, p, r in final] if self.connected else []
        deadline = time.monotonic() + wait
        for info in infos:
            while not info.is_published() and time.monotonic() < deadline and self.connected:
                time.sleep(0.01)
        self._stopping.set()
        self._client.disconnect()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(wait, 1.0))
        if self._claim is not None:
            self._claim.release()

    def __enter__(self) -> MqttLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float) -> bool:
        """Block until connected and subscribed (again); False on timeout."""
        return self._ready.wait(timeout)

    # --- traffic ----------------------------------------------------------------------------------------------

    @property
    def packet_limit(self) -> int | None:
        """The largest packet :meth:`send` publishes: the configured limit capped by the broker's; None: no limit."""
        if self.max_packet_size == "off":
            return None
        broker = self.broker_max_packet_size
        if self.max_packet_size == "auto":
            return broker
        return self.max_packet_size if broker is None else min(self.max_packet_size, broker)

    def chunk_bytes(self, topic: str, qos: int = 1) -> int | None:
        """The largest payload of one PUBLISH on ``topic`` within :attr:`packet_limit`; None: no limit."""
        limit = self.packet_limit
        return None if limit is None else chunking.largest_payload(topic, limit, qos=qos)

    def send(self, topic: str, payload: bytes, *, qos: int = 1) -> list[int]:
        """Publish a message, as chunks when it does not fit :attr:`packet_limit`; the payload size of each PUBLISH.

        The sizes are what the byte ledger counts: chunk headers included. Never retained (a broker keeps only the
        last retained message of a topic, so a chunked one could not be read back).
        """
        limit = self.chunk_bytes(topic, qos)
        if limit is None or len(payload) <= limit:
            self.publish(topic, payload, qos=qos)
            return [len(payload)]
        # A random id: a restarted sender must not reuse the id of a message still being reassembled.
        parts = chunking.split(payload, limit, secrets.randbits(64))
        for part in parts:
            self.publish(topic, part, qos=qos)
        self.chunked += 1
        log.debug("sent %d bytes to %s as %d chunks of <= %d bytes", len(payload), topic, len(parts), limit)
        return [len(part) for part in parts]

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> paho.MQTTMessageInfo:
        """Queue one PUBLISH; paho sends it now or after the next reconnect (QoS > 0).

        :class:`PacketTooLarge` when it exceeds the broker's announced limit or the configured one: the broker would
        close the connection and paho would resend the packet after every reconnect, forever.
        """
        size = publish_packet_bytes(topic, len(payload), qos)
        limits = [x for x in (self.broker_max_packet_size, self.max_packet_size) if isinstance(x, int)]
        if limits and size > min(limits):
            raise PacketTooLarge(self._too_large(topic, size, min(limits)))
        info = self._client.publish(topic, payload, qos=qos, retain=retain)
        if info.rc not in (paho.MQTT_ERR_SUCCESS, paho.MQTT_ERR_NO_CONN):
            raise TransportError(f"publishing {len(payload)} bytes to {topic!r} failed: {paho.error_string(info.rc)}")
        with self._lock:
            self.bytes_out += publish_packet_bytes(topic, len(payload), qos)
            self.bytes_in += PUBACK_BYTES if qos == 1 else 0
        return info

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now and after every reconnect."""
        self._subscriptions.append((topic, qos))
        if self.connected:
            self._client.subscribe(topic, qos)

    def _too_large(self, topic: str, size: int, limit: int) -> str:
        whose = (
            "the broker's maximum packet size (announced in its MQTT 5 CONNACK)"
            if limit == self.broker_max_packet_size
            else "the configured --max-packet-size"
        )
        fix = (
            "chunking is off (--max-packet-size off): leave it at auto to send large messages in chunks"
            if self.max_packet_size == "off"
            else "send it with MqttLink.send, which chunks it"
        )
        return f"a {size:,}-byte packet on {topic} exceeds {whose} of {limit:,} bytes; {fix}"

    def get(self, timeout: float | None = None) -> Inbound | None:
        """The next received message, or None after ``timeout`` seconds."""
        try:
            return self.inbox.get(timeout=timeout) if timeout is None or timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    # --- paho thread ------------------------------------------------------------------------------------------

    def _probe_limit(self, timeout: float) -> int | None:
        """The broker's Maximum Packet Size from an MQTT 5 CONNACK; None if it announces none or speaks only 3.1.1.

        Raises what connecting raises (unreachable, TLS failures), for :meth:`start` to retry or report; any other
        failure (a refused login, no answer) leaves the limit unknown, and the real connection reports it.
        """
        probe = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=paho.MQTTv5)
        if self.address.username is not None:
            probe.username_pw_set(self.address.username, self.address.password)
        if self.address.tls:
            probe.tls_set_context(tls_context(self.address))
        answer: dict[str, Any] = {}

        def on_connect(client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            answer["ok"] = not reason.is_failure
            answer["limit"] = getattr(props, "MaximumPacketSize", None)

        def on_disconnect(client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
            answer.setdefault("ok", False)

        probe.on_connect, probe.on_disconnect = on_connect, on_disconnect
        probe.connect(self.address.host, self.address.port, keepalive=max(self.keepalive, 5))
        try:
            deadline = time.monotonic() + max(timeout, 0.1)
            while "ok" not in answer and time.monotonic() < deadline:
                if probe.loop(timeout=0.05) != paho.MQTT_ERR_SUCCESS:
                    break  # the broker closed the connection: it does not speak MQTT 5, or refused us
        finally:
            with contextlib.suppress(Exception):  # the broker may have closed the connection already
                probe.disconnect()
                probe.loop(timeout=0.05)  # writes the DISCONNECT, then closes the socket
            sock = probe.socket()
            if sock is not None:  # no answer in time: close it ourselves
                with contextlib.suppress(OSError):
                    sock.close()
        limit = answer.get("limit") if answer.get("ok") else None
        if isinstance(limit, int) and limit > 0:
            log.info("broker %s announces a maximum packet size of %d bytes", self.address, limit)
            return limit
        log.debug("broker %s announced no packet limit (%s)", self.address, answer or "no MQTT 5 CONNACK")
        return None

    def _network_loop(self) -> None:
        delay = self._backoff[0]
        while not self._stopping.is_set():
            try:
                # loop() rather than loop_forever(): only loop() makes the socket pair that publish() uses to wake us.
                # Both return an error when the connection drops or after our DISCONNECT went out.
                while self._client.loop(timeout=1.0) == paho.MQTT_ERR_SUCCESS and self._read_stalled_packet():
                    pass
            except Exception:  # a bug in a callback must not silently kill the only network thread
                log.exception("MQTT network loop of %s failed", self.client_id)
            self._ready.clear()
            if self._stopping.is_set() or (self._refused and not self._started):
                break  # start() raises the reason: retrying a refused login or TLS setup cannot help
            log.warning("lost the connection to %s; reconnecting", self.address)
            while not self._stopping.wait(delay):
                try:
                    self._take_login()
                    self._client.reconnect()
                    delay = self._backoff[0]
                    break
                except OSError as exc:
                    delay = min(delay * 2, self._backoff[1])
                    log.warning("cannot reach broker at %s: %s; next try in %.1f s", self.address, exc, delay)

    def _take_login(self) -> None:
        """Log in as another of ``logins`` from the next connection on (none: keep the current login)."""
        if self._claim is None:
            return
        user = self._claim.take(self._logins, avoid=self._claim.name)
        self.address = self.address.with_login(user, self.address.password)
        self.client_id = user  # a fleet broker's client id is the user name (amqtt's FleetAuthPlugin checks it)
        self._client.username_pw_set(user, self.address.password)
        self._client._client_id = user.encode()  # paho has no setter; CONNECT reads it at every (re)connect

    def _read_stalled_packet(self) -> bool:
        """Handle a packet paho has read whole but left unhandled; False if the connection is gone.

        paho 2.2 reads a packet with at most 100 recv() calls per network event (``_packet_read``); when the 100th
        call completes the packet, it returns without handling it, and the message waits for the next bytes to
        arrive: up to a keepalive interval. Over TLS, where a recv() returns one record (<= 16 kB), a 2.3 MB model
        takes ~143 calls and stalled about one round trip in 30. Reading again handles it; with nothing there, the
        read is one non-blocking recv() that returns at once.
        """
        return self._client.loop_read() == paho.MQTT_ERR_SUCCESS

    def _handle_log(self, client: paho.Client, userdata: Any, level: int, text: str) -> None:
        if level == paho.MQTT_LOG_ERR:
            self._last_error = text

    def _handle_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._connack = True
        if reason.is_failure:
            self._refused = login_refusal(self.address, self.client_id, str(reason), self._will_topic)
            if self._started:  # before that, start() raises it
                log.error("%s", self._refused)
            return
        self.connections += 1
        self.connected_at = time.monotonic()
        if self.connections > 1:
            log.info("reconnected to %s (connection %d)", self.address, self.connections)
        if self._subscriptions:
            # The hello goes out only after the SUBACK, so whoever reacts to it finds us subscribed.
            self._pending_filters = list(self._subscriptions)
            _, self._pending_sub = client.subscribe(self._pending_filters)
        else:
            self._become_ready()

    def _handle_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        initial = mid == self._pending_sub  # the subscriptions sent on (re)connecting, not a later subscribe()
        filters = [f for f, _ in self._pending_filters] if initial else ["a later subscription"] * len(reasons)
        failed = [f for f, r in zip(filters, reasons, strict=False) if r.is_failure]
        if failed:
            # A SUBACK failure (0x80) is how a broker's ACL says no to a subscription; a run that cannot hear its
            # tasks or updates cannot work, so the first connection gives up instead of waiting for nothing.
            why = subscription_refusal(self.address, self.client_id, failed)
            if initial and not self._started:
                self._refused = why
                return
            log.error("%s", why)
        if initial:
            self._become_ready()

    def _become_ready(self) -> None:
        if self._on_ready is not None:
            try:
                self._on_ready(self)
            except Exception:
                log.exception("on_ready hook of %s failed", self.client_id)
        self._ready.set()

    def _handle_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        with self._lock:
            self.bytes_in += publish_packet_bytes(msg.topic, len(msg.payload), msg.qos)
            self.bytes_out += PUBACK_BYTES if msg.qos == 1 else 0
        self.inbox.put(Inbound(msg.topic, bytes(msg.payload), bool(msg.retain), msg.qos, time.monotonic()))

    def _handle_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        self._ready.clear()
        if not self._connack and not self._stopping.is_set():
            # Dropped before any CONNACK: a TLS listener hearing plain MQTT, a rejected client certificate, ...
            why = early_close(self.address, self._last_error)
            if not self._started:
                self._refused = self._refused or why
            else:
                log.warning("%s", why)
        elif self._started and not self._stopping.is_set():
            log.warning("disconnected from %s: %s", self.address, reason)
        self._connack = False


def _no_delay(client: paho.Client, userdata: Any, sock: Any) -> None:
    """Send small packets at once: with Nagle's algorithm, a message written right after a PUBACK waits for the
    peer's delayed ACK (40 ms on Linux), which made a 40 kB round trip take ~88 ms instead of a few."""
    with contextlib.suppress(OSError, AttributeError):  # not a TCP socket (a test double, a unix socket)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
