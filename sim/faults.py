"""Faults injected by real means, to test a fleet against its network and its broker.

- :class:`BrokerOutage`: the kit's mosquitto process, stopped (SIGTERM: it saves its persistent sessions) once a run
  has recorded a given number of rounds, and started again from the same kit on the same port after a pause.
- :class:`FlakyProxy`: a TCP proxy on loopback between one client and the broker that ends every connection after a
  while (alternately a clean FIN and a reset, as a lost Wi-Fi link looks to the peer) and delays every chunk of data.

Both are used by the fault tests (``tests/coordinator/test_faults.py``) and by ``experiments/faults.py``, which
measures what each fault costs a run (rounds lost, model difference, wall time) against an undisturbed run.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from pathlib import Path
from types import TracebackType

from sim.brokers import fleet_mosquitto


class BrokerOutage:
    """Starts the kit's mosquitto from ``broker_dir``; once ``run_dir/metrics.jsonl`` has ``after_rounds`` lines, stops
    it for ``seconds`` and starts it again on the same port. :attr:`url` is the broker's URL throughout."""

    def __init__(self, broker_dir: Path, run_dir: Path, seconds: float, after_rounds: int = 1) -> None:
        self.broker_dir, self.run_dir, self.seconds, self.after_rounds = broker_dir, run_dir, seconds, after_rounds
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(fleet_mosquitto(broker_dir))
        self.stopped_at: float | None = None
        self.restarted_at: float | None = None
        self.error: BaseException | None = None
        self._closing = threading.Event()  # set by close(): the thread starts no broker after that
        self._lock = threading.Lock()  # the thread's stop/start against close()'s stop
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            metrics = self.run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not self._closing.is_set():
                if metrics.exists() and metrics.read_text().count("\n") >= self.after_rounds:
                    break
                time.sleep(0.02)
            with self._lock:
                if self._closing.is_set():
                    return
                self._stack.close()  # SIGTERM: mosquitto saves its sessions and stops
                self.stopped_at = time.monotonic()
            if self._closing.wait(self.seconds):
                return
            with self._lock:
                if self._closing.is_set():
                    return
                self._stack.enter_context(fleet_mosquitto(self.broker_dir))  # the same kit, the same port
                self.restarted_at = time.monotonic()
        except BaseException as exc:  # reported by whoever closes the outage
            self.error = exc

    def close(self) -> None:
        """Stops the broker; an outage that has not ended by then never starts it again (no orphaned mosquitto)."""
        self._closing.set()
        with self._lock:
            self._stack.close()
        self._thread.join(timeout=30)

    def __enter__(self) -> BrokerOutage:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class FlakyProxy:
    """A TCP proxy on ``127.0.0.1:port`` in front of the broker at ``target_port``: every connection through it ends
    ``cut_after`` seconds after it opened, alternately cut cleanly (FIN) and dropped (RST), and every chunk of data is
    held ``delay`` seconds before it is passed on. The client behind it reconnects again and again, over a slow link."""

    def __init__(self, target_port: int, cut_after: float, delay: float = 0.0) -> None:
        self.target_port, self.cut_after, self.delay = target_port, cut_after, delay
        self.connections = 0
        self.cuts = 0
        self.first_cut = threading.Event()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                down, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the broker is down: the client sees its connection closed, as it would on a real link
                down.close()
                continue
            self.connections += 1
            drop = self.connections % 2 == 0  # every other connection ends with a reset instead of a clean cut
            opened = time.monotonic()
            threading.Thread(target=self._pipe, args=(down, up, opened, drop), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, opened, drop), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, opened: float, drop: bool) -> None:
        src.settimeout(0.1)
        try:
            while not self._stop.is_set():
                if time.monotonic() - opened > self.cut_after:
                    self.cuts += 1
                    self.first_cut.set()
                    break
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    if drop:  # linger 0: close sends a reset, no FIN
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    else:
                        s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
