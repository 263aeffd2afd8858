"""systemd units for a fleet kit: the broker, the coordinator and each client as services that restart on failure.

``fedge provision --fleet-broker HOST`` writes them to ``kit/systemd/``:

- ``fedge-<run>-broker.service``: mosquitto from the kit's configuration (started as root, it drops to its own user);
  SIGHUP reloads the password file and ACL (``systemctl reload``).
- ``fedge-<run>-coordinator.service``: ``fedge coordinator --run-dir DIR`` with the kit's coordinator bundle and the
  provisioned config.json: the same command starts the run, resumes it from its journal after a crash or a reboot,
  and leaves it alone once it has finished (exit 0). Ctrl-C/SIGTERM exit codes (130, 143) count as a clean stop;
  every other exit is retried (exit 2 is a configuration error, but also a broker that cannot be reached yet). A
  SIGTERM during a round lets that round finish first (:mod:`coordinator.stopping`): ``TimeoutStopSec`` leaves it the
  round timeout the unit runs with (the default 300 s; under secure aggregation four times it, the training and the
  protocol's three stages, each with that deadline) and half a minute more before systemd kills it.
- ``fedge-<run>-client@.service``: one template for every device, instantiated by client id
  (``systemctl enable --now fedge-<run>-client@c003``); it expects the device's files under ``DEVICE_ROOT/<run>/<id>/``
  (its bundle folder ``clients/<id>/`` as ``bundle/``, its data file, and ``shared.safetensors`` when there is one)
  and fedge installed in ``DEVICE_ROOT/venv``. A client the coordinator refused (exit 3) is not restarted in a loop:
  restarting would not change the answer; any other exit is (a broker not reachable yet exits 2, as a wrong
  configuration does; a run that could not start exits 4, and the restarted client waits for the next coordinator).

The coordinator and the clients run as :data:`SERVICE_USER`, a dedicated system user without a login or any
privilege (:func:`service_user_commands` makes it and gives it the files it needs; on a Jetson it also joins group
``video``, which owns the GPU's device files). A service that runs as root would hand a flaw in fedge or a library
it loads (torch, a model plugin, the MQTT client) the whole machine. The broker unit starts mosquitto as root, which
then becomes its own user ``mosquitto`` before it reads anything (its ``user`` option), as the Debian package's unit
does.

A run whose model or dataset comes from a plugin (``fedge provision --plugin ...``) names it in the coordinator's and
the clients' commands: a module by name, a ``.py`` file by this machine's path for the coordinator and, for a device,
by its name in the device's folder (copied there beside its data file).

The coordinator's paths are this machine's (where ``fedge provision`` ran, which is where the kit says the coordinator
runs); the broker's are the kit's broker directory on the broker host. Every unit is checked with ``systemd-analyze
verify`` in ``tests/coordinator/test_services.py``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from fedge.errors import ConfigError

DEFAULT_DEVICE_ROOT = Path("/opt/fedge")
# The exit code of `fedge client` that a restart cannot cure: 3, refused by the coordinator (the reason is in the
# journal). Not 2: fedge exits 2 for a configuration error but also for a broker it cannot reach (a device that boots
# before its broker, a broker host down for a while), which a restart does cure.
CLIENT_FINAL_EXITS = (3,)
SERVICE_USER = "fedge"  # the system user the coordinator and client units run as, unless provision names another
# A name useradd takes on every distribution (POSIX portable user names, lower case, at most 32 characters); never root:
# the point of a service user is that a flaw in what the service loads does not get the machine.
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def service_user(name: str) -> str:
    """``name`` if it can be the units' service user; ConfigError saying why not (root, or not a portable name)."""
    if name == "root":
        raise ConfigError("the service user cannot be root: the units run fedge unprivileged (pick e.g. 'fedge')")
    if not _USER_NAME.fullmatch(name):
        raise ConfigError(
            f"service user {name!r} is not a portable user name: lower-case letters, digits, '_' and '-', starting "
            "with a letter or '_', at most 32 characters"
        )
    return name


COORDINATOR_STOP_S = 330  # a stop finishes the round under way: the default --round-timeout (300 s) and a margin
SECURE_ROUND_TIMEOUTS = (
    4  # a secure round's deadlines: the training's, then one per protocol stage (share, upload, unmask)
)


def coordinator_stop_s(secure_aggregation: bool) -> int:
    """The coordinator unit's ``TimeoutStopSec``: the longest round at the default --round-timeout, and a margin."""
    return COORDINATOR_STOP_S + ((SECURE_ROUND_TIMEOUTS - 1) * 300 if secure_aggregation else 0)


