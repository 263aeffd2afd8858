"""``fedge status --web``: the page and its JSON with a peer's hostile strings (nothing injected), the server's few
answers and headers, and the page in headless Chromium against a live run over a real mosquitto (no status yet,
waiting for clients, finished; the script under the page's Content-Security-Policy redraws from /status.json)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from browser_support import chromium
from browser_support import dump_dom as load
from mqtt_support import require_mosquitto
from signal_support import default_sigint

from coordinator.run import run_coordinator
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.wire.run_status import (
    ClientRow,
    RoundOutcome,
    RunStatus,
    after,
    decode_run_status,
    encode_run_status,
    gone_status,
    run_status,
)
from fedge_io.experiment import Experiment, prepare
from fedge_io.web_status import CSP, Board, StatusServer, parse_web_address, render_page, status_json
from sim.brokers import free_port, mosquitto_broker, stop_process
from sim.laptop import client_processes
from sim.provision import write_client_files

NOW = 1_800_000_000.0
EVIL = '</td><script>alert("x")</script><img src=x onerror=alert(1)>\x1b[2J"\'&'


def hostile() -> RunStatus:
    """A status as a hostile peer could publish it, after the schema check (which lets these strings through)."""
    made = run_status(
        "lab",
        "<b>s1</b>",
        "training",
        round=2,
        rounds=5,
        updated=NOW - 2,
        deadline=NOW + 40,
        online=("c0", "<i>c1</i>"),
        sampled=("c0", "<i>c1</i>"),
        replied=("c0",),
        dropped=(("c9", EVIL),),
        note=EVIL,
        accuracy=0.5,
        accuracy_round=1,
        about=EVIL,
        history=(RoundOutcome(1, True, 2, 2, 0, 0.5, 1000, 2.5, NOW - 10),),
        clients=(ClientRow("<i>c1</i>", EVIL[:40], "cpu", 40, 1, 0, 1, EVIL, NOW - 5, 1.5, 500),),
    )
    return decode_run_status(encode_run_status(made), "lab")  # what the status process holds: decoded and checked


def test_the_page_shows_the_status_and_no_peer_string_becomes_markup() -> None:
    page = render_page(hostile(), NOW, True, "lab").decode()
    assert '<td id="round">2 of 5</td>' in page and '<td id="phase">training</td>' in page
    assert '<td id="deadline">in 40 s</td>' in page and '<td id="waiting">&lt;i&gt;c1&lt;/i&gt;</td>' in page
    assert '<td id="clients">2 online, 2 sampled, 1 replied, 1 dropped</td>' in page
    assert '<td id="accuracy">50.00% (round 1)</td>' in page and "(2.0 s ago)" in page
    # The only tags are the page's own: one script, no img, and every peer text is escaped.
    assert page.count("<script>") == 1 and "<img" not in page and "<i>" not in page and "<b>" not in page
    assert "<td>&lt;i&gt;c1&lt;/i&gt;</td>" in page  # the client table's peer texts are escaped too
    assert "&lt;/td&gt;&lt;script&gt;alert(&quot;x&quot;)" in page and "\x1b" not in page
    # The CSP allows the page's own script and style by hash, and nothing else runs.
    script = re.search(r"<script>(.*?)</script>", page, re.S)
    style = re.search(r"<style>(.*?)</style>", page, re.S)
    assert script and style
    for block, directive in ((script, "script-src"), (style, "style-src")):
        digest = base64.b64encode(hashlib.sha256(block.group(1).encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}';" in CSP
    assert "unsafe-inline" not in CSP and CSP.startswith("default-src 'self';")


def test_the_json_holds_the_validated_fields_and_escaped_texts() -> None:
    body = status_json(hostile(), NOW, True, "lab")
    assert b"<" not in body and b"\x1b" not in body  # "<" as \u003c: nothing to sniff as HTML
    doc = json.loads(body)
    assert doc["state"] == "live" and doc["status"]["round"] == 2 and doc["status"]["dropped"] == [["c9", EVIL]]
    assert doc["view"]["phase"] == "training" and doc["view"]["waiting"] == "<i>c1</i>"
    assert "\\x1b[2J" in doc["view"]["note"]  # made printable: the page's script only sets textContent
    assert set(doc) == {"state", "now", "connected", "status", "view", "tables", "plots"}
    (row,) = doc["tables"]["clients-body"]
    assert row[0] == "<i>c1</i>" and row[-1].startswith("</td><script>")  # texts: the script sets textContent
    assert doc["plots"]["accuracy-line"] == "0.0,40.0"  # one round at 50%: the middle of the 80-pixel plot


@pytest.mark.parametrize(
    ("status", "now", "connected", "state", "text"),
    [
        (None, NOW, True, "none", "no status yet: nothing on fedge/lab/run-status"),
        (None, NOW, False, "offline", "no connection to the broker; no status yet"),
        (
            run_status("lab", "s", "training", round=3, rounds=5, deadline=NOW - 31),
            NOW,
            True,
            "gone",
            "coordinator gone?",
        ),
        (run_status("lab", "s", "training", round=3, rounds=5, deadline=NOW - 5), NOW, True, "live", "live: round 3"),
        (run_status("lab", "s", "joining", needed=3, online=("c0",)), NOW, True, "live", "waiting for clients, 1 of 3"),
        # The coordinator's first status, as it connects, before it says how many it needs: not "0 of 0".
        (run_status("lab", "s", "joining"), NOW, True, "live", "live: waiting for clients, 0 online"),
        (run_status("lab", "s", "finished", round=5, rounds=5), NOW, True, "finished", "finished after round 5 of 5"),
        (
            run_status("lab", "s", "stopped", note="nobody came"),
            NOW,
            True,
            "stopped",
            "stopped after round 0 of 0: nobody",
        ),
        (run_status("lab", "s", "joining", updated=NOW - 9), NOW, False, "offline", "status of 9 s ago"),
        (gone_status("lab", "s", rounds=5), NOW, True, "gone", "coordinator gone: its connection to the broker"),
        (
            after(run_status("lab", "s", "training", round=3, rounds=5, deadline=NOW + 60), gone_status("lab", "s", 5)),
            NOW,
            True,
            "gone",
            "without a clean exit (killed, crashed or cut off) (its last news: round 3 of 5)",
        ),
    ],
)
def test_the_banner_says_what_state_the_run_is_in(
    status: RunStatus | None, now: float, connected: bool, state: str, text: str
) -> None:
    doc = json.loads(status_json(status, now, connected, "lab"))
    assert doc["state"] == state and text in doc["view"]["state"], doc["view"]["state"]
    assert f'class="state {state}">' in render_page(status, now, connected, "lab").decode()


def test_web_addresses() -> None:
    assert parse_web_address("8080") == ("127.0.0.1", 8080)
    assert parse_web_address("0.0.0.0:80") == ("0.0.0.0", 80)
    assert parse_web_address("[::1]:8080") == ("::1", 8080)
    for bad in ("host.example:80", "80x", "127.0.0.1:70000", ""):
        with pytest.raises(ConfigError, match="--web"):
            parse_web_address(bad)


def test_the_command_refuses_web_with_once_and_a_bad_address_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from fedge_cli.main import main

    base = ["status", "--broker", "mqtt://127.0.0.1:1", "--run", "lab"]
    assert main([*base, "--web", "8080", "--once"]) == 2
    assert capsys.readouterr().err == (
        "fedge: error: --once and --json print to the terminal; they do not go with --web\n"
    )
    assert main([*base, "--web", "example.org:8080"]) == 2
    assert "fedge: error: --web wants [ADDRESS:]PORT with an IP address" in capsys.readouterr().err


@contextmanager
def serving(board: Board, bind: tuple[str, int] = ("127.0.0.1", 0)) -> Iterator[StatusServer]:
    server = StatusServer(bind, board)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def ask(server: StatusServer, method: str, path: str, host: str | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", int(server.server_address[1]), timeout=10)
    headers = {"Host": host} if host else {}
    conn.request(method, path, headers=headers)
    return conn.getresponse()


def test_the_server_answers_get_on_its_two_paths_only_with_its_headers() -> None:
    board = Board("lab", clock=lambda: NOW)
    board.set(hostile())
    with serving(board) as server:
        page = ask(server, "GET", "/")
        assert page.status == 200 and page.getheader("Content-Security-Policy") == CSP
        assert page.getheader("X-Content-Type-Options") == "nosniff" and b"2 of 5" in page.read()
        got = ask(server, "GET", "/status.json?t=1")
        assert got.getheader("Content-Type") == "application/json" and json.loads(got.read())["status"]["round"] == 2
        for path in ("/app.js", "/../etc/passwd", "/status.json/", "/favicon.ico"):
            assert ask(server, "GET", path).status == 404, path
        for method in ("POST", "PUT", "DELETE"):
            refused = ask(server, method, "/")
            assert refused.status == 501 and refused.getheader("Content-Security-Policy") == CSP, method
            assert refused.read() == f"501 Unsupported method ({method!r})\n".encode()
        # Bound to loopback, it answers no other Host name (a rebinding page elsewhere reads nothing).
        refused = ask(server, "GET", "/status.json", host="attacker.example:80")
        assert refused.status == 421 and b"round" not in refused.read()
        assert ask(server, "GET", "/", host="localhost:8080").status == 200


def test_idle_connections_beyond_the_bound_are_closed_unanswered() -> None:
    board = Board("lab", clock=lambda: NOW)
    server = StatusServer(("127.0.0.1", 0), board, max_connections=2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        idle = [
            socket.create_connection(("127.0.0.1", int(server.server_address[1])), timeout=10) for _ in range(2)
        ]  # they send nothing
        time.sleep(0.3)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
            ask(server, "GET", "/status.json").read()
        for conn in idle:
            conn.close()
        deadline = time.monotonic() + 10
        while True:  # the idle connections' threads end once their sockets close
            try:
                assert ask(server, "GET", "/status.json").status == 200
                break
            except (http.client.RemoteDisconnected, ConnectionResetError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()


def cell(dom: str, name: str) -> str:
    found = re.search(rf'<(?:td|p|span) id="{name}"[^>]*>(.*?)</', dom, re.S)
    assert found, dom
    return found.group(1)


def wait_for_page(url: str, pattern: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    dom = ""
    while time.monotonic() < deadline:
        dom = load(url)
        if re.search(pattern, dom):
            return dom
        time.sleep(0.5)
    raise AssertionError(f"the page never showed {pattern!r}:\n{dom}")


@pytest.mark.broker
def test_the_page_in_headless_chromium_follows_a_live_run(tmp_path: Path) -> None:
    """``fedge status --web`` beside a real coordinator and two ``fedge client`` processes over mosquitto: the page
    says no status yet, then that the run waits for its two clients, then the finished run, in which c001 died when
    its round-2 task arrived (dropped, with the reason), and once the broker is gone, that it lost the broker."""
    chromium()
    require_mosquitto()
    config = RunConfig(dataset="digits", model="tiny_mlp", num_clients=2, rounds=2, train=TrainConfig(local_epochs=1))
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    result: dict[str, object] = {}

    def coordinate(exp: Experiment) -> None:
        result["run"] = run_coordinator(
            config, tmp_path / "run", broker=broker, run="web", experiment=exp, join_timeout=120, rejoin_grace=1
        )

    web: subprocess.Popen[str] | None = None
    try:
        with mosquitto_broker() as broker:
            cmd = [
                sys.executable,
                "-m",
                "fedge_cli.main",
                "status",
                "--broker",
                broker,
                "--run",
                "web",
                "--web",
                str(port),
            ]
            web = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint
            )
            exp = prepare(config)  # while the status process starts
            files = write_client_files(exp, tmp_path / "data")
            assert web.stdout is not None and url in web.stdout.readline()
            dom = load(url)
            assert 'class="state none"' in dom
            assert cell(dom, "state") == (
                "no status yet: nothing on fedge/web/run-status (is the coordinator of run 'web' running?)"
            )
            coordinator = threading.Thread(target=coordinate, args=(exp,))
            coordinator.start()
            dom = wait_for_page(url, r'id="phase">waiting for clients, 0 of 2 online<')  # needed is in the 2nd status
            assert 'class="state live"' in dom and cell(dom, "round") == "0 of 2"
            assert cell(dom, "online") == "-" and cell(dom, "clients").startswith("0 online")
            assert re.search(r'<body data-polled="\d+', dom), "the page's script did not run under its CSP"
            with client_processes(files, broker, "web", log_dir=tmp_path / "logs", faults={"c001": 2}):
                coordinator.join(240)
            assert "run" in result, "the coordinator did not finish"
            dom = wait_for_page(url, r'class="state finished"')
            assert cell(dom, "round") == "2 of 2" and cell(dom, "phase") == "finished"
            assert cell(dom, "clients") == "1 online, 2 sampled, 1 replied, 1 dropped", dom
            assert cell(dom, "replied") == "c000" and cell(dom, "dropped").startswith("c001 (went offline"), dom
            assert re.fullmatch(r"\d+\.\d\d% \(round 2\)", cell(dom, "accuracy")), dom
            assert re.match(r"wire \d", cell(dom, "bytes")), dom
            # The view's memory, redrawn by the page's script: both rounds, a row per client, and the two plots.
            assert cell(dom, "about").startswith("fedntd on digits, model tiny_mlp, 2 clients"), dom
            rounds = re.search(r'<tbody id="rounds-body">(.*?)</tbody>', dom, re.S)
            assert rounds and re.findall(r"<tr><td>(\d+)</td><td>(\w+)</td>", rounds.group(1)) == [
                ("2", "SKIPPED"),
                ("1", "aggregated"),
            ], dom
            clients = re.search(r'<tbody id="clients-body">(.*?)</tbody>', dom, re.S)
            assert clients and re.findall(r"<tr><td>(c\d+)</td><td>torch</td><td>cpu</td>", clients.group(1)) == [
                "c000",
                "c001",
            ], dom
            assert re.search(r"<td>went offline [^<]*</td></tr>", clients.group(1)), dom  # c001's last drop
            for line in ("accuracy-line", "bytes-line"):
                points = re.search(rf'<polyline id="{line}" points="([^"]*)"', dom)
                assert points and len(points.group(1).split()) == 2, dom
        # The broker is gone: the page keeps the last status and says that it may be stale.
        dom = wait_for_page(url, r'class="state offline"')
        assert cell(dom, "state").startswith("no connection to the broker: this is the status of "), dom
        assert cell(dom, "round") == "2 of 2"
        web.send_signal(signal.SIGINT)  # Ctrl-C
        assert web.wait(30) == 0
    finally:
        if web is not None:
            stop_process(web)
    out = web.stdout.read() if web is not None and web.stdout else ""
    assert "Traceback" not in out, out
