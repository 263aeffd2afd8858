"""Devices come and go in a live fleet: ``fedge kit add-client ID`` and ``fedge kit revoke ID``.

Both change a kit in place, while its broker and a run go on:

- the broker's password files (``passwd``, ``amqtt-passwd``) and ACL (``acl``, ``acl.json``), in the kit's ``broker/``
  and, where mosquitto.conf says the broker reads them from elsewhere on this machine, there too (each file replaced
  atomically, keeping its owner and mode: mosquitto reads them as its own user);
- the coordinator bundle's ``clients`` (and ``revoked``, with the reason), which a running coordinator follows
  (:mod:`coordinator.kit.roster`);
- ``roster.json``: every addition and revocation, with its time and reason.

Then mosquitto is told to read its files again (SIGHUP, what ``systemctl reload`` sends): a new device can log in at
once; a revoked one cannot, and mosquitto 2.0 closes its open connection as it reloads (it checks every connected
client against the new password file). The broker process is found by the configuration file on its command line;
one started otherwise (another host, a container) is reloaded by hand, as :class:`Membership` then says.

A revoked id is never issued again (its data, certificate or a copy of its bundle may be in other hands), and a kit
with client certificates cannot revoke: mosquitto takes such a device's login from its certificate, which only a
revocation list would refuse (not built). The embedded broker (amqtt, ``fedge sim --transport mqtt``) reads its
files at start only and cannot be reloaded: while it serves a kit, both commands are refused before anything
changes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coordinator.kit.accounts import (
    _NAME,
    COORDINATOR,
    MONITOR,
    PASSWORD_FILE,
    fleet_acl,
    fleet_username,
    monitor_names,
)
from coordinator.kit.broker_files import (
    EMBEDDED_BROKER_FILE,
    amqtt_password_line,
    mosquitto_acl,
    mosquitto_password_line,
)
from coordinator.kit.pki import issue_certificate
from fedge.errors import ConfigError
from fedge_io.credentials import BUNDLE_FILE

ROSTER_FILE = "roster.json"
LOCK_FILE = ".fedge-kit.lock"
PASSWORD_FILES = ("passwd", "amqtt-passwd")
MAX_REASON = 200


@dataclass(frozen=True)
class Membership:
    """What ``add-client`` or ``revoke`` did: the client, its bundle (added), the broker processes reloaded, and
    what the operator still has to do."""

    client: str
    bundle: Path | None
    data: Path | None
    reloaded: tuple[int, ...]
    todo: tuple[str, ...]


def _replace(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write ``path`` anew (temporary file, fsync, rename), keeping the owner and mode of the file it replaces."""
    old = path.stat() if path.exists() else None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, old.st_mode & 0o777 if old is not None else (mode or 0o644))
        if old is not None and os.geteuid() == 0:
            os.chown(tmp, old.st_uid, old.st_gid)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _strings(value: object, where: Path) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of names, got {str(value)[:80]!r}; is it a fedge fleet kit?")
    return list(value)


def _json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}; is it a fedge fleet kit (made by fedge provision)?") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a fedge fleet kit's file")
    return data