def _path(path: Path) -> str:
    """A path as systemd reads it: ``%`` starts a specifier, so a literal one is doubled."""
    return str(path).replace("%", "%%")


def _command(words: Sequence[str]) -> str:
    """One ExecStart line: systemd splits words as a shell does and honours the same single quotes."""
    return " ".join(shlex.quote(w) for w in words)


def is_plugin_file(entry: str) -> bool:
    """Whether a ``--plugin`` entry is a Python file (copied to each device) rather than an importable module."""
    return entry.endswith(".py") or "/" in entry


def device_plugins(plugins: Sequence[str], folder: str | None = None) -> list[str]:
    """``plugins`` as a device names them: a file by its name in the device's ``folder`` (None: the working
    directory, where its data file is), a module as it is."""

    def on_device(entry: str) -> str:
        if not is_plugin_file(entry):
            return entry
        return Path(entry).name if folder is None else f"{folder}/{Path(entry).name}"

    return [on_device(e) for e in plugins]


def plugin_flags(plugins: Sequence[str]) -> list[str]:
    """``--plugin P`` for each entry."""
    return [word for entry in plugins for word in ("--plugin", entry)]


def broker_unit(run: str, *, mosquitto: Path, conf_dir: Path) -> str:
    return f"""[Unit]
Description=fedge fleet broker of run {run} (mosquitto)
After=network-online.target
Wants=network-online.target

[Service]
ExecStart={_command([_path(mosquitto), "-c", _path(conf_dir / "mosquitto.conf")])}
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=2

[Install]
WantedBy=multi-user.target
"""


def coordinator_unit(
    run: str,
    *,
    fedge: Sequence[str | Path],
    bundle: Path,
    config: Path,
    run_dir: Path,
    broker_unit_name: str | None,
    plugins: Sequence[str] = (),
    secure_aggregation: bool = False,
    user: str = SERVICE_USER,
) -> str:
    """``fedge``: the command that runs fedge on the coordinator's machine (e.g. ``[python, "-m",
    "fedge_cli.main"]``); ``plugins``: the run's ``--plugin`` entries (files by this machine's path);
    ``secure_aggregation``: the run's rounds last up to four round timeouts, which a stop waits for; ``user``: the
    system user it runs as."""
    after = f" {broker_unit_name}" if broker_unit_name else ""
    command = [*(_path(Path(w)) for w in fedge), "coordinator", "--bundle", _path(bundle), "--config", _path(config)]
    command += [
        "--run-dir",
        _path(run_dir),
        *plugin_flags([_path(Path(p)) if is_plugin_file(p) else p for p in plugins]),
    ]
    return f"""[Unit]
Description=fedge coordinator of run {run}
After=network-online.target{after}
Wants=network-online.target

[Service]
ExecStart={_command(command)}
WorkingDirectory={_path(config.parent)}
Restart=on-failure
RestartSec=10
SuccessExitStatus=130 143
TimeoutStopSec={coordinator_stop_s(secure_aggregation)}
User={user}
Group={user}
NoNewPrivileges=yes

[Install]
WantedBy=multi-user.target
"""


def client_unit(run: str, *, device_root: Path, plugins: Sequence[str] = (), user: str = SERVICE_USER) -> str:
    """The template ``fedge-<run>-client@.service``; ``%i`` is the client id. ``plugins``: the run's ``--plugin``
    entries; a file is expected in the device's folder; ``user``: the system user it runs as."""
    home = f"{_path(device_root / run)}/%i"
    command = [_path(device_root / "venv" / "bin" / "fedge"), "client", "--bundle", f"{home}/bundle"]
    on_device = [_path(Path(p)) if is_plugin_file(p) else p for p in plugins]
    command += ["--data", f"{home}/%i.safetensors", "--device", "auto", *plugin_flags(device_plugins(on_device, home))]
    return f"""[Unit]
Description=fedge client %i of run {run}
After=network-online.target
Wants=network-online.target

[Service]
ExecStart={_command(command)}
WorkingDirectory={home}
Restart=always
RestartSec=5
RestartPreventExitStatus={" ".join(map(str, CLIENT_FINAL_EXITS))}
User={user}
Group={user}
NoNewPrivileges=yes
ProtectSystem=full

[Install]
WantedBy=multi-user.target
"""


