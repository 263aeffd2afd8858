"""Writing a fleet kit: every file in its place, secrets 0600 from the moment they exist, and the kit's README."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.broker_setup import mosquitto_command
from coordinator.kit.accounts import (
    COORDINATOR,
    MONITOR,
    PASSWORD_FILE,
    FleetSpec,
    fleet_acl,
    fleet_username,
)
from coordinator.kit.broker_files import amqtt_password_line, mosquitto_acl, mosquitto_conf, mosquitto_password_line
from coordinator.kit.pki import Issued, issue, make_ca
from fedge.errors import ConfigError
from fedge_io.credentials import BUNDLE_FILE, BUNDLE_FORMAT

log = logging.getLogger(__name__)


def _write(path: Path, data: str | bytes, *, private: bool = False) -> None:
    """Create ``path`` (never overwrite); a private file is 0600 from the moment it exists."""
    raw = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def _mkdir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=False)
    return path


@dataclass(frozen=True)
class FleetKit:
    """Where a generated kit's parts are."""

    root: Path
    spec: FleetSpec
    client_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def broker_dir(self) -> Path:
        return self.root / "broker"

    @property
    def coordinator_dir(self) -> Path:
        return self.root / COORDINATOR

    @property
    def mosquitto_conf(self) -> Path:
        return self.broker_dir / "mosquitto.conf"


def generate_fleet_kit(
    spec: FleetSpec,
    out: str | os.PathLike[str],
    *,
    broker_config_dir: str | os.PathLike[str] | None = None,
    issued_at: dt.datetime | None = None,
) -> FleetKit:
    """Write a fleet kit for ``spec`` into the new (or empty) directory ``out``.

    ``broker_config_dir``: where the broker's files will be on the broker host (default: ``out/broker``, absolute),
    written into mosquitto.conf. ``issued_at``: the certificates' start of validity (default: now).
    """
    root = Path(out).absolute()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} exists and is not empty; a fleet kit is written into a new directory")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    now = issued_at or dt.datetime.now(dt.timezone.utc)
    broker = _mkdir(root / "broker")
    conf_dir = Path(broker_config_dir) if broker_config_dir is not None else broker
    users = [None, MONITOR, *spec.clients]  # one bundle each
    passwords = {fleet_username(spec.run, c): secrets.token_urlsafe(32) for c in users}
    # The monitor bundle's other read-only names share its password: one secret, one bundle, several viewers.
    monitors = list(spec.monitor_logins)
    passwords.update(dict.fromkeys(monitors, passwords[monitors[0]]))

    acl = fleet_acl(spec.run, spec.clients, monitors)
    _write(broker / "passwd", "".join(mosquitto_password_line(u, p) + "\n" for u, p in passwords.items()), private=True)
    _write(
        broker / "amqtt-passwd", "".join(amqtt_password_line(u, p) + "\n" for u, p in passwords.items()), private=True
    )
    _write(broker / "acl", mosquitto_acl(spec.run, acl))
    _write(broker / "acl.json", json.dumps({u: {"write": g.write, "read": g.read} for u, g in acl.items()}, indent=1))
    _write(broker / "mosquitto.conf", mosquitto_conf(spec, conf_dir))

    ca: Issued | None = None
    if spec.tls:
        ca = make_ca(spec.run, now, days=max(spec.cert_days, 3650))
        _write(_mkdir(root / "ca") / "ca.key", ca.key_pem, private=True)
        _write(root / "ca" / "ca.crt", ca.cert_pem)
        server = issue(ca, spec.broker_hosts[0], hosts=spec.broker_hosts, server=True, now=now, days=spec.cert_days)
        _write(broker / "ca.crt", ca.cert_pem)
        _write(broker / "server.crt", server.cert_pem)
        _write(broker / "server.key", server.key_pem, private=True)

    dirs: dict[str, Path] = {}
    _mkdir(root / "clients")
    for client in users:
        role = COORDINATOR if client is None else MONITOR if client == MONITOR else "client"
        folder = _mkdir(root / role if role != "client" else root / "clients" / str(client))
        username = fleet_username(spec.run, client)
        bundle: dict[str, object] = {
            "format": BUNDLE_FORMAT,
            "role": role,
            "run": spec.run,
            "client_id": client if role == "client" else None,
            "username": username,
            "broker": spec.broker_url,
            "password_file": PASSWORD_FILE,
        }
        _write(folder / PASSWORD_FILE, passwords[username] + "\n", private=True)
        if ca is not None:
            _write(folder / "ca.crt", ca.cert_pem)
            bundle.update(ca_file="ca.crt", verify_hostname=True)
            if role == "client":  # true: the device loads only programs whose manifest this CA signed
                bundle["signed_programs"] = spec.signed_programs
            if spec.client_certificates:
                leaf = issue(ca, username, hosts=(), server=False, now=now, days=spec.cert_days)
                _write(folder / "client.crt", leaf.cert_pem)
                _write(folder / "client.key", leaf.key_pem, private=True)
                bundle.update(cert_file="client.crt", key_file="client.key")
        if client is None:
            bundle["clients"] = list(spec.clients)
        elif role == MONITOR:
            bundle["usernames"] = monitors  # each viewer's connection takes one (fedge_io.mqtt.MqttLink's logins)
        elif role == "client":
            dirs[client] = folder
        _write(folder / BUNDLE_FILE, json.dumps(bundle, indent=1) + "\n")
    _write(root / "README.txt", _readme(spec, conf_dir))
    log.info("fleet kit of run %r for %d clients written to %s", spec.run, len(spec.clients), root)
    return FleetKit(root, spec, dirs)


def _readme(spec: FleetSpec, conf_dir: Path) -> str:
    """What to copy where: the kit explains itself to whoever opens it."""
    lines = [
        f"fedge fleet kit of run {spec.run!r}: {len(spec.clients)} clients, broker {spec.broker_url}",
        "",
        f"broker/       -> the broker host, at {conf_dir}; chown it to the user mosquitto runs as (started as",
        "                 root, mosquitto reads its files as user 'mosquitto')",
        f"                 then: {mosquitto_command()} -c {conf_dir / 'mosquitto.conf'}",
        "coordinator/  -> the machine of the coordinator (its bundle: fedge reads it with --bundle)",
        "monitor/      -> wherever you watch the run from: fedge status --bundle monitor (reads the run status only)",
        "clients/<id>/ -> device <id>, one directory each (copy it whole, keep its mode: scp -rp)",
    ]
    if spec.tls:
        lines.append("ca/           -> keep offline: ca.key only serves to issue new certificates (issue_certificate)")
    lines += [
        "",
        "Devices come and go while the run goes on (the broker reloaded, the coordinator told; roster.json keeps the",
        "history): fedge kit add-client ID --kit THIS_DIR [--data-from ID]; fedge kit revoke ID --kit THIS_DIR",
        "",
        "Every 'password' and '*.key' file is a secret: never commit, mail or paste it. A new kit makes new ones.",
    ]
    return "\n".join(lines) + "\n"
