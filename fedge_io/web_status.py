"""``fedge status --web [ADDRESS:]PORT``: the live fleet view as a small read-only web page.

The same subscription as the terminal view (:mod:`fedge_io.monitor`), served by the standard library's
:class:`~http.server.ThreadingHTTPServer` from the status process: ``/`` is the page, rendered on the server with the
latest status (it shows something without JavaScript), and ``/status.json`` is what its few lines of inline script
poll every second to redraw it. Nothing else is answered (404; other methods than GET: 501). No external asset: the
CSS and the script are inline, allowed by their SHA-256 in the Content-Security-Policy, which allows nothing else.

What the broker sends is hostile until checked: only a status that :func:`fedge.wire.run_status.decode_run_status`
accepted is shown, every displayed string goes through :func:`fedge.wire.fields.printable` and is HTML-escaped (the
script
only sets ``textContent``); the JSON holds those display texts and, for scripts, the decoded fields as validated
(bounded in size and count, JSON-escaped, not filtered to printable characters). No login
detail is ever part of a page. Bound to a loopback address (the default), the server answers only requests whose
Host is a loopback name, so that a web page elsewhere cannot read it through DNS rebinding.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TextIO
from urllib.parse import urlsplit

from fedge.accounting.units import format_bytes
from fedge.errors import CodecError, ConfigError
from fedge.wire.fields import printable
from fedge.wire.protocol import BrokerAddress, Topics
from fedge.wire.run_status import RunStatus, after, decode_run_status, is_gone
from fedge_io.connection import is_loopback
from fedge_io.monitor import (  # the terminal view's rules: one answer to "is it gone?", one list format, one table
    CLIENT_HEADERS,
    LATE_S,
    ROUND_HEADERS,
    client_cells,
    joining_text,
    names_text,
    progress_text,
    round_cells,
)
from fedge_io.mqtt import MqttLink

log = logging.getLogger(__name__)

POLL_MS = 1000  # how often the page asks for /status.json

# Display ids of the page, in order, with their labels; the JSON's "view" carries one text per id.
FIELDS: tuple[tuple[str, str], ...] = (
    ("about", "run"),
    ("progress", "time"),
    ("round", "round"),
    ("phase", "phase"),
    ("deadline", "deadline"),
    ("clients", "clients"),
    ("online", "online"),
    ("sampled", "sampled"),
    ("replied", "replied"),
    ("waiting", "waiting"),
    ("dropped", "dropped"),
    ("accuracy", "last accuracy"),
    ("skipped", "skipped rounds"),
    ("bytes", "bytes so far"),
    ("epsilon", "privacy spent"),
    ("note", "note"),
    ("updated", "last update"),
)

_CSS = """
body { font: 15px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .6em; }
.state { padding: .5em .8em; border-radius: 4px; font-weight: 600; }
.state.live { background: #e3f4e1; } .state.finished { background: #e1ecf7; }
.state.none, .state.offline { background: #fff3cd; } .state.gone, .state.stopped { background: #f8d7da; }
table { border-collapse: collapse; margin-top: 1em; }
th { text-align: left; color: #555; font-weight: normal; padding: .25em 1.2em .25em 0; vertical-align: top; }
td { padding: .25em 0; white-space: pre-line; font-family: ui-monospace, monospace; }
table.grid td, table.grid th { padding: .15em .9em .15em 0; white-space: nowrap; }
table.grid td:last-child { white-space: normal; }
table.grid th { border-bottom: 1px solid #ccc; }
h2 { font-size: 1.05em; margin: 1.4em 0 .3em; }
.plots { display: flex; gap: 2em; flex-wrap: wrap; }
.plots figure { margin: 0; } .plots figcaption { color: #555; font-size: .85em; }
svg { background: #fff; border: 1px solid #ddd; }
footer { margin-top: 1.2em; color: #777; font-size: .85em; }
"""

_JS = """
"use strict";
function fill(id, rows) {
  const body = document.getElementById(id);
  if (!body) return;
  const fresh = document.createElement("tbody");
  fresh.id = id;
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const text of row) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}
async function poll() {
  const state = document.getElementById("state");
  try {
    const got = await (await fetch("/status.json", {cache: "no-store"})).json();
    for (const [id, text] of Object.entries(got.view)) {
      const cell = document.getElementById(id);
      if (cell) cell.textContent = text;
    }
    for (const [id, rows] of Object.entries(got.tables)) fill(id, rows);
    for (const [id, points] of Object.entries(got.plots)) {
      const line = document.getElementById(id);
      if (line) line.setAttribute("points", points);
    }
    state.className = "state " + got.state;
    document.body.dataset.polled = String(got.now);
  } catch (err) {
    state.textContent = "the status server does not answer (has fedge status --web stopped?)";
    state.className = "state offline";
  }
}
setInterval(poll, POLL_MS);
poll();
""".replace("POLL_MS", str(POLL_MS))


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# The page's only script and style, allowed by hash: an injected <script> or style could not run even if escaping
# failed. connect-src 'self' (from default-src) lets the script fetch /status.json and nothing else.
CSP = (
    f"default-src 'self'; script-src {_sha256(_JS)}; style-src {_sha256(_CSS)}; img-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


_PHASE_TEXT = {"done": "round done"}


def state_of(status: RunStatus | None, now: float, connected: bool, run: str) -> tuple[str, str]:
    """(kind, sentence) of the page's banner: ``none``, ``offline``, ``finished``, ``stopped``, ``gone`` or
    ``live``. ``gone``: the coordinator's last will arrived (it died without a clean exit), or, as the status carries
    no heartbeat, its round's deadline passed :data:`fedge_io.monitor.LATE_S` seconds ago with no new phase (a link
    that hangs without breaking; the terminal view asks the same question then)."""
    if status is None:
        text = f"no status yet: nothing on {Topics(run).run_status} (is the coordinator of run {run!r} running?)"
        return ("offline", "no connection to the broker; " + text) if not connected else ("none", text)
    if not connected:
        return (
            "offline",
            f"no connection to the broker: this is the status of {max(0.0, now - status.updated):.0f} s ago",
        )
    if is_gone(status):
        last = f" (its last news: round {status.round} of {status.rounds})" if status.round else ""
        return "gone", printable(status.note) + last
    if status.phase == "finished":
        return "finished", f"run finished after round {status.round} of {status.rounds}"
    if status.phase == "stopped":
        return "stopped", f"run stopped after round {status.round} of {status.rounds}: {printable(status.note)}"
    if status.phase == "training" and status.deadline and now - status.deadline > LATE_S:
        late = now - status.deadline
        return "gone", f"coordinator gone? round {status.round}'s deadline passed {late:.0f} s ago with no news"
    if status.phase == "joining":
        return "live", f"live: {joining_text(status)}"
    return "live", f"live: round {status.round} of {status.rounds}, {_PHASE_TEXT.get(status.phase, status.phase)}"


def view(status: RunStatus | None, now: float, connected: bool, run: str) -> dict[str, str]:
    """The text of every display id (``state``, ``run`` and :data:`FIELDS`), made printable, not yet escaped."""
    shown = dict.fromkeys((i for i, _ in FIELDS), "-")
    shown["state"] = state_of(status, now, connected, run)[1]
    shown["run"] = printable(run, 40)
    if status is None:
        return shown
    s = status
    shown["run"] = f"{printable(s.run, 40)} (session {printable(s.session, 16)})"
    shown["round"] = f"{s.round} of {s.rounds}"
    if s.phase == "joining":
        shown["phase"] = joining_text(s)
    else:
        shown["phase"] = _PHASE_TEXT.get(s.phase, s.phase)
    if s.phase == "training" and s.deadline:
        left = s.deadline - now
        shown["deadline"] = f"in {left:.0f} s" if left >= 0 else f"passed {-left:.0f} s ago"
    online, sampled, replied, dropped = s.counts
    shown["clients"] = f"{online} online, {sampled} sampled, {replied} replied, {dropped} dropped"
    shown["online"] = names_text(s.online, online)
    shown["sampled"] = names_text(s.sampled, sampled)
    shown["replied"] = names_text(s.replied, replied)
    if s.phase == "training":
        waiting = tuple(c for c in s.sampled if c not in set(s.replied))
        shown["waiting"] = names_text(waiting, len(waiting))
    drops = [f"{printable(c, 40)} ({printable(r)})" for c, r in s.dropped]
    if dropped > len(s.dropped):
        drops.append(f"... ({dropped - len(s.dropped)} more)")
    shown["dropped"] = "\n".join(drops) or "-"
    shown["accuracy"] = f"{100 * s.accuracy:.2f}% (round {s.accuracy_round})" if s.accuracy >= 0 else "-"
    shown["skipped"] = str(s.skipped)
    shown["bytes"] = f"wire {format_bytes(s.wire_bytes)}, tensor {format_bytes(s.tensor_bytes)} (multicast)"
    shown["note"] = printable(s.note) or "-"
    shown["about"] = printable(s.about) or "-"
    shown["progress"] = progress_text(s, now)
    shown["epsilon"] = f"epsilon {s.epsilon:.3f}" if s.epsilon >= 0 else "-"
    if s.updated:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s.updated))
        shown["updated"] = f"{stamp} ({max(0.0, now - s.updated):.1f} s ago)"
    return shown


PLOT_W, PLOT_H, PLOT_PAD = 320, 80, 4  # the plots' viewBox; the lines keep PLOT_PAD from its top and bottom


def tables(status: RunStatus | None, now: float) -> dict[str, list[list[str]]]:
    """The rows of the page's two tables (printable texts): every round remembered, newest first, and every client."""
    if status is None:
        return {"rounds-body": [], "clients-body": []}
    clients = [[*client_cells(c, now), printable(c.last_drop) or "-"] for c in status.clients]
    return {"rounds-body": [round_cells(o) for o in reversed(status.history)], "clients-body": clients}


def plots(status: RunStatus | None) -> dict[str, str]:
    """The points of the two polylines: accuracy (0 to 100%) and wire bytes per round (0 to the largest round's)."""
    history = status.history if status is not None else ()
    if not history:
        return {"accuracy-line": "", "bytes-line": ""}
    first, last = history[0].round, history[-1].round
    span = max(last - first, 1)

    def x(rnd: int) -> float:
        return round((rnd - first) / span * PLOT_W, 1)

    def y(share: float) -> float:
        return round(PLOT_PAD + (PLOT_H - 2 * PLOT_PAD) * (1 - share), 1)

    most = max(o.wire_bytes for o in history) or 1
    accuracy = " ".join(f"{x(o.round)},{y(o.accuracy)}" for o in history if o.accuracy >= 0)
    wire = " ".join(f"{x(o.round)},{y(o.wire_bytes / most)}" for o in history)
    return {"accuracy-line": accuracy, "bytes-line": wire}


def status_json(status: RunStatus | None, now: float, connected: bool, run: str) -> bytes:
    """``/status.json``: the banner's kind, the validated fields of the status (or null), the display texts, the
    tables' rows and the plots' points."""
    doc = {
        "state": state_of(status, now, connected, run)[0],
        "now": round(now, 3),
        "connected": connected,
        "status": dataclasses.asdict(status) if status is not None else None,
        "view": view(status, now, connected, run),
        "tables": tables(status, now),
        "plots": plots(status),
    }
    # "<" escaped too: even a browser that sniffed the JSON as HTML would find no tag in it.
    return json.dumps(doc, ensure_ascii=True).replace("<", "\\u003c").encode()


def render_page(status: RunStatus | None, now: float, connected: bool, run: str) -> bytes:
    """``/``: the whole page with the latest status rendered in (every text HTML-escaped)."""
    e = html.escape
    shown = view(status, now, connected, run)
    kind = state_of(status, now, connected, run)[0]
    rows = "\n".join(f'<tr><th>{e(label)}</th><td id="{i}">{e(shown[i])}</td></tr>' for i, label in FIELDS)
    grids = tables(status, now)
    points = plots(status)

    def grid(body: str, headers: list[str]) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in headers)
        cells = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in grids[body])
        return f'<table class="grid"><thead><tr>{head}</tr></thead><tbody id="{body}">{cells}</tbody></table>'

    def plot(line: str, caption: str, colour: str) -> str:
        return (
            f'<figure><svg id="{line}-plot" viewBox="0 0 {PLOT_W} {PLOT_H}" width="{PLOT_W}" height="{PLOT_H}" '
            f'role="img" aria-label="{e(caption)}"><polyline id="{line}" points="{e(points[line])}" fill="none" '
            f'stroke="{colour}" stroke-width="2"/></svg><figcaption>{e(caption)}</figcaption></figure>'
        )

    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<noscript><meta http-equiv="refresh" content="5"></noscript>
<title>fedge status: {e(printable(run, 40))}</title>
<style>{_CSS}</style>
</head><body>
<h1>fedge status: run <span id="run">{e(shown["run"])}</span></h1>
<p id="state" class="state {kind}">{e(shown["state"])}</p>
<table>
{rows}
</table>
<div class="plots">{plot("accuracy-line", "accuracy per round (0 to 100%)", "#2a7")}
{plot("bytes-line", "wire bytes per round (0 to the largest)", "#27a")}</div>
<h2>rounds</h2>
{grid("rounds-body", ROUND_HEADERS)}
<h2>clients</h2>
{grid("clients-body", [*CLIENT_HEADERS, "last drop"])}
<footer>read-only view of {e(Topics(run).run_status)}, refreshed every {POLL_MS / 1000:g} s</footer>
<script>{_JS}</script>
</body></html>
"""
    return page.encode()


class Board:
    """The latest valid status and the broker link's state, shared by the MQTT loop and the HTTP threads."""

    def __init__(self, run: str, clock: Callable[[], float] = time.time) -> None:
        self.run = run
        self.clock = clock
        self._lock = threading.Lock()
        self._status: RunStatus | None = None
        self._connected = True

    def set(self, status: RunStatus | None = None, *, connected: bool | None = None) -> None:
        with self._lock:
            if status is not None:
                self._status = status
            if connected is not None:
                self._connected = connected

    def snapshot(self) -> tuple[RunStatus | None, float, bool, str]:
        """(status, now, connected, run): the arguments of the renderers."""
        with self._lock:
            return self._status, self.clock(), self._connected, self.run


class _Handler(BaseHTTPRequestHandler):
    """GET / and GET /status.json; 404 for any other path, 501 for any other method."""

    server: StatusServer
    timeout = 10  # seconds a client may take to send its request: a slow one cannot hold a thread for ever
    server_version = "fedge-status"
    sys_version = ""

    def do_GET(self) -> None:  # the name http.server dispatches to
        if self.server.loopback_only and not is_loopback(_host_name(self.headers.get("Host", ""))):
            self._answer(421, "text/plain; charset=utf-8", b"this status page answers only to a loopback Host\n")
            return
        path = urlsplit(self.path).path
        snapshot = self.server.board.snapshot()
        if path == "/":
            self._answer(200, "text/html; charset=utf-8", render_page(*snapshot))
        elif path == "/status.json":
            self._answer(200, "application/json", status_json(*snapshot))
        else:
            self._answer(404, "text/plain; charset=utf-8", b"not found\n")

    def _answer(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's errors (other methods, malformed requests) as one plain-text line, with the headers."""
        self.close_connection = True
        reason = message or self.responses.get(code, ("error",))[0]
        self._answer(code, "text/plain; charset=utf-8", f"{code} {printable(reason)}\n".encode())

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), printable(format % args))  # not a line a second on stderr


def _host_name(header: str) -> str:
    """The host part of a Host header (``[::1]:8080`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class StatusServer(ThreadingHTTPServer):
    """The page's HTTP server; one daemon thread per connection, at most ``max_connections`` at once (a flood of
    idle connections is closed unanswered instead of growing threads without bound)."""

    daemon_threads = True

    def __init__(self, bind: tuple[str, int], board: Board, *, max_connections: int = 32) -> None:
        self.board = board
        self.loopback_only = is_loopback(bind[0])
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in bind[0]:
            self.address_family = socket.AF_INET6
        super().__init__(bind, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def parse_web_address(text: str) -> tuple[str, int]:
    """``[ADDRESS:]PORT`` (``8080``, ``0.0.0.0:8080``, ``[::1]:8080``) as (address, port); 127.0.0.1 by default."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep:
        host = "127.0.0.1"
    try:
        number = int(port)
        if host != "localhost":
            ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--web wants [ADDRESS:]PORT with an IP address, e.g. 127.0.0.1:8080, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"--web port must be 0-65535, got {number}")
    return host, number


