"""Brokers for laptop runs and tests: an embedded amqtt broker, and a private mosquitto on a free port.

Both listen on 127.0.0.1 only and are context managers yielding the URL ``mqtt://127.0.0.1:PORT``:

    with embedded_broker() as url: ...       # nothing to install (amqtt runs in a thread of this process)
    with mosquitto_broker() as url: ...      # needs the mosquitto binary (apt-get install mosquitto)

Secured by a fleet kit (:mod:`coordinator.kit`), yielding ``mqtts://127.0.0.1:PORT`` (``mqtt://`` for a kit
without TLS); connect with the kit's bundles (:func:`fedge_io.credentials.load_bundle` with ``broker=url``):

    with fleet_mosquitto(kit.broker_dir) as url: ...               # mosquitto run from the kit's mosquitto.conf
    with embedded_broker(fleet=kit.broker_dir) as url: ...         # amqtt with the kit's users and ACL

What the embedded broker (amqtt 0.12.1) enforces of a fleet kit, and what it does not:
- enforced: no anonymous login; each user's password (the kit's Argon2 file, amqtt's FileAuthPlugin); the kit's
  ACL on publish (denied messages are acknowledged and dropped, as mosquitto does), on subscribe (SUBACK 0x80, which
  mosquitto 2.0 never sends: it filters on delivery instead) and on delivery; client id = user name; a last will
  only on a topic its user may publish to; TLS 1.2+ with the kit's server certificate.
- NOT enforced: amqtt acts on a CONNECT's client id before it checks the password. With a clean session it first
  deletes the subscriptions of a connected client of that id, so anyone who can reach the port can cut that client
  off from its tasks without logging in (broker.py, ``_initialize_client_session``); it still cannot read or
  publish anything. Loopback binding limits this to processes on the same machine. Mutual TLS is not required
  (amqtt sets ``CERT_OPTIONAL``). Use :func:`fleet_mosquitto` where that matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amqtt.plugins.authentication import FileAuthPlugin
from amqtt.plugins.topic_checking import TopicAccessControlListPlugin
from amqtt.session import Session

from coordinator.broker_setup import find_mosquitto as find_mosquitto_binary
from coordinator.kit.broker_files import EMBEDDED_BROKER_FILE
from fedge.errors import TransportError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process could still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once something accepts TCP connections on (host, port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.02)
    return False


class FleetAuthPlugin(FileAuthPlugin):
    """amqtt's password-file check, plus two rules a fleet's mosquitto enforces: the MQTT client id is the user name
    (``use_username_as_clientid``), and a last will may only go to a topic its user may publish to."""

    @dataclass
    class Config:
        password_file: str | None = None  # Argon2 lines, as the fleet kit's amqtt-passwd
        publish_acl: dict[str, list[str]] = field(default_factory=dict)

    async def authenticate(self, *, session: Session) -> bool | None:
        if not session.username:
            return False  # amqtt would ignore the plugin's None; a fleet broker has no anonymous users
        if not await super().authenticate(session=session):
            return False
        if session.client_id != session.username:
            self.context.logger.info(f"refused {session.username!r}: client id {session.client_id!r} is not its name")
            return False
        if session.will_flag:
            # amqtt publishes a last will without any ACL check: without this, a client could forge another's
            # "offline" status by naming that client's status topic as its will and dropping its connection.
            allowed = self.config.publish_acl.get(session.username, [])
            if not any(TopicAccessControlListPlugin.topic_ac(session.will_topic or "", t) for t in allowed):
                self.context.logger.info(f"refused {session.username!r}: last will on {session.will_topic!r}")
                return False
        return True


class FleetTopicPlugin(TopicAccessControlListPlugin):
    """amqtt's topic ACL with all three of its lists: its own ``Config`` declares only the publish list and the
    deprecated ``acl``, so amqtt 0.12.1 cannot be given the subscribe and receive lists otherwise."""

    @dataclass
    class Config:
        publish_acl: dict[str, list[str]] = field(default_factory=dict)
        subscribe_acl: dict[str, list[str]] = field(default_factory=dict)
        receive_acl: dict[str, list[str]] = field(default_factory=dict)


def _fleet_plugins(broker_dir: Path) -> dict[str, Any]:
    """amqtt plugin settings for a fleet kit's users (amqtt-passwd) and ACL (acl.json)."""
    passwords, acl_file = broker_dir / "amqtt-passwd", broker_dir / "acl.json"
    if not passwords.is_file() or not acl_file.is_file():
        raise TransportError(f"{broker_dir} is not the broker directory of a fleet kit (no amqtt-passwd or acl.json)")
    acl = json.loads(acl_file.read_text())
    write = {user: list(grant["write"]) for user, grant in acl.items()}
    read = {user: list(grant["read"]) for user, grant in acl.items()}
    return {
        f"{__name__}.FleetAuthPlugin": {"password_file": str(passwords), "publish_acl": write},
        f"{__name__}.FleetTopicPlugin": {"publish_acl": write, "subscribe_acl": read, "receive_acl": read},
    }


