"""``fedge status``: the live fleet view in a terminal, read from the run status the coordinator keeps on the broker.

It logs in (with a fleet kit's read-only ``monitor/`` bundle, or to a lab broker), subscribes to
``fedge/<run>/run-status`` (retained: the latest status arrives at once) and shows it, redrawn as it changes and
every second (ages and deadlines move). ``--once`` prints one snapshot and exits: for scripts and tests. What arrives
is checked like anything a peer sends (:func:`fedge.wire.run_status.decode_run_status`); an invalid message is reported
in
one line and skipped, and every string shown is made printable first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from fedge.accounting.units import format_bytes
from fedge.errors import CodecError, ConfigError
from fedge.wire.fields import printable
from fedge.wire.protocol import BrokerAddress, Topics, check_name
from fedge.wire.run_status import ClientRow, RoundOutcome, RunStatus, after, decode_run_status, is_gone
from fedge_io.connection import add_connection_arguments, connection_from_args
from fedge_io.mqtt import MqttLink

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
LATE_S = 30.0  # seconds past a round's deadline after which the view asks whether the coordinator still runs


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fedge status``."""
    add_connection_arguments(p, publishes=False)  # a monitor only reads
    p.add_argument("--run", default=None, help="the run to watch (default: the bundle's, else 'default')")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (for scripts)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the status as JSON (the decoded fields, elapsed and ETA): one document with --once, else one line "
        "per new status",
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for the broker and the first status (default: 10)"
    )
    p.add_argument(
        "--web",
        metavar="[ADDRESS:]PORT",
        default=None,
        help="serve the view as a read-only web page on this port (address default: 127.0.0.1) instead of printing it",
    )


def names_text(ids: tuple[str, ...], total: int) -> str:
    shown = " ".join(printable(c, 40) for c in ids) or "-"
    return shown + (f" ... ({total - len(ids)} more)" if total > len(ids) else "")


ROUNDS_SHOWN = 10  # the terminal shows the latest rounds; --json and the web page carry all the status holds


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def progress(status: RunStatus, now: float) -> dict[str, float | None]:
    """Elapsed seconds of this coordinator session, and the time the rounds left will take at the mean round time
    of the rounds remembered (None: not known yet)."""
    s = status
    elapsed = now - s.started if s.started else None
    times = [o.wall_s for o in s.history if o.wall_s > 0]
    done = s.history[-1].round if s.history else 0
    left = max(0, s.rounds - done)
    eta = left * sum(times) / len(times) if times and s.phase not in ("finished", "stopped") else None
    return {"elapsed_s": elapsed, "eta_s": 0.0 if s.phase == "finished" else eta}


def progress_text(status: RunStatus, now: float) -> str:
    p = progress(status, now)
    elapsed = _duration(p["elapsed_s"]) if p["elapsed_s"] is not None else "-"
    eta = _duration(p["eta_s"]) if p["eta_s"] is not None else "-"
    return f"elapsed {elapsed} (this coordinator session), ETA {eta}"


def round_cells(o: RoundOutcome) -> list[str]:
    """One round's cells: round, outcome, replies, accuracy, wire bytes, time (and epsilon, for a DP run)."""
    cells = [
        str(o.round),
        "aggregated" if o.aggregated else "SKIPPED",
        f"{o.replied}/{o.sampled}" + (f", {o.dropped} dropped" if o.dropped else ""),
        f"{100 * o.accuracy:.2f}%" if o.accuracy >= 0 else "-",
        format_bytes(o.wire_bytes),
        f"{o.wall_s:.1f} s",
    ]
    return [*cells, f"{o.epsilon:.3f}" if o.epsilon >= 0 else "-"]


ROUND_HEADERS = ["round", "outcome", "replied", "accuracy", "wire", "time", "epsilon"]
CLIENT_HEADERS = [
    "client",
    "runtime",
    "device",
    "samples",
    "sampled",
    "replied",
    "dropped",
    "last seen",
    "step",
    "wire",
]


