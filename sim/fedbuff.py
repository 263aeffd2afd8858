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
received and its own seed); only its arrival waits for the clock. Over MQTT (not built) arrivals would be real.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.engine import RoundEngine, _Played, sample_clients
from coordinator.transport import Exchange, Transport
from fedge.accounting.ledger import LedgerEntry
from fedge.accounting.records import ClientTiming, Drop, Rejection
from fedge.accounting.sim_clock import client_time
from fedge.aggregation.fedbuff import BufferedUpdate, ServerLearningRate, ServerStep, StalenessWeight, buffered_delta
from fedge.algorithms.base import (
    CheckedReply,
    Evaluation,
    RoundPlan,
    ServerContext,
    Strategy,
    StrategyState,
    TensorSpec,
    UpdateReport,
)
from fedge.algorithms.fedavg import FedAvg
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.profiles import ClientProfile
from fedge.registry import ALGORITHMS, get_algorithm
from fedge.types import ClientId, StateDict
from fedge.wire.message import UPDATE, Message

log = logging.getLogger(__name__)

_OWN = "fedbuff/"  # this wrapper's tensors in the strategy state; the wrapped strategy's keep their names


def check_algorithm(config: RunConfig) -> None:
    """ConfigError unless ``config.algorithm``'s server half is FedAvg's mean of the returned weights followed by a
    server optimizer (FedAvg's plain one, or FedAdam's): the only aggregation FedBuff's buffered step (a mean of
    moves, then the server optimizer's step) stands in for."""
    spec = get_algorithm(config.algorithm)
    if _steps_from_a_mean(spec.server):
        if spec.server is not FedAvg and config.server_lr != 1.0:
            raise ConfigError(
                f"--aggregation fedbuff --algorithm {config.algorithm}: the server step is its server optimizer's "
                f"(--server-opt-lr sets its step size); leave --server-lr at 1, not {config.server_lr:g}"
            )
        return
    family = ", ".join(name for name, a in ALGORITHMS.items() if _steps_from_a_mean(a.server))
    why = spec.secagg_gap or "its server does more than average the returned weights"
    raise ConfigError(
        f"--aggregation fedbuff cannot run --algorithm {config.algorithm}: {why}. FedBuff steps from a buffer of "
        f"returned weights; it runs {family}"
    )


# What a server half may override and still be FedAvg's mean of the returned weights and a server optimizer's step.
_FEDAVG_ROUND = ("aggregate", "server_step", "configure", "check_reply", "reply_tensors", "state", "load_state")


def _steps_from_a_mean(server: type[Strategy[Any]]) -> bool:
    return issubclass(server, FedAvg) and all(getattr(server, m) is getattr(FedAvg, m) for m in _FEDAVG_ROUND)


@dataclass
class InFlight:
    """A dispatched task: its client trained already (the simulator computes at dispatch), its result arrives at
    ``finish_s`` on the clock. ``update`` is None when the client failed or its reply was refused (``drops``,
    ``rejections``)."""

    seq: int  # dispatch order: breaks ties on the clock
    client: ClientId
    base_version: int
    dispatch_s: float
    finish_s: float
    update: BufferedUpdate | None
    up: tuple[LedgerEntry, ...]  # its reply's ledger entries, counted when it arrives
    timing: ClientTiming | None = None
    drops: tuple[Drop, ...] = ()
    rejections: tuple[Rejection, ...] = ()


