"""``fedge status``'s terminal view: what it shows of a status, that a peer's strings cannot drive the terminal, and
the refreshing view on a real terminal (a pseudo-terminal) fed by a real mosquitto."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

from mqtt_support import mosquitto_url  # noqa: F401 - a fixture
from signal_support import default_sigint

from fedge.wire.protocol import BrokerAddress, Topics
from fedge.wire.run_status import MAX_LISTED, after, decode_run_status, encode_run_status, gone_status, run_status
from fedge_io.monitor import render
from fedge_io.mqtt import MqttLink

NOW = 1_800_000_000.0


def test_the_view_shows_the_round_the_clients_and_who_is_still_awaited() -> None:
    status = run_status(
        "lab",
        "s1",
        "training",
        round=2,
        rounds=5,
        updated=NOW - 2,
        deadline=NOW + 40,
        online=("c0", "c1", "c2"),
        sampled=("c0", "c1", "c2"),
        replied=("c1",),
        accuracy=0.5,
        accuracy_round=1,
        wire_bytes=2_500_000,
    )
    shown = render(status, NOW)
    assert shown.splitlines()[0] == "run 'lab' (session s1): round 2 of 5, training, deadline in 40 s"
    assert "  waiting: c0 c2" in shown and "last accuracy: 50.00% (round 1)" in shown
    assert "bytes so far: wire 2.5 MB" in shown and "updated 2.0 s ago" in shown
    late = render(status, NOW + 100)
    assert "deadline passed 60 s ago (is the coordinator still running?)" in late


def test_a_fedbuff_run_shows_its_version_buffer_and_staleness() -> None:
    fedbuff = run_status("lab", "s", "training", round=3, version=2, buffer_fill=1, buffer_size=3, in_flight=2,
                         staleness_mean=1.5, staleness_max=2)  # fmt: skip
    assert "fedbuff: version 2, buffer 1/3, 2 training, staleness of the buffered updates mean 1.50, max 2" in render(
        fedbuff, NOW
    )
    assert decode_run_status(encode_run_status(fedbuff)) == fedbuff
    assert "fedbuff" not in render(run_status("lab", "s", "training", round=3), NOW)  # a synchronous run


def test_a_coordinator_that_died_shows_as_gone_with_its_last_news() -> None:
    will = gone_status("lab", "s1", rounds=5)
    alone = render(will, NOW)  # a monitor started after the death: the retained will alone
    assert alone.splitlines()[0] == "run 'lab' (session s1): coordinator gone"
    assert "note: coordinator gone: its connection to the broker ended without a clean exit" in alone
    assert alone.splitlines()[-1] == "updated: - (the last will)"
    live = run_status("lab", "s1", "training", round=2, rounds=5, updated=NOW - 7, deadline=NOW + 40, online=("c0",))
    seen = render(after(live, will), NOW)  # a monitor that watched round 2
    assert seen.splitlines()[0] == "run 'lab' (session s1): coordinator gone (its last news: round 2 of 5)"
    assert "online:  c0" in seen and "updated 7.0 s ago" in seen and "deadline" not in seen


def test_long_lists_say_how_many_more() -> None:
    many = tuple(f"c{i:04d}" for i in range(MAX_LISTED + 3))
    shown = render(run_status("lab", "s", "joining", online=many, needed=600), NOW)
    assert "waiting for clients, 503 of 600 online" in shown and "... (3 more)" in shown
    # The coordinator's first status, as it connects, does not know how many it needs yet: no "0 of 0".
    first = render(run_status("lab", "s", "joining"), NOW).splitlines()[0]
    assert first == "run 'lab' (session s): waiting for clients, 0 online"


def test_a_peers_strings_cannot_drive_the_terminal() -> None:
    evil = "\x1b[2J\x1b]0;owned\x07\nround 9 of 9, finished"
    status = run_status("lab", "s\x1b[1m", "aggregating", dropped=(("c0", evil),), note=evil)
    shown = render(status, NOW)
    assert "\x1b" not in shown and "\x07" not in shown
    assert len(shown.splitlines()) == len(
        render(run_status("lab", "s", "aggregating", dropped=(("c0", "x"),), note="x"), NOW).splitlines()
    )


def test_on_a_terminal_the_view_is_redrawn_and_bad_messages_are_reported(mosquitto_url: str) -> None:  # noqa: F811
    topic = Topics("tty").run_status
    address = BrokerAddress.parse(mosquitto_url)
    with MqttLink(address, "publisher").start(10) as link:
        link.publish(topic, b"not a status", retain=True)
        time.sleep(0.3)
        primary, secondary = pty.openpty()
        cmd = [sys.executable, "-m", "fedge_cli.main", "status", "--broker", mosquitto_url, "--run", "tty"]
        proc = subprocess.Popen(
            cmd, stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True, preexec_fn=default_sigint
        )
        os.close(secondary)
        seen = b""
        try:
            deadline = time.monotonic() + 60
            published = False
            while time.monotonic() < deadline and seen.count(b"\x1b[H\x1b[2J") < 3:
                if not published and b"ignoring an invalid run status" in seen:
                    link.publish(topic, encode_run_status(run_status("tty", "s", "joining", needed=2)), retain=True)
                    published = True
                ready, _, _ = select.select([primary], [], [], 0.5)
                if ready:
                    try:
                        seen += os.read(primary, 65536)
                    except OSError:
                        break
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(primary)
    text = seen.decode(errors="replace")
    assert "ignoring an invalid run status on fedge/tty/run-status" in text, text[-2000:]
    assert text.count("\x1b[H\x1b[2J") >= 3, text[-2000:]  # redrawn about once a second, not only on news
    assert "waiting for clients, 0 of 2 online" in text


_STATUS_WITHOUT_TORCH = """
import sys
from fedge_cli.main import main

code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


def test_fedge_status_reads_a_run_without_importing_torch(mosquitto_url: str) -> None:  # noqa: F811
    # Importing torch takes seconds (more on a small board); the monitor reads metadata-only messages.
    address = BrokerAddress.parse(mosquitto_url)
    status = run_status("light", "s", "training", round=3, rounds=5, online=("c0", "c1"), wire_bytes=1_000_000)
    with MqttLink(address, "publisher").start(10) as link:
        link.publish(Topics("light").run_status, encode_run_status(status), retain=True)
        time.sleep(0.3)
        args = ["status", "--broker", mosquitto_url, "--run", "light", "--once"]
        done = subprocess.run(
            [sys.executable, "-c", _STATUS_WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run 'light' (session s): round 3 of 5, training" in done.stdout
    assert "bytes so far: wire 1.0 MB" in done.stdout
    assert done.stdout.rstrip().endswith("torch imported: False")
