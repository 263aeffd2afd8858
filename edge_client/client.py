"""An edge client, independent of how messages reach it."""

from __future__ import annotations

from fedge.algorithms import run_client_step
from fedge.algorithms.base import ClientData
from fedge.learning.backend import Backend
from fedge.types import ClientId
from fedge.wire.message import Message


class EdgeClient:
    """A client's data, runtime and own state (FD and DS-FL clients keep their models across rounds)."""

    def __init__(self, client_id: ClientId, data: ClientData, backend: Backend) -> None:
        self.client_id = client_id
        self.data = data
        self.backend = backend
        self.store: dict = {}

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        """Compute the update a task asks for, on ``backend`` (default: the client's own; the MQTT client passes a
        wrapper of it that logs progress, :class:`edge_client.progress.ObservedBackend`)."""
        return run_client_step(task, broadcast, self.data, backend or self.backend, self.store)