@dataclass
class BufferState:
    """Everything FedBuff keeps between server steps besides the global model."""

    version: int = 0  # server steps taken
    clock_s: float = 0.0  # the simulated clock now
    step_started_s: float = 0.0  # the clock at the previous server step
    groups: int = 0  # dispatch groups so far: each samples its clients with its own seed
    seq: int = 0  # tasks dispatched so far
    trained_on_version: set[ClientId] = field(default_factory=set)  # clients dispatched at the current version
    buffer: list[BufferedUpdate] = field(default_factory=list)
    in_flight: list[InFlight] = field(default_factory=list)
    dropped_stale: int = 0  # updates dropped for their age since the previous step
    dropped_stale_total: int = 0

    def state(self) -> StrategyState:
        """(tensors, JSON-able values) for the run journal; :meth:`restore` reads them back."""
        tensors: dict[str, torch.Tensor] = {}
        for i, u in enumerate(self.buffer):
            tensors.update({f"{_OWN}buffer/{i}/{k}": v for k, v in u.delta.items()})
        for t in self.in_flight:
            if t.update is not None:
                tensors.update({f"{_OWN}in_flight/{t.seq}/{k}": v for k, v in t.update.delta.items()})
        values = {
            "version": self.version,
            "clock_s": self.clock_s,
            "step_started_s": self.step_started_s,
            "groups": self.groups,
            "seq": self.seq,
            "trained_on_version": sorted(self.trained_on_version),
            "dropped_stale": self.dropped_stale,
            "dropped_stale_total": self.dropped_stale_total,
            "buffer": [_update_values(u) for u in self.buffer],
            "in_flight": [
                {
                    "seq": t.seq,
                    "client": t.client,
                    "base_version": t.base_version,
                    "dispatch_s": t.dispatch_s,
                    "finish_s": t.finish_s,
                    "update": None if t.update is None else _update_values(t.update),
                    "up": [dataclasses.asdict(e) for e in t.up],
                    "timing": None if t.timing is None else dataclasses.asdict(t.timing),
                    "drops": [dataclasses.asdict(d) for d in t.drops],
                    "rejections": [dataclasses.asdict(r) for r in t.rejections],
                }
                for t in self.in_flight
            ],
        }
        return tensors, values

    @classmethod
    def restore(
        cls, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any], like: Mapping[str, torch.Tensor]
    ) -> BufferState:
        """The state :meth:`state` saved; ``like``: the model's tensors, which every saved move must match."""
        try:
            buffer = [
                _update_of(v, _moves(tensors, f"{_OWN}buffer/{i}/", like)) for i, v in enumerate(values["buffer"])
            ]
            in_flight = [
                InFlight(
                    seq=int(t["seq"]),
                    client=str(t["client"]),
                    base_version=int(t["base_version"]),
                    dispatch_s=float(t["dispatch_s"]),
                    finish_s=float(t["finish_s"]),
                    update=None
                    if t["update"] is None
                    else _update_of(t["update"], _moves(tensors, f"{_OWN}in_flight/{t['seq']}/", like)),
                    up=tuple(LedgerEntry(**e) for e in t["up"]),
                    timing=None if t["timing"] is None else ClientTiming(**t["timing"]),
                    drops=tuple(Drop(**d) for d in t["drops"]),
                    rejections=tuple(Rejection(**r) for r in t["rejections"]),
                )
                for t in values["in_flight"]
            ]
            return cls(
                version=int(values["version"]),
                clock_s=float(values["clock_s"]),
                step_started_s=float(values["step_started_s"]),
                groups=int(values["groups"]),
                seq=int(values["seq"]),
                trained_on_version={str(c) for c in values["trained_on_version"]},
                buffer=buffer,
                in_flight=in_flight,
                dropped_stale=int(values["dropped_stale"]),
                dropped_stale_total=int(values["dropped_stale_total"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the saved FedBuff state is malformed ({type(exc).__name__}: {exc})") from None


def _update_values(u: BufferedUpdate) -> dict[str, Any]:
    return {"client": u.client, "base_version": u.base_version, "weight": u.weight, "loss": u.loss}


def _update_of(values: Mapping[str, Any], delta: StateDict) -> BufferedUpdate:
    loss = values["loss"]
    return BufferedUpdate(
        str(values["client"]),
        int(values["base_version"]),
        float(values["weight"]),
        delta,
        None if loss is None else float(loss),
    )


def _moves(tensors: Mapping[str, torch.Tensor], prefix: str, like: Mapping[str, torch.Tensor]) -> StateDict:
    out: StateDict = {}
    for name, ref in like.items():
        t = tensors.get(prefix + name)
        if t is None or t.shape != ref.shape:
            raise ValueError(f"saved move {prefix + name!r} is missing or has another shape")
        out[name] = t
    return out


class BufferedFedAvg(Strategy[Any]):
    """A FedAvg-family server half whose global model moves by FedBuff's buffered step instead of a round's average.

    Plans, checks and evaluates by delegation to the wrapped strategy; :meth:`aggregate` takes the server step from
    :attr:`buffer` (the replies handed to it are the record's view, one per client; the buffer may hold two updates of
    one client, trained on different versions). ``server_step``: what turns the mean update into the averaged weights
    (the server learning rate), from which the wrapped strategy's server optimizer steps (:meth:`FedAvg.apply_average`:
    the average itself for FedAvg, Adam's step for FedAdam)."""

    def __init__(self, inner: FedAvg[Any], weight: StalenessWeight, server_step: ServerStep) -> None:
        super().__init__(
            inner.config,
            ServerContext(
                inner.model_factory,
                inner.num_classes,
                run_id=inner.run_id,
                evaluation_device=inner.evaluation_device,
            ),
        )
        self.inner, self.weight, self.server_step = inner, weight, server_step
        self.buffer = BufferState()

    # --- delegated -----------------------------------------------------------------------------------------------
    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        return self.inner.configure(rnd, clients)

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        return self.inner.accept(rnd, client, reply)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        return self.inner.evaluate(x, y)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return self.inner.reply_tensors()

    def global_weights(self) -> StateDict:
        return self.inner.global_weights()

    def stop_before(self, rnd: int) -> str:
        return self.inner.stop_before(rnd)

    def averaging_weight(self, reply: CheckedReply) -> float:
        """``n_i``: the reply's share of the mean as the wrapped FedAvg weighs it (data size, or 1 when uniform)."""
        return self.inner.averaging_weights([reply])[0]

    # --- the server step -----------------------------------------------------------------------------------------
    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """Server step ``rnd`` from the buffer (see the class): the new global model is version ``rnd``."""
        st = self.buffer
        updates, version = st.buffer, st.version
        assert version == rnd - 1, f"server step {rnd} taken at version {version}"
        delta = buffered_delta(updates, version, self.weight)
        # The buffer's step gives the average; the wrapped strategy's server optimizer (FedAdam's) takes it from there.
        self.inner.apply_average(self.server_step(self.inner.global_weights(), delta))
        ages = [version - u.base_version for u in updates]
        losses = [u.loss for u in updates if u.loss is not None]
        st.version, st.buffer, st.trained_on_version = version + 1, [], set()
        return {
            "fedbuff_version": float(st.version),
            "buffer_fill": float(len(updates)),
            "staleness_mean": statistics.fmean(ages),
            "staleness_max": float(max(ages)),
            **({"mean_local_loss": sum(losses) / len(losses)} if losses else {}),
        }

    def state(self) -> StrategyState:
        tensors, values = self.inner.state()
        own_tensors, own_values = self.buffer.state()
        return {**tensors, **own_tensors}, {"inner": values, "fedbuff": own_values}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        if not isinstance(values.get("inner"), dict) or not isinstance(values.get("fedbuff"), dict):
            raise ConfigError("the saved state is not a FedBuff run's (no buffer saved): resume it without fedbuff")
        self.inner.load_state({k: v for k, v in tensors.items() if not k.startswith(_OWN)}, values["inner"])
        self.buffer = BufferState.restore(tensors, values["fedbuff"], self.inner.global_weights())


class FedBuffEngine(RoundEngine):
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

    def _aggregate(self, played: _Played) -> _Played:
        """Count the step's messages and take the server step (its quorum is the buffer: K updates, always there)."""
        self.history.ledger.extend(played.exchange.entries)
        played.quorum, played.aggregated = self.buffer_size, True
        played.metrics = {**self.strategy.aggregate(played.round, played.exchange.replies), **played.metrics}
        played.round_bytes = self.history.ledger.round_bytes(played.round)
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
    check_algorithm(config)
    if not isinstance(strategy, FedAvg):  # a wrapper (compression, secure aggregation): refused by the config
        raise ConfigError(f"--aggregation fedbuff needs the plain FedAvg server half, got {type(strategy).__name__}")
    buffered = BufferedFedAvg(
        strategy, StalenessWeight.parse(config.staleness_weight), ServerLearningRate(config.server_lr)
    )
    return FedBuffEngine(
        config, buffered, transport, test_x, test_y, profiles=profiles, samples=samples, initial_bytes=initial_bytes
    )


def fedbuff_summary(config: RunConfig, engine: FedBuffEngine) -> dict[str, Any]:
    """summary.json's ``fedbuff``: the settings as resolved and what the run's buffer did."""
    st = engine.buffered.buffer
    return {
        "fedbuff": {
            "buffer_size": config.fedbuff_buffer_size,
            "concurrency": config.fedbuff_concurrency,
            "max_staleness": config.max_staleness,
            "staleness_weight": config.staleness_weight,
            "server_lr": config.server_lr,
            "normalisation": "sum_i weight(s_i) n_i delta_i / sum_i n_i (FedBuff Algorithm 1: divided by the buffer)",
            "versions": st.version,
            "dispatched": st.seq,
            "dropped_stale": st.dropped_stale_total,
            "in_flight_at_end": len(st.in_flight),
        }
    }