def write_units(
    out: Path,
    run: str,
    *,
    mosquitto: Path,
    broker_conf_dir: Path,
    fedge: Sequence[str | Path],
    coordinator_bundle: Path,
    config: Path,
    run_dir: Path,
    device_root: Path = DEFAULT_DEVICE_ROOT,
    plugins: Sequence[str] = (),
    secure_aggregation: bool = False,
    user: str = SERVICE_USER,
) -> dict[str, Path]:
    """Write the three unit files into ``out`` (made if absent); their paths by role. ``plugins``: the run's
    ``--plugin`` entries, as this machine resolves them (files by absolute path); ``secure_aggregation``: whether
    the run's config asks for it (its rounds take longer to finish on a stop); ``user``: the system user the
    coordinator and client units run as (:func:`service_user` checks it)."""
    user = service_user(user)
    out.mkdir(parents=True, exist_ok=True)
    broker = f"fedge-{run}-broker.service"
    units = {
        "broker": (broker, broker_unit(run, mosquitto=mosquitto, conf_dir=broker_conf_dir)),
        "coordinator": (
            f"fedge-{run}-coordinator.service",
            coordinator_unit(
                run,
                fedge=fedge,
                bundle=coordinator_bundle,
                config=config,
                run_dir=run_dir,
                broker_unit_name=broker,
                plugins=plugins,
                secure_aggregation=secure_aggregation,
                user=user,
            ),
        ),
        "client": (
            f"fedge-{run}-client@.service",
            client_unit(run, device_root=device_root, plugins=plugins, user=user),
        ),
    }
    paths = {}
    for role, (name, text) in units.items():
        (out / name).write_text(text)
        paths[role] = out / name
    steps = install_commands(
        run, device_root, plugins, coordinator_bundle=coordinator_bundle, runs=run_dir.parent, user=user
    )
    (out / "README.txt").write_text("\n".join(steps) + "\n")
    return paths


def service_user_commands(paths: Sequence[Path], *, jetson: bool = False, user: str = SERVICE_USER) -> list[str]:
    """Shell commands, run as root, that make ``user`` (a system user: no password, no login shell, a home for
    fedge's caches and journal key) if it is missing and give it ``paths`` (each directory and all within).
    ``jetson``: also add it to group ``video`` (the GPU's device files on L4T)."""
    make = (
        f"id -u {user} >/dev/null 2>&1 || useradd --system --create-home --home-dir /var/lib/{user} "
        f"--shell /usr/sbin/nologin {user}"
    )
    commands = [make, *(f"chown -R {user}:{user} {shlex.quote(str(p))}" for p in paths)]
    if jetson:
        commands.append(f"usermod -aG video {user}   # on a Jetson: the GPU's device files belong to group video")
    return commands


def install_commands(
    run: str,
    device_root: Path = DEFAULT_DEVICE_ROOT,
    plugins: Sequence[str] = (),
    *,
    coordinator_bundle: Path | None = None,
    runs: Path | None = None,
    user: str = SERVICE_USER,
) -> list[str]:
    """How to install the units, host by host (also printed by ``fedge provision``). ``coordinator_bundle`` and
    ``runs`` (the parent of the coordinator's run directory): what its service user (``user``) must own."""
    home = device_root / run
    owned = [p for p in (coordinator_bundle, runs) if p is not None]
    coordinator = [f"  coordinator:  its service user (the unit runs as {user!r}, never root):"]
    if runs is not None:  # the coordinator makes its run directory there
        coordinator.append(f"                  install -d {shlex.quote(str(runs))}")
    coordinator += [f"                  {c}" for c in service_user_commands(owned, user=user)]
    coordinator.append(
        f"                then systemctl enable --now fedge-{run}-coordinator   (restarted, it resumes the run)"
    )
    files = [Path(p).name for p in plugins if is_plugin_file(p)]
    extra = f", {', '.join(files)}" if files else ""
    return [
        f"systemd units of run {run!r} (copy each to /etc/systemd/system/ on its host, as root):",
        f"  broker host:  systemctl enable --now fedge-{run}-broker",
        *coordinator,
        f"  each device:  fedge in {device_root / 'venv'} (python3 -m venv {device_root / 'venv'} && "
        f"{device_root / 'venv' / 'bin' / 'pip'} install 'fedge[client]'),",
        f"                clients/<id>/ copied to {home}/<id>/bundle/ (cp -rp: keep its modes),",
        f"                <id>.safetensors{extra} (and shared.safetensors, if written) to {home}/<id>/, then",
        f"                its service user (the client unit runs as {user!r}, never root):",
        *(f"                  {c}" for c in service_user_commands([home / "<id>"], jetson=True, user=user)),
        f"                systemctl enable --now fedge-{run}-client@<id>",
    ]