@contextlib.contextmanager
def embedded_broker(
    port: int | None = None, *, sys_interval: int = 0, fleet: str | os.PathLike[str] | None = None
) -> Iterator[str]:
    """An amqtt broker on 127.0.0.1 in its own thread and event loop; yields its URL.

    Without ``fleet``, anonymous clients may do anything. With ``fleet`` (a fleet kit's ``broker`` directory), it
    takes the kit's users and ACL and, when the kit has a server certificate, speaks TLS (``mqtts://``); see the
    module docstring for what it does not enforce. ``sys_interval`` > 0 makes it publish
    ``$SYS/broker/load/bytes/{received,sent}`` every that many seconds.
    """
    from amqtt.broker import Broker

    port = port or free_port()
    # Bind loopback only: amqtt's default is 0.0.0.0:1883, which would expose a laptop run to the network.
    listener: dict[str, Any] = {"type": "tcp", "bind": f"127.0.0.1:{port}", "max_connections": -1}
    scheme = "mqtt"
    if fleet is None:
        plugins: dict[str, Any] = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    else:
        broker_dir = Path(fleet)
        plugins = _fleet_plugins(broker_dir)
        if (broker_dir / "server.crt").is_file():
            listener.update(ssl=True, certfile=str(broker_dir / "server.crt"), keyfile=str(broker_dir / "server.key"))
            scheme = "mqtts"
    if sys_interval > 0:
        plugins["amqtt.plugins.sys.broker.BrokerSysPlugin"] = {"sys_interval": sys_interval}
    config = {"listeners": {"default": listener}, "plugins": plugins}
    logging.getLogger("amqtt").setLevel(logging.ERROR)  # it logs every PUBACK race as a warning
    logging.getLogger("transitions").setLevel(logging.WARNING)  # amqtt's state machine logs every transition
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []
    holder: dict[str, Broker] = {}

    def quiet_resets(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # amqtt lets the reset of a connection it refused reach asyncio, which would print a traceback for it: every
        # fedge client's MQTT 5 probe (fedge_io.mqtt) is such a connection, closed before amqtt's own close.
        exc = context.get("exception")
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)) or (
            isinstance(exc, OSError) and exc.errno in (errno.ENOTCONN, errno.EPIPE, errno.ECONNRESET)
        ):
            log.debug("embedded broker: a client dropped its connection: %s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(quiet_resets)

        async def start() -> None:
            broker = Broker(config, loop=loop)
            await broker.start()
            holder["broker"] = broker

        try:
            loop.run_until_complete(start())
        except BaseException as exc:  # report to the caller's thread instead of dying silently
            failure.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name=f"amqtt-{port}", daemon=True)
    thread.start()
    started.wait(30)
    if failure or "broker" not in holder:
        raise TransportError(
            f"the embedded MQTT broker could not start on 127.0.0.1:{port}: {failure[:1] or 'timeout'}"
        )
    url = f"{scheme}://127.0.0.1:{port}"
    log.info("embedded broker (amqtt) listening on %s%s", url, " with a fleet kit's users and ACL" if fleet else "")
    marker = _mark_kit(Path(fleet), url) if fleet is not None else None
    try:
        yield url
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
        try:
            asyncio.run_coroutine_threadsafe(holder["broker"].shutdown(), loop).result(10)
        except Exception as exc:  # shutting down must not hide the error that brought us here
            log.warning("embedded broker did not shut down cleanly: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()


def _mark_kit(broker_dir: Path, url: str) -> Path | None:
    """Tell ``fedge kit`` that this process serves the kit: amqtt reads the users and ACL once, at start (its
    FileAuthPlugin has no reload), so an added device would not get in and a revoked one would stay connected."""
    marker = broker_dir / EMBEDDED_BROKER_FILE
    try:
        marker.write_text(json.dumps({"pid": os.getpid(), "url": url}) + "\n")
    except OSError as exc:  # a kit this user may read but not write: fedge kit could not change it either
        log.info("cannot mark %s as served by the embedded broker: %s", broker_dir, exc.strerror)
        return None
    return marker


def find_mosquitto() -> str:
    """Path of the mosquitto binary; TransportError saying how to install it if there is none."""
    found = find_mosquitto_binary()
    if found is None:
        raise TransportError(
            "mosquitto is not installed: apt-get install mosquitto (Debian/Ubuntu/JetPack) or brew install mosquitto; "
            "or leave out --broker to use the embedded broker"
        )
    return found


@contextlib.contextmanager
def mosquitto_broker(
    port: int | None = None, *, sys_interval: int = 1, binary: str | None = None, max_packet_size: int | None = None
) -> Iterator[str]:
    """A private mosquitto on 127.0.0.1:PORT with anonymous access and $SYS byte counters; stopped by PID.

    ``max_packet_size``: the largest packet it accepts (it closes the connection of a client sending a larger one and
    announces the limit to MQTT 5 clients), as EMQX's 1 MB default; None: no limit."""
    exe = binary or find_mosquitto()
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="fedge-mosquitto-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        conf.write_text(
            f"listener {port} 127.0.0.1\n"
            "allow_anonymous true\n"
            f"sys_interval {sys_interval}\n"
            "persistence false\n"
            "max_queued_messages 10000\n"  # a round queues one task per client at once
            "set_tcp_nodelay true\n"  # else a message sent right after a PUBACK waits 40 ms for a delayed ACK
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            + (f"max_packet_size {max_packet_size}\n" if max_packet_size else "")
        )
        log_path = Path(tmp) / "mosquitto.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
            try:
                if not wait_for_port("127.0.0.1", port, 10.0):
                    proc.kill()
                    raise TransportError(
                        f"mosquitto did not start on 127.0.0.1:{port}: {log_path.read_text()[-1000:] or 'no output'}"
                    )
                url = f"mqtt://127.0.0.1:{port}"
                log.info("mosquitto (pid %d) listening on %s", proc.pid, url)
                yield url
            finally:
                stop_process(proc)