class Kit:
    """A fleet kit on disk, as ``fedge provision`` wrote it."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.bundle_path = self.root / COORDINATOR / BUNDLE_FILE
        self.bundle = _json(self.bundle_path)
        lacking = [k for k in ("format", "run", "broker") if not isinstance(self.bundle.get(k), (str, int))]
        if lacking:
            raise ConfigError(f"{self.bundle_path} lacks {lacking}: is it a fedge fleet kit (made by fedge provision)?")
        self.run = str(self.bundle["run"])
        self.clients = _strings(self.bundle.get("clients"), self.bundle_path)
        revoked = self.bundle.get("revoked") or {}
        if not isinstance(revoked, dict):
            raise ConfigError(f"{self.bundle_path}: 'revoked' must map client ids to reasons")
        self.revoked = {str(k): str(v) for k, v in revoked.items()}
        self.conf = self.root / "broker" / "mosquitto.conf"
        conf = self.conf.read_text(encoding="utf-8") if self.conf.is_file() else ""
        found = re.search(r"^password_file (.+)$", conf, re.M)
        live = Path(found.group(1)).parent if found else self.root / "broker"
        self.broker_dirs = [self.root / "broker", *([live] if live != self.root / "broker" and live.is_dir() else [])]
        self.client_certificates = "use_identity_as_username true" in conf
        monitor = _json(self.root / MONITOR / BUNDLE_FILE)
        self.monitors = _strings(monitor.get("usernames") or [monitor.get("username")], self.root / MONITOR)
        # Read (and checked) before anything changes: a change is recorded last, and must not fail half-way.
        self.roster_path = self.root / ROSTER_FILE
        events = _json(self.roster_path).get("events", []) if self.roster_path.exists() else []
        if not isinstance(events, list):
            raise ConfigError(
                f"{self.roster_path}: 'events' must be a list of the kit's changes; was the file edited by hand? "
                "Nothing was changed"
            )
        self.events: list[object] = events

    def check_writable(self) -> None:
        """ConfigError, before anything is changed, unless this user can replace every file the change writes (each
        is written anew beside the old one, then renamed over it: its folder must be writable)."""
        folders = [self.root, self.bundle_path.parent, *self.broker_dirs, self.root / "clients"]
        blocked = [str(d) for d in folders if d.is_dir() and not os.access(d, os.W_OK | os.X_OK)]
        if blocked:
            raise ConfigError(
                f"cannot change the fleet kit {self.root}: {', '.join(blocked)} not writable by this user; nothing was "
                "changed; run fedge kit as the user that owns the kit (root for a kit whose broker/ was given to "
                "mosquitto)"
            )

    def check_reloadable(self, action: str, client: str) -> None:
        """ConfigError, before anything is changed, while the embedded broker serves this kit: amqtt reads the users
        and ACL once, at start, so the change would not reach it (an added device refused, a revoked one left in)."""
        for folder in self.broker_dirs:
            pid = _embedded_broker_pid(folder / EMBEDDED_BROKER_FILE)
            if pid is None:
                continue
            effect = "let it log in" if action == "add" else "refuse its login or close its connection"
            raise ConfigError(
                f"the broker of this kit is the embedded one (amqtt, in process {pid}: fedge sim --transport mqtt), "
                f"which reads the kit's users and ACL only when it starts: it would not {effect}, so client {client} "
                "was not changed and nothing was written. To add or revoke devices during a run, run the fleet over "
                "the kit's mosquitto (the commands fedge provision printed under 'start the broker'); for a "
                "simulation, stop it and start a new one with the clients it should have"
            )

    def check_new(self, client: str) -> None:
        if not _NAME.fullmatch(client):
            raise ConfigError(f"client id {client!r}: use 1-64 letters, digits, '.', '_' or '-'")
        if (
            client == COORDINATOR
            or client in monitor_names(len(self.monitors))
            or re.fullmatch(r"monitor(-\d+)?", client)
        ):
            raise ConfigError(f"{client!r} is the name of one of the kit's own logins; choose another client id")
        if client in self.revoked:
            raise ConfigError(
                f"client {client} was revoked ({self.revoked[client]}): a revoked id is never issued again"
            )
        if client in self.clients or (self.root / "clients" / client).exists():
            raise ConfigError(f"client {client} is in the fleet already ({self.root / 'clients' / client})")

    def write_broker_files(self, passwords: dict[str, str | None]) -> None:
        """Set (a password) or remove (None) the login of each user name, and write the ACL of the current clients."""
        lines = {"passwd": mosquitto_password_line, "amqtt-passwd": amqtt_password_line}
        acl = fleet_acl(self.run, self.clients, self.monitors)
        for folder in self.broker_dirs:
            for name in PASSWORD_FILES:
                path = folder / name
                if not path.is_file():
                    continue
                kept = [ln for ln in path.read_text().splitlines() if ln.split(":", 1)[0] not in passwords]
                kept += [lines[name](user, pw) for user, pw in passwords.items() if pw is not None]
                _replace(path, "".join(f"{ln}\n" for ln in kept))
            if (folder / "acl").is_file():
                _replace(folder / "acl", mosquitto_acl(self.run, acl))
            if (folder / "acl.json").is_file():
                grants = {u: {"write": g.write, "read": g.read} for u, g in acl.items()}
                _replace(folder / "acl.json", json.dumps(grants, indent=1))

    def write_bundle(self) -> None:
        self.bundle["clients"] = list(self.clients)
        if self.revoked:
            self.bundle["revoked"] = dict(self.revoked)
        _replace(self.bundle_path, json.dumps(self.bundle, indent=1) + "\n")

    def record(self, event: dict[str, object]) -> None:
        self.events.append({"at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **event})
        _replace(self.roster_path, json.dumps({"run": self.run, "events": self.events}, indent=1) + "\n")

    def reload_broker(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """SIGHUP to every mosquitto on this machine started with this kit's configuration; else what to do."""
        confs = {str(d / "mosquitto.conf") for d in self.broker_dirs}
        pids = tuple(sorted(pid for pid in _mosquitto_pids() if _conf_of(pid) in confs))
        for pid in pids:
            os.kill(pid, signal.SIGHUP)
        if pids:
            return pids, ()
        return (), (
            f"no mosquitto started with {' or '.join(sorted(confs))} runs on this machine: reload the broker "
            f"yourself (systemctl reload fedge-{self.run}-broker, or kill -HUP its process) after copying its "
            f"passwd, acl and amqtt-passwd from {self.root / 'broker'} where it reads them",
        )


