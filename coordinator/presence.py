"""Who is there: the clients that said hello on their status topics, whether they are online, and whether this run
admits them (model, data shape, classes, open set, algorithms they can run).

Admission state changes only by admission: the hello a client was admitted with is kept apart from its latest status,
so a last will (dataset size 0) or a refused hello never changes what its replies are judged against (the cap on
``num_examples``). A later hello that contradicts the admitted one (another data size, model, input shape, classes
or open set) refuses the client for the rest of the run: a device does not change its data, an impostor or a bug
does. The same hello again (a reconnect, a restarted process) is welcome."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fedge.errors import CodecError
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.protocol import ClientStatus, decode_status

log = logging.getLogger(__name__)

MAX_STATUS_BYTES = 16 * 1024
"""A hello or last will is a few hundred bytes; larger status messages are dropped unread."""

Admit = Callable[[ClientStatus], "str | None"]
"""Why a client that said hello cannot take part (wrong model, no open set, ...), or None to admit it."""


@dataclass
class StatusChange:
    """What one status message changed."""

    client: ClientId
    status: ClientStatus
    came_online: bool = False  # it was not online before
    went_offline: bool = False
    refused: str | None = None  # online but not admitted, and why


@dataclass
class Presence:
    """The latest status of every client that ever said hello, and which of them this run refuses."""

    admit: Admit | None = None
    max_clients: int = 10_000  # ids remembered; hellos of further unknown ids are ignored (bounded memory)
    min_interval_s: float = 0.5  # status messages of one client closer together than this are dropped (rate limit)
    clients: dict[ClientId, ClientStatus] = field(default_factory=dict)
    refused: dict[ClientId, str] = field(default_factory=dict)
    admitted: dict[ClientId, ClientStatus] = field(default_factory=dict)  # the hello each client was admitted with
    banned: dict[ClientId, str] = field(default_factory=dict)  # refused for the run: its hellos contradicted admission
    ignored: int = 0  # status messages dropped by the two limits above
    seen_at: dict[ClientId, float] = field(default_factory=dict)  # Unix time of each client's latest hello (the view)
    _last_seen: dict[ClientId, float] = field(default_factory=dict)

    def online(self) -> list[ClientId]:
        """Clients whose latest status is their hello."""
        return sorted(c for c, s in self.clients.items() if s.online)

    def available(self) -> list[ClientId]:
        """Online clients that were admitted."""
        return [c for c in self.online() if c not in self.refused]

    def is_online(self, client: ClientId) -> bool:
        status = self.clients.get(client)
        return status is not None and status.online

    def knows(self, client: ClientId) -> bool:
        return client in self.clients

    def declared_size(self, client: ClientId) -> int | None:
        """The number of samples ``client`` declared in the hello it was admitted with (None: never admitted)."""
        status = self.admitted.get(client)
        return status.dataset_size if status is not None else None

    def update(self, client: ClientId, payload: bytes, now: float | None = None) -> StatusChange | None:
        """Apply a message from ``client``'s status topic; None when it is not a valid status of that client, or
        when a limit drops it (too many client ids, or this client's statuses too frequent)."""
        now = time.monotonic() if now is None else now
        if client not in self.clients and len(self.clients) >= self.max_clients:
            self.ignored += 1
            if self.ignored == 1 or self.ignored % 1000 == 0:
                log.warning("ignoring hellos of unknown clients: %d ids known already", len(self.clients))
            return None
        if len(payload) > MAX_STATUS_BYTES:
            self.ignored += 1
            log.warning("ignoring a %d-byte status message of %s", len(payload), printable(client, 40))
            return None
        if not payload:  # an empty retained message: the client left cleanly
            status = ClientStatus(client=client, state="offline", reason="left")
        else:
            try:
                status = decode_status(payload)
            except CodecError as exc:
                log.warning("ignoring a bad status message of %s: %s", printable(client, 40), exc)
                return None
            if status.client != client:
                log.warning("ignoring a status for %r on %s's topic", printable(status.client, 40), client)
                return None
        was_online = self.is_online(client)
        last = self._last_seen.get(client)
        if status.online and was_online and last is not None and now - last < self.min_interval_s:
            self.ignored += 1  # a flood of hellos from one id: the first counts, repeats are dropped (never a will)
            return None
        self._last_seen[client] = now
        self.clients[client] = status
        change = StatusChange(client, status)
        if not status.online:
            change.went_offline = was_online
            if was_online:
                log.warning("client %s offline (%s)", client, printable(status.reason) or "no reason")
            return change
        why = self.banned.get(client) or _contradiction(self.admitted.get(client), status)
        if why and client not in self.banned:
            self.banned[client] = why
            log.warning("client %s is refused for the rest of the run: %s", client, why)
        if not why and self.admit is not None:
            why = self.admit(status)
        if why:
            if self.refused.get(client) != why:
                log.warning("client %s cannot take part: %s", client, why)
            self.refused[client] = why
            change.refused = why
            return change
        self.refused.pop(client, None)
        self.admitted.setdefault(client, status)
        self.seen_at[client] = time.time()
        change.came_online = not was_online
        if change.came_online:
            log.info(
                "client %s online (%s on %s, %d samples)",
                client,
                printable(status.runtime, 40),
                printable(status.device, 40),
                status.dataset_size,
            )
        return change


_IDENTITY = ("dataset_size", "model", "input_shape", "num_classes", "open_size")
"""What a client's data and model are: a hello that changes one of these is not the client that was admitted."""


def _contradiction(admitted: ClientStatus | None, hello: ClientStatus) -> str | None:
    """Why ``hello`` contradicts the hello this client was admitted with, or None."""
    if admitted is None:
        return None
    for name in _IDENTITY:
        before, now = getattr(admitted, name), getattr(hello, name)
        if before != now:
            return f"its hello changed {name} from {printable(str(before), 40)} to {printable(str(now), 40)}"
    return None