def client_cells(c: ClientRow, now: float) -> list[str]:
    """One client's cells; its latest drop's reason is shown apart (it can be long)."""
    return [
        printable(c.client, 40),
        printable(c.runtime, 20) or "-",
        printable(c.device, 20) or "-",
        str(c.samples),
        str(c.sampled),
        str(c.replied),
        str(c.dropped),
        f"{_duration(now - c.last_seen)} ago" if c.last_seen else "-",
        f"{c.step_s:.1f} s" if c.step_s >= 0 else "-",
        format_bytes(c.wire_bytes),
    ]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def joining_text(status: RunStatus) -> str:
    """The join phase in words; the count needed once the coordinator says it (its first status, published as it
    connects, does not know it yet: "0 of 0 online" read as if nobody were wanted)."""
    online = status.counts[0]
    if status.needed <= 0:
        return f"waiting for clients, {online} online"
    return f"waiting for clients, {online} of {status.needed} online"


def render(status: RunStatus, now: float) -> str:
    """The status as a few lines of text, ``now`` (Unix seconds) for ages and the time left."""
    s = status
    head = f"run {printable(s.run, 40)!r} (session {printable(s.session, 16)}): "
    about = [f"  {printable(s.about)}", f"  {progress_text(s, now)}"] if s.about else []
    if s.phase == "joining":
        head += joining_text(s)
    elif is_gone(s):
        head += "coordinator gone" + (f" (its last news: round {s.round} of {s.rounds})" if s.round else "")
    elif s.phase in ("finished", "stopped"):
        head += f"{s.phase} after round {s.round} of {s.rounds}"
    else:
        head += f"round {s.round} of {s.rounds}, {'round done' if s.phase == 'done' else s.phase}"
    if s.phase == "training" and s.deadline:
        left = s.deadline - now
        head += f", deadline in {left:.0f} s" if left >= 0 else f", deadline passed {-left:.0f} s ago"
        if left < -LATE_S:
            head += " (is the coordinator still running?)"
    online, sampled, replied, dropped = s.counts
    lines = [
        head,
        *about,
        f"clients: {online} online, {sampled} sampled, {replied} replied, {dropped} dropped",
        f"  online:  {names_text(s.online, online)}",
    ]
    if sampled:
        lines.append(f"  sampled: {names_text(s.sampled, sampled)}")
        lines.append(f"  replied: {names_text(s.replied, replied)}")
        if s.phase == "training":
            waiting = tuple(c for c in s.sampled if c not in set(s.replied))
            lines.append(f"  waiting: {names_text(waiting, len(waiting))}")
    for client, reason in s.dropped:
        lines.append(f"  dropped: {printable(client, 40)} ({printable(reason)})")
    if dropped > len(s.dropped):
        lines.append(f"  dropped: ... ({dropped - len(s.dropped)} more)")
    accuracy = f"{100 * s.accuracy:.2f}% (round {s.accuracy_round})" if s.accuracy >= 0 else "-"
    lines.append(f"last accuracy: {accuracy}   skipped rounds: {s.skipped}")
    lines.append(f"bytes so far: wire {format_bytes(s.wire_bytes)}, tensor {format_bytes(s.tensor_bytes)} (multicast)")
    if s.epsilon >= 0:
        lines.append(f"privacy spent: epsilon {s.epsilon:.3f}")
    if s.buffer_size > 0:  # FedBuff: each "round" is a server step
        stale = f"mean {s.staleness_mean:.2f}, max {s.staleness_max}" if s.staleness_max >= 0 else "-"
        lines.append(
            f"fedbuff: version {s.version}, buffer {s.buffer_fill}/{s.buffer_size}, {s.in_flight} training, "
            f"staleness of the buffered updates {stale} (server steps)"
        )
    if s.note:
        lines.append(f"note: {printable(s.note)}")
    if s.history:
        shown = s.history[-ROUNDS_SHOWN:]
        more = f" (the latest {len(shown)}; --json has {len(s.history)})" if len(s.history) > len(shown) else ""
        lines += ["", f"rounds{more}:", *("  " + x for x in table(ROUND_HEADERS, [round_cells(o) for o in shown]))]
    if s.clients:
        rows = [client_cells(c, now) for c in s.clients]
        lines += ["", "clients:", *("  " + x for x in table(CLIENT_HEADERS, rows))]
        lines += [
            f"  {printable(c.client, 40)} last dropped: {printable(c.last_drop)}" for c in s.clients if c.last_drop
        ]
    lines.append(f"updated {max(0.0, now - s.updated):.1f} s ago" if s.updated else "updated: - (the last will)")
    return "\n".join(lines)


