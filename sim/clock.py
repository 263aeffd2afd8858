"""The simulated clock of ``fedge sim --client-profiles/--link`` (docs/simulated_time.md), at the transport.

:class:`SimClockTransport` wraps the in-process transport without changing the round engine: it offers the engine only
the clients available at the round's simulated start (waiting, in simulated time, for the first one when none is), and
after each exchange computes the round's time from the messages the exchange counted
(:func:`fedge.accounting.sim_clock.round_time`); a reply later than ``--sim-deadline`` becomes a drop, as a
coordinator's round timeout makes one. :meth:`SimClockTransport.stamp` adds ``sim_time_s`` and ``sim_clock_s`` to a
round's record before it is written.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from coordinator.transport import Exchange, ReplyCheck, Transport
from fedge.accounting.records import Drop, RoundRecord
from fedge.accounting.sim_clock import DEADLINE_REASON, RoundTime, round_time, time_to
from fedge.algorithms.base import RoundPlan
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import (
    DEFAULT_LINK,
    ClientProfile,
    file_needs_reference,
    generate_profiles,
    parse_link,
    parse_profiles,
    read_profiles,
)
from fedge.types import ClientId

log = logging.getLogger(__name__)

SIM_TIME = "sim_time_s"
SIM_CLOCK = "sim_clock_s"


def measure_compute(
    model: torch.nn.Module, input_shape: Sequence[int], num_classes: int, batch_size: int, *, threads: int = 1
) -> float:
    """Seconds per sample-step of ``model`` on this machine's CPU with ``threads`` torch threads (as the simulator's
    clients train): the fastest of 7 timed SGD steps on a random batch of ``batch_size`` (after 3 untimed ones),
    divided by the batch size. The fastest, not the mean: on a shared machine the others include waiting for a core."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((batch_size, *input_shape), generator=gen)  # (B, *input_shape)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen)  # (B,)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the timing, not the weights, is wanted
    model.train()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for i in range(10):
            started = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= 3:
                times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return min(times) / batch_size


def load_profiles(
    config: RunConfig, clients: Sequence[ClientId], measure: Any
) -> tuple[dict[ClientId, ClientProfile], dict[str, Any]]:
    """Every client's profile for ``config`` (a profiles file read from disk), and what the summary says of them.

    ``measure``: a callable returning the seconds per sample-step measured here, called only when needed."""
    spec = parse_profiles(config.client_profiles or "uniform")
    link = parse_link(config.link or DEFAULT_LINK)
    text = ""
    if spec.kind == "file":
        path = Path(spec.path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"--client-profiles {spec.path}: cannot read it ({exc.strerror})") from None
    fmt = "json" if spec.path.lower().endswith(".json") else "csv"
    reference = spec.reference_s()
    measured = reference is None and (spec.kind != "file" or file_needs_reference(text, fmt))
    if measured:
        reference = float(measure())
        log.info("reference compute measured on this machine: %.3g s per sample-step", reference)
    if spec.kind == "file":
        profiles = read_profiles(text, fmt, clients, link, reference)
    else:
        assert reference is not None
        profiles = generate_profiles(spec, clients, link, reference, config.seed)
    about = {
        "client_profiles": config.client_profiles or "uniform",
        "link": config.link or DEFAULT_LINK,
        "link_figures": link.describe(),
        "reference_compute_s": reference,
        "reference_compute": "measured on this machine" if measured else "given",
        "deadline_s": config.sim_deadline,
    }
    return profiles, about


class SimClockTransport:
    """``inner`` with a simulated clock (see the module); ``samples``: each client's training-set size."""

    def __init__(
        self,
        inner: Transport,
        profiles: Mapping[ClientId, ClientProfile],
        samples: Mapping[ClientId, int],
        local_epochs: int,
        *,
        deadline_s: float = 0.0,
    ) -> None:
        self.inner = inner
        self.profiles, self.samples, self.local_epochs = dict(profiles), dict(samples), local_epochs
        self.deadline_s = deadline_s
        self.clock_s = 0.0  # at the end of the last exchanged round
        self.times: dict[int, RoundTime] = {}
        self._clock_after: dict[int, float] = {}
        self._wait_s = 0.0
        self._round = 1  # the engine exchanges once a round, in order

    def resume_at(self, records: Sequence[RoundRecord]) -> None:
        """Continue the clock of a resumed run from its last recorded round."""
        if records:
            self.clock_s = float(records[-1].metrics.get(SIM_CLOCK, 0.0))
            self._round = records[-1].round + 1

    def available_clients(self) -> Sequence[ClientId]:
        offered = list(self.inner.available_clients())
        start = min((self.profiles[c].availability.next_on(self.clock_s) for c in offered), default=self.clock_s)
        if start == float("inf"):
            raise ConfigError(f"no client is ever available again after {self.clock_s:g} simulated seconds")
        self._wait_s = start - self.clock_s  # none available now: the coordinator waits for the first one
        return [c for c in offered if self.profiles[c].availability.available(start)]

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = self.inner.exchange(plan, check)
        rnd, self._round = self._round, self._round + 1
        assert all(t.round == rnd for t in plan.tasks.values()), f"round {rnd}'s plan holds another round's task"
        timed = round_time(
            rnd,
            out.entries,
            out.replies,
            self.profiles,
            self.samples,
            self.local_epochs,
            deadline_s=self.deadline_s,
            wait_s=self._wait_s,
        )
        for client in timed.late:
            out.replies.pop(client)
            took = next(t.total_s for t in timed.clients if t.client == client)
            out.drops.append(Drop(client, f"{DEADLINE_REASON}: {took:.3g} s > {self.deadline_s:g} s", self.deadline_s))
        self.times[rnd] = timed
        self.clock_s += timed.seconds
        self._clock_after[rnd] = self.clock_s
        return out

    def stamp(self, record: RoundRecord) -> RoundRecord:
        """``record`` with its round's ``sim_time_s`` and the cumulative ``sim_clock_s``."""
        timed = self.times[record.round]
        clock = self._clock_after[record.round]
        return dataclasses.replace(record, metrics={**record.metrics, SIM_TIME: timed.seconds, SIM_CLOCK: clock})


def time_summary(
    rounds: Sequence[RoundRecord], thresholds: Sequence[float], about: Mapping[str, Any]
) -> dict[str, Any]:
    """summary.json's ``time_to`` (simulated seconds to each accuracy, keyed as ``comu_at``) and ``sim_clock``."""
    evaluated = [r for r in rounds if r.accuracy is not None and SIM_CLOCK in r.metrics]
    acc = [float(r.accuracy) for r in evaluated if r.accuracy is not None]
    clock = [float(r.metrics[SIM_CLOCK]) for r in evaluated]
    total = next((float(r.metrics[SIM_CLOCK]) for r in reversed(rounds) if SIM_CLOCK in r.metrics), 0.0)
    return {
        "time_to": {f"{t:g}": time_to(acc, clock, t) for t in thresholds},
        "sim_clock": {**about, "total_s": total},
    }
