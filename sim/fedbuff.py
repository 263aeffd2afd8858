"""FedBuff in ``fedge sim --aggregation fedbuff`` (Nguyen et al., AISTATS 2022; docs/simulated_time.md): buffered
asynchronous aggregation, event-driven on the simulated clock.

Up to ``concurrency`` clients train at once, each on the model version it received when its task was dispatched.
A client's update arrives at dispatch time + its simulated time (:func:`fedge.accounting.sim_clock.client_time`: the
transfers the ledger counts, its compute, latency per message); updates more than ``max_staleness`` versions old are
dropped on arrival; the K-th buffered update triggers a server step (:mod:`fedge.aggregation.fedbuff`). A free slot
is refilled at once by sampling an idle client that is available on the clock and has not trained on the current
version yet (so no update is counted twice; each (version, client) has its own shuffle seed). Ties on the clock go
by dispatch order: a run is deterministic in its seed (given a fixed reference compute).

A "round" of the round engine is one server step: ``--rounds`` counts steps, each step's record holds what happened
on the clock since the previous one (the transfers, with a reply's bytes counted when it arrives; the arrivals; the
drops), then the step and its evaluation. The step's state, buffer, version counter, clock and the in-flight tasks
with their computed updates, is part of the strategy's state (:meth:`BufferedFedAvg.state`), so the run journal keeps
it and a resumed run continues as the uninterrupted one would have.

In the simulator a client's training runs when its task is dispatched (its result depends only on the version it
received and its own seed); only its arrival waits for the clock. The server half (the buffered strategy, its state,
the step) is :mod:`coordinator.fedbuff`, which the MQTT coordinator (:mod:`coordinator.mqtt_fedbuff`) runs on the
real clock.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from coordinator.engine import _Played, sample_clients
from coordinator.fedbuff import BufferedEngine, BufferedFedAvg, BufferState, InFlight, buffered_strategy
from coordinator.fedbuff import fedbuff_summary as shared_summary
from coordinator.transport import Exchange, Transport
from fedge.accounting.records import Drop
from fedge.accounting.sim_clock import client_time
from fedge.aggregation.fedbuff import BufferedUpdate
from fedge.algorithms.base import CheckedReply, Strategy, UpdateReport
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import ClientProfile
from fedge.types import ClientId
from fedge.wire.message import UPDATE, Message

log = logging.getLogger(__name__)


class FedBuffEngine(BufferedEngine):
    """The round engine whose rounds are FedBuff's server steps, played on the simulated clock (see the module)."""

    def __init__(
        self,
        config: RunConfig,
        strategy: BufferedFedAvg,
        transport: Transport,
        test_x: torch.Tensor,
        test_y: torch.Tensor,
        *,
        profiles: Mapping[ClientId, ClientProfile],
        samples: Mapping[ClientId, int],
        initial_bytes: dict[str, int] | None = None,
    ) -> None:
        super().__init__(config, strategy, transport, test_x, test_y, initial_bytes=initial_bytes)
        self.buffered = strategy
        self.profiles, self.samples = dict(profiles), dict(samples)
        self.clients = sorted(transport.available_clients())
        self.buffer_size = config.fedbuff_buffer_size
        self.concurrency = config.fedbuff_concurrency
        self.max_staleness = config.max_staleness

    def _exchange(self, rnd: int) -> _Played:
        """Play the clock until the buffer holds K updates: dispatch to free slots, take arrivals in time order."""
        started = time.perf_counter()
        st = self.buffered.buffer
        out = Exchange()
        arrived: list[ClientId] = []
        dispatched = 0
        while len(st.buffer) < self.buffer_size:
            dispatched += self._dispatch(rnd, out)
            task = min(st.in_flight, key=lambda t: (t.finish_s, t.seq), default=None)
            wake = self._next_available()
            if task is None and wake == math.inf:
                if not self._idle(st):  # every client trained on this version; too many of them failed
                    raise ConfigError(
                        f"server step {rnd}: every client trained on version {st.version}, and only "
                        f"{len(st.buffer)} of the {self.buffer_size} updates the step needs were valid (see the "
                        "drops and rejections in metrics.jsonl); lower --buffer-size"
                    )
                raise ConfigError(f"no client is ever available again after {st.clock_s:g} simulated seconds")
            if task is None or wake < task.finish_s:
                st.clock_s = wake  # a client comes on before the next arrival: fill the free slot then
                continue
            st.in_flight.remove(task)
            st.clock_s = task.finish_s
            arrived.append(task.client)
            self._arrive(rnd, task, out)
        played = _Played(rnd, started, time.perf_counter(), sorted(set(arrived)), out)
        played.metrics = {
            "dispatched": float(dispatched),
            "in_flight": float(len(st.in_flight)),
            "dropped_stale": float(st.dropped_stale),
            "sim_time_s": st.clock_s - st.step_started_s,
            "sim_clock_s": st.clock_s,
        }
        st.dropped_stale, st.step_started_s = 0, st.clock_s
        return played

    def _idle(self, st: BufferState) -> list[ClientId]:
        """Clients that may take a task now, bar availability: not training, not trained on this version yet."""
        busy = {t.client for t in st.in_flight} | st.trained_on_version
        return [c for c in self.clients if c not in busy]

    def _next_available(self) -> float:
        """When an idle client next comes on, if a slot is free (inf: no slot, or none ever comes on)."""
        st = self.buffered.buffer
        if len(st.in_flight) >= self.concurrency:
            return math.inf
        return min((self.profiles[c].availability.next_on(st.clock_s) for c in self._idle(st)), default=math.inf)

    def _dispatch(self, rnd: int, out: Exchange) -> int:
        """Fill the free slots with idle clients available now, sampled by (seed, dispatch group); train them on the
        current version and put their results in flight. How many were dispatched."""
        st = self.buffered.buffer
        free = self.concurrency - len(st.in_flight)
        idle = [c for c in self._idle(st) if self.profiles[c].availability.available(st.clock_s)]
        if free <= 0 or not idle:
            return 0
        st.groups += 1  # group 1 samples as a synchronous run's round 1 does: one version, the same cohort
        chosen = sample_clients(idle, free, self.config.seed, st.groups)
        base = self.buffered.global_weights()
        plan = self.strategy.configure(rnd, chosen)
        ex = self.transport.exchange(plan, lambda c, m: self.strategy.accept(rnd, c, m))
        out.entries.extend(e for e in ex.entries if e.direction == "down")
        for client in chosen:
            took = client_time(
                client, ex.entries, self.profiles[client], self.samples[client], self.config.train.local_epochs
            )
            reply = ex.replies.get(client)
            update = None
            if reply is not None:
                delta = {k: reply.update.tensors[k] - v for k, v in base.items()}
                update = BufferedUpdate(client, st.version, self.buffered.averaging_weight(reply), delta,
                                        reply.report.loss)  # fmt: skip
            st.in_flight.append(
                InFlight(
                    seq=st.seq,
                    client=client,
                    base_version=st.version,
                    dispatch_s=st.clock_s,
                    finish_s=st.clock_s + took.total_s,
                    update=update,
                    up=tuple(e for e in ex.entries if e.direction == "up" and e.client == client),
                    timing=next((t for t in ex.timings if t.client == client), None),
                    drops=tuple(d for d in ex.drops if d.client == client),
                    rejections=tuple(r for r in ex.rejections if r.client == client),
                )
            )
            st.seq += 1
            st.trained_on_version.add(client)
        return len(chosen)

    def _arrive(self, rnd: int, task: InFlight, out: Exchange) -> None:
        """``task``'s reply reaches the server now: count its bytes in this step, then buffer it, or drop it (failed,
        refused, or older than ``max_staleness`` versions)."""
        st = self.buffered.buffer
        out.entries.extend(dataclasses.replace(e, round=rnd) for e in task.up)
        if task.update is None:
            out.drops.extend(task.drops)
            out.rejections.extend(task.rejections)
            return
        age = st.version - task.base_version
        if self.max_staleness is not None and age > self.max_staleness:
            st.dropped_stale += 1
            st.dropped_stale_total += 1
            reason = (
                f"stale: trained on version {task.base_version}, {age} steps old > --max-staleness {self.max_staleness}"
            )
            log.info("client %s: %s", task.client, reason)
            out.drops.append(Drop(task.client, reason, task.finish_s - task.dispatch_s))
            return
        st.buffer.append(task.update)
        if task.timing is not None:
            out.timings.append(task.timing)
        report = UpdateReport(num_examples=int(task.update.weight), loss=task.update.loss)
        out.replies[task.client] = CheckedReply(report, Message(UPDATE, rnd, client=task.client))


def fedbuff_engine(
    config: RunConfig,
    strategy: Strategy[Any],
    transport: Transport,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    *,
    profiles: Mapping[ClientId, ClientProfile],
    samples: Mapping[ClientId, int],
    initial_bytes: dict[str, int] | None = None,
) -> FedBuffEngine:
    """The engine of a ``--aggregation fedbuff`` run of ``strategy`` (a FedAvg-family server half) over ``transport``
    (the in-process one, without a clock of its own: the engine keeps it)."""
    buffered = buffered_strategy(config, strategy)
    return FedBuffEngine(
        config, buffered, transport, test_x, test_y, profiles=profiles, samples=samples, initial_bytes=initial_bytes
    )


def fedbuff_summary(config: RunConfig, engine: FedBuffEngine) -> dict[str, Any]:
    """summary.json's ``fedbuff``: the settings as resolved and what the run's buffer did."""
    return shared_summary(config, engine.buffered, len(engine.buffered.buffer.in_flight))
