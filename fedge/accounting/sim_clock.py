"""The simulated wall clock of a synchronous round, from the bytes the ledger counts and the clients' profiles.

A client that replied took (docs/simulated_time.md)

    t_c = sum over the messages it received (8 * payload bytes / downlink + latency)      # broadcast and task
        + samples_c * local_epochs * compute_c                                            # seconds per sample-step
        + sum over the messages it sent (8 * payload bytes / uplink + latency)            # its reply

and the round took the slowest reply's t_c: the coordinator waits for it. With a deadline, a client whose t_c exceeds
it is dropped (``simulated deadline``) and the round took the deadline. Payload bytes are the encoded messages, what a
link carries (the wire's MQTT headers are not counted in process).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.profiles import ClientProfile
from fedge.types import ClientId

DEADLINE_REASON = "simulated deadline"


@dataclass(frozen=True)
class ClientTime:
    """One client's simulated round: downlink transfer, compute, uplink transfer and latency, in seconds."""

    client: ClientId
    down_s: float
    compute_s: float
    up_s: float
    latency_s: float

    @property
    def total_s(self) -> float:
        return self.down_s + self.compute_s + self.up_s + self.latency_s


@dataclass(frozen=True)
class RoundTime:
    """A round's simulated duration: ``wait_s`` (until a client was available to sample) + the slowest reply's time
    (or the deadline when a client missed it); ``late``: the clients that missed the deadline."""

    round: int
    clients: tuple[ClientTime, ...]
    wait_s: float = 0.0
    deadline_s: float = 0.0  # 0: none
    late: tuple[ClientId, ...] = ()

    @property
    def seconds(self) -> float:
        if self.late:
            return self.wait_s + self.deadline_s
        return self.wait_s + max((c.total_s for c in self.clients), default=0.0)


def client_time(
    client: ClientId, entries: Iterable[LedgerEntry], profile: ClientProfile, samples: int, local_epochs: int
) -> ClientTime:
    """``client``'s simulated round from the round's ledger ``entries`` (a broadcast counts for every recipient)."""
    down = up = messages = 0
    for e in entries:
        if e.direction == "down" and e.client in (client, BROADCAST_CLIENT):
            down, messages = down + e.payload_bytes, messages + 1
        elif e.direction == "up" and e.client == client:
            up, messages = up + e.payload_bytes, messages + 1
    link = profile.link
    return ClientTime(
        client=client,
        down_s=8 * down / link.down_bps,
        compute_s=samples * local_epochs * profile.compute_s,
        up_s=8 * up / link.up_bps,
        latency_s=messages * link.latency_s,
    )


def round_time(
    rnd: int,
    entries: Sequence[LedgerEntry],
    replied: Iterable[ClientId],
    profiles: Mapping[ClientId, ClientProfile],
    samples: Mapping[ClientId, int],
    local_epochs: int,
    *,
    deadline_s: float = 0.0,
    wait_s: float = 0.0,
) -> RoundTime:
    """Round ``rnd``'s simulated time from its ledger entries and the clients that replied (see the module)."""
    own = [e for e in entries if e.round == rnd]
    times = tuple(client_time(c, own, profiles[c], samples[c], local_epochs) for c in sorted(replied))
    late = tuple(t.client for t in times if deadline_s > 0 and t.total_s > deadline_s)
    return RoundTime(rnd, times, wait_s, deadline_s, late)


def time_to(accuracies: Sequence[float], clock_s: Sequence[float], threshold: float) -> float | None:
    """Simulated seconds until the accuracy first reaches ``threshold`` (as ComU@x counts bytes); None if never.

    ``accuracies[i]`` and ``clock_s[i]`` (cumulative) are measured after the same round."""
    if len(accuracies) != len(clock_s):
        raise ValueError(f"got {len(accuracies)} accuracies but {len(clock_s)} clock readings")
    for acc, t in zip(accuracies, clock_s, strict=True):
        if acc >= threshold:
            return float(t)
    return None