@contextlib.contextmanager
def fleet_mosquitto(broker_dir: str | os.PathLike[str], *, binary: str | None = None) -> Iterator[str]:
    """mosquitto run from a fleet kit's generated ``mosquitto.conf`` (in ``broker_dir``); yields the URL to reach it
    from this machine (the listener's bind address, else 127.0.0.1). Stopped by PID."""
    exe = binary or find_mosquitto()
    conf = Path(broker_dir) / "mosquitto.conf"
    try:
        text = conf.read_text()
    except OSError as exc:
        raise TransportError(f"cannot read {conf}: {exc.strerror}; pass the broker directory of a fleet kit") from None
    listeners = [line.split() for line in text.splitlines() if line.startswith("listener ")]
    if len(listeners) != 1:
        raise TransportError(f"{conf} must have exactly one listener line, has {len(listeners)}")
    port, host = int(listeners[0][1]), (listeners[0][2:] or ["127.0.0.1"])[0]
    scheme = "mqtts" if any(line.startswith("certfile ") for line in text.splitlines()) else "mqtt"
    with tempfile.TemporaryDirectory(prefix="fedge-fleet-mosquitto-") as tmp:
        if os.geteuid() == 0:
            # Started as root, mosquitto becomes user 'mosquitto' before it reads the password file, ACL and keys,
            # which the kit keeps private to the user who made them (root here, in a container or CI).
            effective = Path(tmp) / "mosquitto.conf"
            effective.write_text(
                text + "\n# added by sim.brokers.fleet_mosquitto: the kit's files belong to root\nuser root\n"
            )
            conf = effective
        log_path = Path(tmp) / "mosquitto.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
            try:
                if not wait_for_port(host, port, 10.0):
                    proc.kill()
                    raise TransportError(
                        f"mosquitto did not start from {conf}: {log_path.read_text()[-1000:] or 'no output'}"
                    )
                url = f"{scheme}://{host}:{port}"
                log.info("mosquitto (pid %d) from fleet kit %s listening on %s", proc.pid, broker_dir, url)
                yield url
            finally:
                stop_process(proc)


def stop_process(proc: subprocess.Popen[Any], grace: float = 5.0) -> int | None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
    return proc.returncode
