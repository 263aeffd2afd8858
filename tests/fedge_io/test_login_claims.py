"""Viewers on one machine take different logins of a monitor bundle (fedge_io.login_claims): a held name is skipped,
a released or dead viewer's name is free again, and without usable locks the choice is random, as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fedge_io.login_claims import LoginClaim

NAMES = ("m-0", "m-1", "m-2")


def take_once(folder: Path, names: list[str]) -> str:
    """The name a viewer that starts now would take (it leaves at once)."""
    claim = LoginClaim("b:1", folder)
    try:
        return claim.take(names)
    finally:
        claim.release()


def test_viewers_on_one_machine_never_take_the_same_name(tmp_path: Path) -> None:
    claims = [LoginClaim("broker:8883", tmp_path / "locks") for _ in NAMES]
    taken = [claim.take(NAMES) for claim in claims]
    assert sorted(taken) == sorted(NAMES)  # three viewers, three names: each its own, whatever the random order
    assert (tmp_path / "locks").stat().st_mode & 0o7777 == 0o1777  # any user's viewer can add its lock file
    # A viewer that loses its connection moves to a free name, never its own: here the only free one is released.
    claims[0].release()
    assert claims[1].take(NAMES, avoid=taken[1]) == taken[0]
    # More viewers than names: a random one (the broker then pushes one of two off, as without locks).
    assert LoginClaim("broker:8883", tmp_path / "locks").take(NAMES) in NAMES
    # Another broker's names are other locks.
    assert LoginClaim("other:8883", tmp_path / "locks").take(NAMES[:1]) == "m-0"


def test_a_killed_viewer_holds_no_name(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from fedge_io.login_claims import LoginClaim; "
        f"c = LoginClaim('b:1', Path({str(tmp_path)!r})); print(c.take(['a', 'b']), flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        held = proc.stdout.readline().strip()
        free = {"a": "b", "b": "a"}[held]
        assert [take_once(tmp_path, ["a", "b"]) for _ in range(5)] == [free] * 5
    finally:
        proc.kill()
        proc.wait(10)
    mine = LoginClaim("b:1", tmp_path)
    assert mine.take([free]) == free
    assert [take_once(tmp_path, ["a", "b"]) for _ in range(5)] == [held] * 5  # its lock went with it: free again
    mine.release()


def test_without_usable_locks_the_choice_is_random(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the lock directory's name is taken by a file: no locks, no error
    seen = {take_once(blocked, list(NAMES)) for _ in range(60)}
    assert seen == set(NAMES)  # 60 draws of 3: all three appear (chance of missing one: 3 * (2/3)^60, ~1e-10)
