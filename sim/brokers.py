"""Brokers for laptop runs and tests: an embedded amqtt broker, and a private mosquitto on a free port.

Both listen on 127.0.0.1 only and are context managers yielding the URL ``mqtt://127.0.0.1:PORT``:

    with embedded_broker() as url: ...       # nothing to install (amqtt runs in a thread of this process)
    with mosquitto_broker() as url: ...      # needs the mosquitto binary (apt-get install mosquitto)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedge.errors import TransportError

log = logging.getLogger(__name__)

MOSQUITTO_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


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


@contextlib.contextmanager
def embedded_broker(port: int | None = None, *, sys_interval: int = 0) -> Iterator[str]:
    """An amqtt broker on 127.0.0.1 in its own thread and event loop; anonymous clients allowed.

    ``sys_interval`` > 0 makes it publish ``$SYS/broker/load/bytes/{received,sent}`` every that many seconds.
    """
    from amqtt.broker import Broker

    port = port or free_port()
    plugins: dict[str, Any] = {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}}
    if sys_interval > 0:
        plugins["amqtt.plugins.sys.broker.BrokerSysPlugin"] = {"sys_interval": sys_interval}
    config = {
        # Bind loopback only: amqtt's default is 0.0.0.0:1883, which would expose a laptop run to the network.
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}", "max_connections": -1}},
        "plugins": plugins,
    }
    logging.getLogger("amqtt").setLevel(logging.ERROR)  # it logs every PUBACK race as a warning
    logging.getLogger("transitions").setLevel(logging.WARNING)  # amqtt's state machine logs every transition
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []
    holder: dict[str, Broker] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)

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
    url = f"mqtt://127.0.0.1:{port}"
    log.info("embedded broker (amqtt) listening on %s", url)
    try:
        yield url
    finally:
        try:
            asyncio.run_coroutine_threadsafe(holder["broker"].shutdown(), loop).result(10)
        except Exception as exc:  # shutting down must not hide the error that brought us here
            log.warning("embedded broker did not shut down cleanly: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        if not thread.is_alive():
            loop.close()


def find_mosquitto() -> str:
    """Path of the mosquitto binary; TransportError saying how to install it if there is none."""
    found = shutil.which("mosquitto") or next((p for p in MOSQUITTO_PATHS if Path(p).exists()), None)
    if found is None:
        raise TransportError(
            "mosquitto is not installed: apt-get install mosquitto (Debian/Ubuntu/JetPack) or brew install mosquitto; "
            "or leave out --broker to use the embedded broker"
        )
    return found


@contextlib.contextmanager
def mosquitto_broker(port: int | None = None, *, sys_interval: int = 1, binary: str | None = None) -> Iterator[str]:
    """A private mosquitto on 127.0.0.1:PORT with anonymous access and $SYS byte counters; stopped by PID."""
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
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
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