def _embedded_broker_pid(marker: Path) -> int | None:
    """The process id in an embedded broker's marker file, if that process still runs (a marker left by a killed one
    blocks nothing)."""
    try:
        with open(marker, "rb") as fh:
            text = fh.read(4096)
    except OSError:
        return None
    try:
        pid = json.loads(text).get("pid")
    except (ValueError, AttributeError):
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: it exists
        return pid
    return pid


def _mosquitto_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "exe")).name == "mosquitto":
                    pids.append(int(entry.name))
            except OSError:  # gone, or another user's process we may not look at
                continue
    return pids


def _conf_of(pid: int) -> str | None:
    """The -c argument of a process's command line, as an absolute path (None when it has none)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    for flag, value in itertools.pairwise(words):
        if flag == b"-c":
            return os.path.normpath(os.path.join(cwd, value.decode(errors="replace")))
    return None


@contextlib.contextmanager
def _kit_lock(root: Path) -> Iterator[None]:
    """One change to the kit at ``root`` at a time: each reads, changes and rewrites the broker's files, the
    coordinator's bundle and the roster, so two at once (two operators, a script) could each drop the other's."""
    if not root.is_dir():
        raise ConfigError(f"{root}: no such fleet kit (fedge provision writes it as OUT/kit)")
    try:
        fd = os.open(root / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot change the fleet kit {root}: {exc.strerror}; nothing was changed") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for another fedge kit command on this kit to finish
        yield
    finally:
        os.close(fd)  # releases the lock


def add_client(root: Path, client: str, *, data_from: str | None = None, cert_days: int = 365) -> Membership:
    """Issue device ``client``'s bundle (``clients/<client>/``) into the kit at ``root``, let it log in to the live
    broker, and add it to the coordinator's client list. ``data_from``: write its data file beside the others'
    (``<client>.safetensors``) from this client's (a replacement board takes over a lost one's data)."""
    with _kit_lock(root):
        return _add_client(root, client, data_from=data_from, cert_days=cert_days)


def _add_client(root: Path, client: str, *, data_from: str | None, cert_days: int) -> Membership:
    kit = Kit(root)
    kit.check_new(client)
    kit.check_reloadable("add", client)
    kit.check_writable()
    source = kit.root / "clients" / (data_from or (kit.clients[0] if kit.clients else ""))
    template = _json(source / BUNDLE_FILE) if (source / BUNDLE_FILE).is_file() else {}
    data = None
    if data_from is not None:
        if data_from not in kit.clients:
            raise ConfigError(f"--data-from {data_from}: no such client in the fleet ({', '.join(kit.clients)})")
        data = _copy_data(kit.root.parent, data_from, client)
    folder = kit.root / "clients" / client
    folder.mkdir(mode=0o700, parents=True)  # before the try: a folder this command did not make is never removed
    try:
        _issue(kit, client, folder, template, cert_days)
    except BaseException:  # the kit's client list is unchanged: leave no bundle behind, so the same command can retry
        shutil.rmtree(folder, ignore_errors=True)
        if data is not None:
            data.unlink(missing_ok=True)
        raise
    kit.write_bundle()  # after the broker's files: a coordinator that admits it finds a broker that lets it in
    kit.record({"action": "add-client", "client": client, **({"data_from": data_from} if data_from else {})})
    pids, todo = kit.reload_broker()
    return Membership(client, folder, data, pids, todo)


def _issue(kit: Kit, client: str, folder: Path, template: dict[str, object], cert_days: int) -> None:
    """The new device's bundle in ``folder``, and its login in the broker's files (the coordinator's list is not
    changed)."""
    username = fleet_username(kit.run, client)
    password = secrets.token_urlsafe(32)
    bundle: dict[str, object] = {
        "format": kit.bundle["format"],
        "role": "client",
        "run": kit.run,
        "client_id": client,
        "username": username,
        "broker": kit.bundle["broker"],
        "password_file": PASSWORD_FILE,
    }
    _replace(folder / PASSWORD_FILE, password + "\n", mode=0o600)
    if kit.bundle.get("ca_file"):
        ca = (kit.root / COORDINATOR / str(kit.bundle["ca_file"])).read_text()
        _replace(folder / "ca.crt", ca)
        bundle.update(ca_file="ca.crt", verify_hostname=True, signed_programs=bool(template.get("signed_programs")))
        if kit.client_certificates:
            cert, key = issue_certificate(kit.root / "ca", username, days=cert_days)
            _replace(folder / "client.crt", cert.decode())
            _replace(folder / "client.key", key.decode(), mode=0o600)
            bundle.update(cert_file="client.crt", key_file="client.key")
    _replace(folder / BUNDLE_FILE, json.dumps(bundle, indent=1) + "\n")
    kit.clients.append(client)
    try:
        kit.write_broker_files({username: password})
    except BaseException:
        kit.clients.remove(client)
        raise


def revoke_client(root: Path, client: str, *, reason: str) -> Membership:
    """Cut ``client`` off: its login removed from the broker's files (reloaded: refused, its connection dropped), the
    coordinator told through its client list, the revocation recorded; its bundle's password deleted."""
    with _kit_lock(root):
        return _revoke_client(root, client, reason=reason)


