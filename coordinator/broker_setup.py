"""Getting a fleet kit's broker files to the user mosquitto runs as, and the exact commands that start it.

Started as root, mosquitto >= 2.0 becomes user ``mosquitto`` (its ``user`` option) *before* it reads the password
file, the ACL and the TLS key, and it writes its persistence database as that user. So the kit's ``broker/`` must
belong to that user, and every directory above it must let that user through; a kit under ``/root`` (mode 0700)
never can, whatever is chowned. Started by anyone else, mosquitto stays that user and reads the files its owner
wrote. :func:`broker_plan` decides where the broker's files go and which commands put them there and start it;
:func:`hand_over` does the chown that root can do at once.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

BROKER_USER = "mosquitto"  # the user mosquitto drops to when started as root (its default ``user``)
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin")
"""Where packages put daemons such as mosquitto (Debian, Ubuntu and JetPack: /usr/sbin; Homebrew: /opt/homebrew/sbin);
root has the first two on its PATH, a normal user none of them."""
DEFAULT_MOSQUITTO = "/usr/sbin/mosquitto"  # where apt-get install mosquitto puts it


def find_mosquitto() -> str | None:
    """The full path of the mosquitto binary on this machine (on PATH or in :data:`SBIN_DIRS`), or None."""
    return shutil.which("mosquitto", path=os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN_DIRS]))


def mosquitto_command() -> str:
    """mosquitto as a printed command must name it: by full path, because a user who is not root does not have
    /usr/sbin on PATH (`mosquitto: command not found`). This machine's, else where the Debian package puts it."""
    return find_mosquitto() or DEFAULT_MOSQUITTO


@dataclass(frozen=True)
class BrokerPlan:
    """Where mosquitto.conf says the broker's files are (``conf_dir``), and the shell commands, in order, that get
    them there from the kit and start the broker. ``note``: why the files cannot stay where they were written."""

    conf_dir: Path
    commands: tuple[str, ...]
    note: str = ""


def _account(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        return None


def blocked_by(path: Path, user: str) -> Path | None:
    """The first existing directory on the way to ``path`` that ``user`` cannot enter (no search permission), or
    None. Directories that do not exist yet are not judged (whoever creates them chooses their mode)."""
    account = _account(user)
    if account is None:
        return None
    groups = {account.pw_gid, *(g.gr_gid for g in grp.getgrall() if user in g.gr_mem)}
    for folder in [*reversed(path.absolute().parents), path.absolute()]:
        try:
            st = folder.stat()
        except FileNotFoundError:
            return None
        if account.pw_uid == 0:
            continue
        if st.st_uid == account.pw_uid:
            allowed = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            allowed = st.st_mode & stat.S_IXGRP
        else:
            allowed = st.st_mode & stat.S_IXOTH
        if not allowed:
            return folder
    return None


def broker_plan(
    kit_broker_dir: Path,
    *,
    run: str,
    conf_dir: Path | None = None,
    as_root: bool | None = None,
    mosquitto: str | None = None,
) -> BrokerPlan:
    """Where the broker's files should live and the commands that start mosquitto from them.

    ``kit_broker_dir``: where the kit's ``broker/`` is (or will be) written. ``conf_dir``: where the operator wants
    the files (``--fleet-broker-dir``); None: where they are written, unless mosquitto started as root could not
    reach them there, in which case its home directory (``~mosquitto/fedge-<run>``). ``as_root``: whether the broker
    will be started by root (default: whether this process is root; the kit is usually made where it runs).
    ``mosquitto``: the binary the last command runs (default: :func:`mosquitto_command`, a full path).
    """
    root = os.geteuid() == 0 if as_root is None else as_root
    written = kit_broker_dir.absolute()
    account = _account(BROKER_USER) if root else None
    note = ""
    if conf_dir is None:
        conf_dir = written
        blocker = blocked_by(written.parent, BROKER_USER) if account is not None else None
        if blocker is not None and account is not None:
            conf_dir = Path(account.pw_dir) / f"fedge-{run}"
            note = (
                f"user {BROKER_USER} cannot enter {blocker} (mode {stat.S_IMODE(blocker.stat().st_mode):o}), so "
                f"the broker's files go to {conf_dir}"
            )
    conf_dir = conf_dir.absolute()
    q = shlex.quote
    commands: list[str] = []
    if conf_dir != written:
        owner = f" -o {BROKER_USER} -g {BROKER_USER}" if root else ""
        # cp -a keeps each file's mode (0600 secrets) and, run by root, its owner.
        commands += [f"install -d -m 0700{owner} {q(str(conf_dir))}", f"cp -a {q(str(written))}/. {q(str(conf_dir))}/"]
    if root:
        # Idempotent, and needed on another broker host, where hand_over could not chown.
        commands.append(f"chown -R {BROKER_USER}:{BROKER_USER} {q(str(conf_dir))}")
    commands.append(f"{q(mosquitto or mosquitto_command())} -c {q(str(conf_dir / 'mosquitto.conf'))}")
    return BrokerPlan(conf_dir, tuple(commands), note)


def hand_over(kit_root: Path, broker_dir: Path) -> bool:
    """As root, give ``broker_dir`` and its files to the broker's user and let that user through ``kit_root``
    (mode 0711: it can enter, not list; the devices' folders inside stay 0700). False when not root or the user
    does not exist on this machine (the printed ``chown`` then does it on the broker host)."""
    account = _account(BROKER_USER)
    if os.geteuid() != 0 or account is None:
        return False
    kit_root.chmod(0o711)
    for path in [broker_dir, *broker_dir.rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)
    return True
