"""One MQTT connection for either role: connect with retries, an explicit reconnect loop, a thread-safe inbox.

This is the one module of the core that does network I/O. It lives here rather than in ``coordinator`` or
``edge_client`` because both roles need exactly the same connection handling and neither role package may depend on
the other; everything protocol-specific (topics, messages, byte formulas) stays pure in :mod:`fedge.protocol`.

Threading: paho's network loop runs in one background thread owned by :class:`MqttLink`; it only moves packets and
puts received messages into a :class:`queue.Queue`. The owner reads the queue from its own thread, so no algorithm
code ever runs inside a paho callback. ``publish`` may be called from any thread (paho locks its queues).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho

from fedge.errors import TransportError
from fedge.protocol import PUBACK_BYTES, BrokerAddress, publish_packet_bytes

log = logging.getLogger(__name__)

START_HINT = (
    "start one with `mosquitto -p PORT` (apt-get install mosquitto), "
    "or run `fedge sim --transport mqtt` without --broker for an embedded broker"
)


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
    """A paho client with a reconnect loop, subscriptions restored after every reconnect, and byte counters."""

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
    ) -> None:
        self.address = address
        self.client_id = client_id
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
        self._refused: str | None = None
        self.connections = 0  # successful connections, so reconnects = connections - 1
        self.bytes_out = 0  # PUBLISH and PUBACK bytes this side wrote (by the MQTT 3.1.1 formulas)
        self.bytes_in = 0

        # MQTT 3.1.1: the byte formulas of fedge.protocol are for it, and amqtt speaks nothing newer.
        self._client = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=True,
            protocol=paho.MQTTv311,
            reconnect_on_failure=False,  # our own loop below reconnects, with logging and backoff
        )
        self._client.max_inflight_messages_set(1000)  # a round publishes one task per client at once
        self._client.max_queued_messages_set(0)  # unlimited: keep QoS-1 messages while reconnecting
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        self._client.on_connect = self._handle_connect
        self._client.on_subscribe = self._handle_subscribe
        self._client.on_message = self._handle_message
        self._client.on_disconnect = self._handle_disconnect

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> MqttLink:
        """Connect (retrying until ``timeout``), subscribe, and start the network thread."""
        deadline = time.monotonic() + timeout
        delay = self._backoff[0]
        while True:
            try:
                self._client.connect(self.address.host, self.address.port, keepalive=self.keepalive)
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise TransportError(
                        f"cannot reach broker at {self.address}: {exc}; is it running? {START_HINT}"
                    ) from exc
                log.info("broker %s not reachable yet (%s); retrying in %.1f s", self.address, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
        self._thread = threading.Thread(target=self._network_loop, name=f"mqtt-{self.client_id}", daemon=True)
        self._thread.start()
        while not self._ready.wait(0.05):
            if self._refused:
                self.close(wait=0)
                raise TransportError(f"broker at {self.address} refused the connection: {self._refused}")
            if time.monotonic() > deadline:
                self.close(wait=0)
                raise TransportError(
                    f"connected to {self.address} but got no CONNACK/SUBACK in {timeout:.0f} s; is it an MQTT broker?"
                )
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

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> paho.MQTTMessageInfo:
        """Queue a message; paho sends it now or after the next reconnect (QoS > 0)."""
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

    def get(self, timeout: float | None = None) -> Inbound | None:
        """The next received message, or None after ``timeout`` seconds."""
        try:
            return self.inbox.get(timeout=timeout) if timeout is None or timeout > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    # --- paho thread ------------------------------------------------------------------------------------------

    def _network_loop(self) -> None:
        delay = self._backoff[0]
        while not self._stopping.is_set():
            try:
                self._client.loop_forever()  # returns when the connection drops (reconnect_on_failure=False)
            except Exception:  # a bug in a callback must not silently kill the only network thread
                log.exception("MQTT network loop of %s failed", self.client_id)
            self._ready.clear()
            if self._stopping.is_set():
                break
            log.warning("lost the connection to %s; reconnecting", self.address)
            while not self._stopping.wait(delay):
                try:
                    self._client.reconnect()
                    delay = self._backoff[0]
                    break
                except OSError as exc:
                    delay = min(delay * 2, self._backoff[1])
                    log.warning("cannot reach broker at %s: %s; next try in %.1f s", self.address, exc, delay)

    def _handle_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self._refused = str(reason)
            log.error("broker at %s refused the connection: %s", self.address, reason)
            return
        self.connections += 1
        if self.connections > 1:
            log.info("reconnected to %s (connection %d)", self.address, self.connections)
        if self._subscriptions:
            # The hello goes out only after the SUBACK, so whoever reacts to it finds us subscribed.
            _, self._pending_sub = client.subscribe(list(self._subscriptions))
        else:
            self._become_ready()

    def _handle_subscribe(self, client: paho.Client, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        if mid != self._pending_sub:
            return
        failed = [str(r) for r in reasons if r.is_failure]
        if failed:
            log.error("broker at %s refused subscriptions %s: %s", self.address, self._subscriptions, failed)
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
        if not self._stopping.is_set():
            log.warning("disconnected from %s: %s", self.address, reason)