def status_document(status: RunStatus, now: float) -> dict[str, object]:
    """``--json``: the decoded status (as validated: bounded, not filtered to printable text), elapsed and ETA."""
    return {"now": round(now, 3), **progress(status, now), "status": dataclasses.asdict(status)}


def watch(
    address: BrokerAddress,
    client_id: str,
    run: str,
    *,
    once: bool = False,
    timeout: float = 10.0,
    interval: float = 1.0,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    logins: Sequence[str] = (),
    as_json: bool = False,
) -> int:
    """Show the run status of ``run`` until interrupted (or one snapshot with ``once``); the exit status.
    ``logins``: the monitor bundle's user names, one per viewer at once (:class:`fedge_io.mqtt.MqttLink`).
    ``as_json``: each status as one line of JSON (:func:`status_document`) instead of text."""
    if timeout <= 0 or interval <= 0:
        raise ConfigError("--timeout and --interval must be > 0 seconds")
    topic = Topics(run).run_status
    redraw = out.isatty() and not once and not as_json
    latest: RunStatus | None = None
    link = MqttLink(address, client_id, subscriptions=[(topic, 1)], logins=logins)
    try:
        link.start(timeout)  # in the try: Ctrl-C or SIGTERM while connecting also closes the link
        deadline = time.monotonic() + timeout
        while True:
            item = link.get(interval)
            fresh = False
            if item is not None and item.payload:  # an empty retained message clears the topic
                try:
                    latest = after(latest, decode_run_status(item.payload, run))
                    fresh = True
                except CodecError as exc:
                    print(f"fedge status: ignoring an invalid run status on {topic}: {exc}", file=err, flush=True)
            if latest is None:
                if time.monotonic() > deadline:
                    print(
                        f"fedge: error: no run status on {topic} at {address} within {timeout:g} s: is the "
                        f"coordinator of run {run!r} running (and this login allowed to read it)?",
                        file=err,
                    )
                    return 2
                continue
            if as_json:
                if fresh or once:
                    print(json.dumps(status_document(latest, time.time())), file=out, flush=True)
                if once:
                    return 0
                continue
            if once:
                print(render(latest, time.time()), file=out, flush=True)
                return 0
            if redraw:
                out.write(_CLEAR + render(latest, time.time()) + "\n")
                out.flush()
            elif fresh:  # a log or a pipe: each new status once, not a redraw a second
                print(render(latest, time.time()) + "\n", file=out, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        link.close(wait=0.5)


def run_status_cli(args: argparse.Namespace) -> int:
    """``fedge status``: resolve the login and run name from the flags, then :func:`watch`."""
    connection = connection_from_args(args)
    bundle = connection.bundle
    if bundle is not None:
        if bundle.role != "monitor":
            # Its user name is its MQTT client id: logging in with it would push the running role off the broker.
            # The monitor's are many (bundle.usernames): each viewer at once takes one of its own.
            raise ConfigError(f"{args.bundle} is the {bundle.role}'s bundle; fedge status needs the kit's monitor/")
        if args.run not in (None, bundle.run):
            raise ConfigError(f"--run {args.run} differs from the bundle's run {bundle.run!r}")
        run, client_id, logins = bundle.run, bundle.username, bundle.usernames
    else:
        logins = ()
        run = check_name(args.run or "default", "run name")
        client_id = f"fedge-{run}-monitor-{secrets.token_hex(4)}"  # unique: monitors must not push each other off
    if args.web is not None:
        from fedge_io.web_status import parse_web_address, serve

        if args.once or args.json:
            raise ConfigError("--once and --json print to the terminal; they do not go with --web")
        return serve(
            connection.address, client_id, run, parse_web_address(args.web), timeout=args.timeout, logins=logins
        )
    return watch(
        connection.address, client_id, run, once=args.once, timeout=args.timeout, logins=logins, as_json=args.json
    )
