"""Who a device logs in to the broker as: credential files, the environment, and the fleet bundles a fleet kit makes.

Secrets never come from the command line (process lists show it): a password is read from a file (the first line,
which should be readable by its owner only) or from ``$FEDGE_MQTT_PASSWORD``. A fleet bundle (``bundle.json`` in
each device's directory of a fleet kit, see :mod:`coordinator.kit`) names the run, the device's identity, the
broker and the TLS and password files next to it; :func:`load_bundle` turns it into a :class:`Bundle` whose address
:class:`fedge_io.mqtt.MqttLink` connects with.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fedge.errors import ConfigError, TransportError
from fedge.wire.protocol import BrokerAddress, check_name

log = logging.getLogger(__name__)

PASSWORD_ENV = "FEDGE_MQTT_PASSWORD"  # the password, when no credential file is given
USERNAME_ENV = "FEDGE_MQTT_USERNAME"
BUNDLE_FILE = "bundle.json"  # in each directory of a fleet kit: who this device is and how it reaches the broker
BUNDLE_FORMAT = 1


def read_secret(path: str | os.PathLike[str]) -> str:
    """The secret in the first line of a credential file; warns when other users may read the file."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise TransportError(
            f"credential file {file} does not exist; copy it from this device's fleet bundle"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(f"cannot read credential file {file}: {exc}") from None
    if not lines or not lines[0].strip():
        raise TransportError(f"credential file {file} is empty; copy it from this device's fleet bundle")
    if mode & 0o077:
        log.warning("credential file %s can be read by other users; run: chmod 600 %s", file, file)
    return lines[0].strip()


def with_credentials(
    address: BrokerAddress,
    *,
    username: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> BrokerAddress:
    """``address`` with the user name and password to log in with; unchanged when none is given anywhere.

    User name: ``username``, else the URL's, else ``$FEDGE_MQTT_USERNAME``. Password: the first line of
    ``password_file``, else ``$FEDGE_MQTT_PASSWORD``, else the URL's (a URL's password is visible in process lists).
    """
    env = os.environ if environ is None else environ
    user = username or address.username or env.get(USERNAME_ENV) or None
    if password_file is not None:
        password: str | None = read_secret(password_file)
    else:
        password = env.get(PASSWORD_ENV) or address.password
    if user is None:
        if password is not None:
            raise ConfigError(f"a password for broker {address} is given but no user name; pass the user name too")
        return address
    return address.with_login(user, password)


Role = Literal["client", "coordinator", "monitor"]


@dataclass(frozen=True)
class Bundle:
    """One device's part of a fleet kit: who it is in which run, and how it reaches and logs in to the broker."""

    role: Role
    run: str
    username: str  # also the MQTT client id: fleet brokers bind client ids to user names
    address: BrokerAddress  # with the password and absolute paths of the TLS files
    client_id: str | None = None  # this client's fedge id; None for the coordinator
    clients: tuple[str, ...] = ()  # for the coordinator: the ids provisioned in this run
    made_for_tls: bool = False  # the kit gave this device a CA: it must never connect without TLS unless told to
    program_ca: str | None = None  # the CA certificate every program's manifest must be signed by (None: unsigned ok)
    # The monitor's read-only user names (``username`` first), all with its password: one per viewer at once, since a
    # fleet broker binds a connection to its user name (MqttLink's ``logins``). Other roles: ``username`` alone.
    usernames: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Bundle({self.role} {self.client_id or ''} of run {self.run!r} at {self.address}, user {self.username})"


def load_bundle(directory: str | os.PathLike[str], *, broker: str | None = None) -> Bundle:
    """Read the bundle a fleet kit made for one device (``clients/<id>/``, ``coordinator/`` or ``monitor/``).

    ``broker`` replaces the bundle's broker URL (scheme, host and port only; e.g. the port of a test broker).
    """
    folder = Path(directory)
    path = folder / BUNDLE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"no {BUNDLE_FILE} in {folder}; pass the directory a fleet kit made for this device "
            "(clients/<id>/, coordinator/ or monitor/)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read fleet bundle {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise ConfigError(f"{path} is not a fedge fleet bundle of format {BUNDLE_FORMAT}; make a new fleet kit")
    try:
        role, run, username = data["role"], check_name(data["run"], "run name"), data["username"]
        client_id = check_name(data["client_id"], "client id") if data.get("client_id") is not None else None
        clients = tuple(check_name(c, "client id") for c in data.get("clients", ()))
        usernames = tuple(check_name(u, "user name") for u in data.get("usernames") or [username])
        base = BrokerAddress.parse(broker or data["broker"])
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"fleet bundle {path} lacks or garbles {exc}; make a new fleet kit") from None
    if role not in ("client", "coordinator", "monitor") or (role == "client") != (client_id is not None):
        raise ConfigError(f"fleet bundle {path} has role {role!r} and client id {client_id!r}; make a new fleet kit")

    def local(key: str) -> str | None:
        name = data.get(key)
        if name is None:
            return None
        file = folder / name
        if not file.is_file():
            raise ConfigError(f"fleet bundle {folder} lacks {name}; copy the whole directory from the fleet kit")
        return str(file.resolve())

    # A broker that cannot be reached is then named with the port the kit's mosquitto.conf listens on.
    own = BrokerAddress.parse(data["broker"])
    origin = f"fleet bundle {folder}, whose broker listens on port {own.port} ({own.url}; the kit's mosquitto.conf)"
    if broker is not None and base.port != own.port:
        origin += f", but --broker asks for port {base.port}"
    address = BrokerAddress(base.host, base.port, tls=base.tls, origin=origin)
    if base.tls:
        address = address.with_tls(
            ca_file=local("ca_file"),
            cert_file=local("cert_file"),
            key_file=local("key_file"),
            verify_hostname=bool(data.get("verify_hostname", True)),
        )
    password_file = local("password_file")
    password = read_secret(password_file) if password_file else None
    made_for_tls = data.get("ca_file") is not None
    signed = data.get("signed_programs", False)
    if not isinstance(signed, bool) or (signed and not made_for_tls):
        raise ConfigError(f"fleet bundle {path}: signed_programs must be true or false, and true needs its ca_file")
    program_ca = local("ca_file") if signed else None
    login = address.with_login(username, password)
    if usernames[0] != username or (role != "monitor" and len(usernames) > 1):
        raise ConfigError(f"fleet bundle {path}: usernames must begin with its username, and only a monitor has more")
    return Bundle(role, run, username, login, client_id, clients, made_for_tls, program_ca, usernames)
