"""A client's algorithm state on disk: SCAFFOLD's control variate, FedDyn's gradient, the FD and DS-FL clients' own
models. Without it a restarted client, or one serving a coordinator resumed from its journal, starts from nothing and
the run no longer gives the uninterrupted run's model.

After each round it answered, the client writes its state as ``<run>-<client>-r<round>.safetensors`` (atomically:
a temporary file, then a rename) and keeps the last :data:`KEEP` of them. When a coordinator session it has not served
yet sends round ``r`` (a resumed coordinator, or this process's first task), the client restores the newest state
written before round ``r``: a resumed coordinator re-runs the rounds after its journal, and the state of a round it
lost is not the state it resumes from. Round 1 starts a new run: the files of the old one are removed.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from fedge.wire.protocol import check_name

log = logging.getLogger(__name__)

KEEP = 3
_NAME = re.compile(r"r(\d{6,9})\.safetensors")


class ClientStateFiles:
    """The state snapshots of one client of one run in ``directory``."""

    def __init__(self, directory: Path, run: str, client: str) -> None:
        self.directory = directory
        self.prefix = f"{check_name(run, 'run')}-{check_name(client, 'client id')}-"
        self.run, self.client = run, client

    def _rounds(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            if p.name.startswith(self.prefix):
                m = _NAME.fullmatch(p.name[len(self.prefix) :])
                if m:
                    found.append(int(m.group(1)))
        return sorted(found)

    def _path(self, rnd: int) -> Path:
        return self.directory / f"{self.prefix}r{rnd:06d}.safetensors"

    def save(self, rnd: int, store: dict) -> bool:
        """Write the state after round ``rnd``; False (with a warning) when it cannot be written or is not tensors."""
        if not all(isinstance(v, torch.Tensor) for v in store.values()):
            log.warning("round %d: this algorithm's client state is not all tensors: not saved to disk", rnd)
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            data = save(
                {k: v.detach().cpu().contiguous() for k, v in store.items()},
                metadata={"run": self.run, "client": self.client, "round": str(rnd)},
            )
            fd, tmp = tempfile.mkstemp(prefix=f".{self.prefix}", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, self._path(rnd))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            for old in self._rounds()[:-KEEP]:
                self._path(old).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("round %d: cannot write the client state to %s: %s", rnd, self.directory, exc)
            return False
        return True

    def restore(self, before: int) -> tuple[int, dict] | None:
        """The newest state written before round ``before`` (its round and tensors), or None. A file that does not
        read back is skipped with a warning (an older one may still serve)."""
        for rnd in reversed([r for r in self._rounds() if r < before]):
            path = self._path(rnd)
            try:
                return rnd, dict(load_file(str(path)))
            except (OSError, SafetensorError) as exc:
                log.warning("skipping the unreadable client state %s: %s", path, exc)
        return None

    def clear(self) -> None:
        """Remove every state file of this client and run (a new run with the same name starts)."""
        for rnd in self._rounds():
            self._path(rnd).unlink(missing_ok=True)
