"""Who a live fleet holds: the coordinator bundle's client list, which ``fedge kit add-client`` and ``fedge kit revoke``
change while a run goes on (:mod:`coordinator.kit.membership`).

The coordinator reads its bundle's ``clients`` and ``revoked`` again whenever the file changed (looked at once a
second at most): a device added is admitted at its hello, a device revoked is refused and, if it is in a round, counts
as gone from it at once. The broker has by then refused its login and dropped its connection; the coordinator learns it
here, with the reason the operator gave, rather than from a last will the broker may never deliver.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.presence import Admit
from fedge.wire.fields import printable
from fedge.wire.protocol import ClientStatus
from fedge_io.credentials import BUNDLE_FILE

log = logging.getLogger(__name__)

MAX_BUNDLE_BYTES = 4 << 20  # a bundle of 10,000 clients is ~200 kB; a larger file is not read


@dataclass
class Roster:
    """The clients of a kit's coordinator bundle (``bundle_dir/bundle.json``), read again when the file changes."""

    bundle_dir: Path
    interval_s: float = 1.0  # how often the file's modification time is looked at, at most
    clients: frozenset[str] = frozenset()
    revoked: dict[str, str] = field(default_factory=dict)  # client -> the operator's reason
    _seen: tuple[int, int] = (0, 0)  # (mtime_ns, size) of the file last read
    _checked: float = -1e9

    def __post_init__(self) -> None:
        self.reload(force=True)

    def reload(self, *, force: bool = False) -> list[str]:
        """Read the bundle again if it changed; the clients revoked since the last read (empty: none, or unchanged,
        or the file cannot be read now: a bundle being replaced is read at the next look)."""
        now = time.monotonic()
        if not force and now - self._checked < self.interval_s:
            return []
        self._checked = now
        path = self.bundle_dir / BUNDLE_FILE
        try:
            st = os.stat(path)
            if (st.st_mtime_ns, st.st_size) == self._seen and not force:
                return []
            if st.st_size > MAX_BUNDLE_BYTES:
                raise ValueError(f"{st.st_size} bytes")
            data = json.loads(path.read_text(encoding="utf-8"))
            clients = frozenset(str(c) for c in data.get("clients", ()))
            revoked = {str(c): printable(str(why), 200) for c, why in dict(data.get("revoked") or {}).items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("could not read the fleet's client list from %s: %s (kept the last one)", path, exc)
            return []
        self._seen = (st.st_mtime_ns, st.st_size)
        added = sorted(clients - self.clients)
        newly = sorted(set(revoked) - set(self.revoked))
        if not force:
            for client in added:
                log.info("client %s was added to the fleet (fedge kit add-client): admitted at its hello", client)
            for client in newly:
                log.warning("client %s was revoked from the fleet (fedge kit revoke): %s", client, revoked[client])
        self.clients, self.revoked = clients - set(revoked), revoked
        return newly

    def why_revoked(self, client: str) -> str:
        """The refusal of a revoked client ("" when it is not)."""
        why = self.revoked.get(client)
        return "" if why is None else f"revoked from the fleet (fedge kit revoke): {why}"

    def admit(self, then: Admit | None = None) -> Admit:
        """An admission rule: the kit's clients as of now (revoked ones refused with the reason), then ``then``."""

        def admit(status: ClientStatus) -> str | None:
            self.reload()
            why = self.why_revoked(status.client)
            if why:
                return why
            if status.client not in self.clients:
                return "not provisioned in this run's fleet kit"
            return then(status) if then is not None else None

        return admit
