"""FedBuff's server half, shared by the simulator (``sim/fedbuff.py``, on the simulated clock) and the MQTT coordinator
(:mod:`coordinator.mqtt_fedbuff`, on the real one): the strategy wrapper whose global model moves by the buffered step
(:mod:`fedge.aggregation.fedbuff`, Nguyen et al., AISTATS 2022, Algorithm 1), the buffer state the run journal keeps,
the engine base whose rounds are server steps, and the summary.

A "round" of the round engine is one server step: ``--rounds`` counts steps. Version ``v`` is the global model after
``v`` steps; a task dispatched at version ``v`` carries round ``v + 1`` (the step it was dispatched in: version 0 goes
out as round 1, as a synchronous run's first broadcast does), and its reply's staleness when it is buffered is the
number of steps taken since.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.engine import RoundEngine, _Played
from fedge.accounting.ledger import LedgerEntry
from fedge.accounting.records import AggregationRecord, ClientTiming, Drop, Rejection
from fedge.aggregation.fedbuff import BufferedUpdate, ServerLearningRate, ServerStep, StalenessWeight, buffered_delta
from fedge.aggregation.robust import state_norm
from fedge.algorithms.base import (
    CheckedReply,
    Strategy,
    StrategyState,
)
from fedge.algorithms.catalog import ALGORITHMS, get_algorithm
from fedge.algorithms.fedavg import FedAvg
from fedge.algorithms.wrapping import WrappingStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.types import ClientId, StateDict
from fedge.wire.message import Message

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
    # Over MQTT (coordinator/mqtt_fedbuff.py): the record of the step under way so far (ledger entries, drops,
    # rejections, timings as JSON-able dicts), journaled with every accepted update so a resumed run counts them once.
    partial: dict[str, Any] = field(default_factory=dict)

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
            **({"partial": self.partial} if self.partial else {}),
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

    def move_group(self, name: str) -> str | None:
        """The buffered update a tensor of :meth:`state` belongs to (named by its position, version and client: what
        never changes while it is buffered), or None for any other tensor. The run journal writes each such group to a
        file of its own, once (:meth:`coordinator.resume.RunJournal.checkpoint`)."""
        parts = name.split("/", 3)
        if len(parts) < 4 or f"{parts[0]}/" != _OWN or parts[1] != "buffer" or not parts[2].isdigit():
            return None
        i = int(parts[2])
        if i >= len(self.buffer):
            return None
        u = self.buffer[i]
        return f"{i}/{u.base_version}/{u.client}"

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
                partial=dict(values.get("partial", {})),
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


class BufferedFedAvg(WrappingStrategy):
    """A FedAvg-family server half whose global model moves by FedBuff's buffered step instead of a round's average.

    Plans, checks and evaluates as the wrapped strategy (:class:`~fedge.algorithms.wrapping.WrappingStrategy`);
    :meth:`aggregate` takes the server step from :attr:`buffer` (the replies handed to it are the record's view, one per
    client; the buffer may hold two updates of one client, trained on different versions). ``server_step``: what turns
    the mean update into the averaged weights (the server learning rate), from which the wrapped strategy's server
    optimizer steps (:meth:`FedAvg.apply_average`: the average itself for FedAvg, Adam's step for FedAdam)."""

    inner: FedAvg[Any]

    def __init__(self, inner: FedAvg[Any], weight: StalenessWeight, server_step: ServerStep) -> None:
        super().__init__(inner, inner.config)
        self.weight, self.server_step = weight, server_step
        self.buffer = BufferState()
        self._drops: dict[int, tuple[Drop, ...]] = {}  # step -> the buffered updates it refused

    def accept_from(self, base: StateDict, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        """:meth:`accept` of a reply whose task sent ``base`` (:meth:`FedAvg.accept_from`)."""
        return self.inner.accept_from(base, rnd, client, reply)

    def global_weights(self) -> StateDict:
        return self.inner.global_weights()

    def averaging_weight(self, reply: CheckedReply) -> float:
        """``n_i``: the reply's share of the mean as the wrapped FedAvg weighs it (data size, or 1 when uniform)."""
        return self.inner.averaging_weights([reply])[0]

    # --- the server step -----------------------------------------------------------------------------------------
    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """Server step ``rnd`` from the buffer (see the class): the new global model is version ``rnd``."""
        st = self.buffer
        updates, version = st.buffer, st.version
        assert version == rnd - 1, f"server step {rnd} taken at version {version}"
        updates = self._calibrated(rnd, updates)
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

    def _calibrated(self, rnd: int, updates: list[BufferedUpdate]) -> list[BufferedUpdate]:
        """``updates`` less those that their task round's own median refuses, where that round was judged at arrival
        without an earlier round's median (version 0's): :meth:`FedAvg.calibrated`, which FedAvg's aggregate applies
        and this step bypasses. The refused become drops of step ``rnd`` (:meth:`aggregation_record`)."""
        refused: set[tuple[int, ClientId]] = set()
        drops: list[Drop] = []
        for task_round in sorted({u.base_version + 1 for u in updates}):
            norms = {u.client: state_norm(u.delta) for u in updates if u.base_version + 1 == task_round}
            for drop in self.inner.refused_moves(task_round, norms):
                refused.add((task_round, drop.client))
                drops.append(drop)
        if drops:
            self._drops[rnd] = tuple(drops)
        return [u for u in updates if (u.base_version + 1, u.client) not in refused]

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        """The buffered updates :meth:`aggregate` left out of step ``rnd`` (refused by the update bound), as drops."""
        return AggregationRecord(drops=self._drops.pop(rnd, ()))

    def state(self) -> StrategyState:
        tensors, values = self.inner.state()
        own_tensors, own_values = self.buffer.state()
        return {**tensors, **own_tensors}, {"inner": values, "fedbuff": own_values}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        if not isinstance(values.get("inner"), dict) or not isinstance(values.get("fedbuff"), dict):
            raise ConfigError("the saved state is not a FedBuff run's (no buffer saved): resume it without fedbuff")
        self.inner.load_state({k: v for k, v in tensors.items() if not k.startswith(_OWN)}, values["inner"])
        self.buffer = BufferState.restore(tensors, values["fedbuff"], self.inner.global_weights())


def buffered_strategy(config: RunConfig, strategy: Strategy[Any]) -> BufferedFedAvg:
    """``strategy`` (a FedAvg-family server half) wrapped for a ``--aggregation fedbuff`` run; ConfigError for one
    that FedBuff cannot step from a buffer."""
    check_algorithm(config)
    if not isinstance(strategy, FedAvg):  # a wrapper (compression, secure aggregation): refused by the config
        raise ConfigError(f"--aggregation fedbuff needs the plain FedAvg server half, got {type(strategy).__name__}")
    return BufferedFedAvg(
        strategy, StalenessWeight.parse(config.staleness_weight), ServerLearningRate(config.server_lr)
    )


class BufferedEngine(RoundEngine):
    """A round engine whose rounds are FedBuff's server steps; subclasses play the exchange until the buffer holds
    K updates (``sim/fedbuff.py`` on the simulated clock, :mod:`coordinator.mqtt_fedbuff` over a broker)."""

    buffered: BufferedFedAvg
    buffer_size: int

    def _aggregate(self, played: _Played) -> _Played:
        """Count the step's messages and take the server step (its quorum is the buffer: K updates, always there)."""
        self.history.ledger.extend(played.exchange.entries)
        played.quorum, played.aggregated = self.buffer_size, True
        played.metrics = {**self.strategy.aggregate(played.round, played.exchange.replies), **played.metrics}
        self._note_protocol(played)  # the buffered updates the step refused: drops, not replies
        played.round_bytes = self.history.ledger.round_bytes(played.round)
        return played


def fedbuff_summary(config: RunConfig, buffered: BufferedFedAvg, in_flight: int) -> dict[str, Any]:
    """summary.json's ``fedbuff``: the settings as resolved and what the run's buffer did (``in_flight``: tasks
    still out when the run ended)."""
    st = buffered.buffer
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
            "in_flight_at_end": in_flight,
        }
    }