def serve(
    address: BrokerAddress,
    client_id: str,
    run: str,
    bind: tuple[str, int],
    *,
    timeout: float = 10.0,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    logins: Sequence[str] = (),
) -> int:
    """Serve the status page of ``run`` on ``bind`` until interrupted; the exit status. ``logins``: the monitor
    bundle's user names, one per viewer at once (:class:`fedge_io.mqtt.MqttLink`)."""
    if timeout <= 0:
        raise ConfigError("--timeout must be > 0 seconds")
    topic = Topics(run).run_status
    board = Board(run)
    link = MqttLink(address, client_id, subscriptions=[(topic, 1)], logins=logins)
    try:
        link.start(timeout)  # in the try: Ctrl-C or SIGTERM while connecting also closes the link
        try:
            server = StatusServer(bind, board)
        except OSError as exc:
            raise ConfigError(f"--web cannot listen on {bind[0]}:{bind[1]}: {exc.strerror or exc}") from None
        thread = threading.Thread(target=server.serve_forever, name="fedge-status-web", daemon=True)
        thread.start()
        print(f"fedge status: the status of run {run!r} on {server.url} (Ctrl-C stops)", file=out, flush=True)
        try:
            while True:
                item = link.get(1.0)
                board.set(connected=link.connected)
                if item is None or not item.payload:  # an empty retained message clears the topic
                    continue
                try:
                    board.set(after(board.snapshot()[0], decode_run_status(item.payload, run)))
                except CodecError as exc:
                    print(f"fedge status: ignoring an invalid run status on {topic}: {exc}", file=err, flush=True)
        finally:
            server.shutdown()
            server.server_close()
    except KeyboardInterrupt:
        return 0
    finally:
        link.close(wait=0.5)