def _revoke_client(root: Path, client: str, *, reason: str) -> Membership:
    kit = Kit(root)
    kit.check_writable()
    if client not in kit.clients:
        known = "it was revoked already" if client in kit.revoked else f"the fleet holds {', '.join(kit.clients)}"
        raise ConfigError(f"client {client} is not in the fleet of run {kit.run!r}: {known}")
    kit.check_reloadable("revoke", client)
    if kit.client_certificates:
        raise ConfigError(
            "this kit logs devices in by their certificates (--client-certificates): mosquitto would still let a "
            "revoked device's certificate in, which only a certificate revocation list refuses, and fedge makes none "
            "yet; make a new kit without the device"
        )
    why = " ".join(reason.split())[:MAX_REASON] or "no reason given"
    kit.clients.remove(client)
    kit.revoked[client] = why
    kit.write_broker_files({fleet_username(kit.run, client): None})
    kit.write_bundle()
    (kit.root / "clients" / client / PASSWORD_FILE).unlink(missing_ok=True)  # worthless now; never left lying around
    kit.record({"action": "revoke", "client": client, "reason": why})
    pids, todo = kit.reload_broker()
    return Membership(client, None, None, pids, todo)


def _copy_data(folder: Path, source: str, client: str) -> Path:
    """``folder/<source>.safetensors`` as ``folder/<client>.safetensors``, naming its new client (the shared file, if
    any, is referenced by name and stays where it is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = folder / f"{source}.safetensors", folder / f"{client}.safetensors"
    if not src.is_file():
        raise ConfigError(f"--data-from {source}: its data file {src} is not beside the kit")
    if dst.exists():
        raise ConfigError(f"{dst} exists already")
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    meta["client"] = client
    save_file(tensors, str(dst), metadata=meta)
    return dst
