"""The ``batched`` executor: a round's clients in this process, their local training run together as one stacked
model (:mod:`sim.executors.stacked`), on the clients' device (a GPU: a round is a few large kernels).

Every client still runs its algorithm's own client step (decoding, objective, report, compression), each in a
thread of its own, on a :class:`StackedBackend` that defers the heavy calls: a client that calls ``train`` or
``logits`` waits, and when every client of the round waits or is done, the executor serves all waiting calls at
once: trainings with the same loss and settings in one :func:`~sim.executors.stacked.train_stacked`, inference with
the same weights (FedNTD's teacher: the broadcast global model, the same for all) in one forward pass over all the
clients' samples. The threads only ever wait or run Python glue; the compute is the main thread's.

What the stacked training cannot do exactly (batch norm, dropout, augmentation, MOON, FedCurv) is refused: the
round's clients get an error reply and :meth:`BatchedExecutor.run` raises :class:`ExecutorError` with a one-line
reason naming the executors that can run it.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.errors import ConfigError
from fedge.learning.backend import TorchBackend
from fedge.learning.models import load_exchanged_state
from fedge.learning.training import TrainRequest, TrainStats, predict_logits
from fedge.types import ClientId, StateDict
from fedge.wire.message import Message
from sim.executors.core import (
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorError,
    SimClient,
    check_unique,
)
from sim.executors.host import LocalExecutor
from sim.executors.stacked import INSTEAD, BatchedRefusal, group_key, train_stacked


@dataclass(eq=False)
class _Call:
    """One deferred ``train`` or ``logits`` call of a client thread, and its answer."""

    kind: str  # "train" | "logits"
    weights: StateDict
    payload: Any  # the TrainRequest, or the inputs to compute logits of
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class _Round:
    """The rendezvous of one round's client threads with the executor's main thread."""

    def __init__(self, threads: int) -> None:
        self._cond = threading.Condition()
        self._alive = threads  # threads not finished
        self._running = threads  # threads neither finished nor waiting on a call
        self._pending: list[_Call] = []

    def call(self, call: _Call) -> Any:
        """From a client thread: hand ``call`` over and wait for its answer."""
        with self._cond:
            self._pending.append(call)
            self._running -= 1
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def finished(self) -> None:
        """From a client thread: this client's step is over."""
        with self._cond:
            self._alive -= 1
            self._running -= 1
            self._cond.notify_all()

    def next_calls(self) -> list[_Call] | None:
        """From the main thread: the calls waiting once no thread runs, or None when every thread has finished."""
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0)
            if not self._pending:
                return None if self._alive == 0 else []
            calls, self._pending = self._pending, []
            self._running += len(calls)  # woken below; counted as running before any of them can finish
            return calls


class StackedBackend:
    """One client's view of a round's shared PyTorch backend: its own weights; ``train`` and ``logits`` deferred to
    the executor, which answers every client's calls at once."""

    runtime = "torch"

    def __init__(self, base: TorchBackend, shapes: Mapping[str, tuple[int, ...]], rendezvous: _Round) -> None:
        self._base = base
        self._shapes = shapes  # of the exchanged state, to check what set_weights gets
        self._round = rendezvous
        self._weights: StateDict | None = None

    def set_weights(self, state: StateDict) -> None:
        if (
            set(state) != set(self._shapes)
            or any(tuple(state[k].shape) != s for k, s in self._shapes.items())
            or not all(isinstance(v, torch.Tensor) and torch.is_floating_point(v) for v in state.values())
        ):
            load_exchanged_state(copy.deepcopy(self._base.model), state)  # raises the usual ConfigError
        self._weights = dict(state)

    def get_weights(self) -> StateDict:
        if self._weights is None:
            return self._base.get_weights()
        return {k: v.detach().clone().cpu() for k, v in self._weights.items()}

    def init_weights(self, seed: int) -> StateDict:
        return self._base.init_weights(seed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self._round.call(_Call("logits", self._current(), x))
        return result

    def train(self, request: TrainRequest) -> TrainStats:
        weights, stats = self._round.call(_Call("train", self._current(), request))
        self._weights = weights
        return stats

    def _current(self) -> StateDict:
        if self._weights is None:
            self._weights = self._base.get_weights()
        return self._weights


class _DeferringClient:
    """A client whose steps run on a :class:`StackedBackend` of the executor's current round."""

    def __init__(self, inner: SimClient, executor: BatchedExecutor) -> None:
        base = getattr(inner, "backend", None)
        if not isinstance(base, TorchBackend):
            raise ConfigError(f"the batched executor runs PyTorch clients only, not {type(base).__name__}; {INSTEAD}")
        self.inner, self.base, self._executor = inner, base, executor
        self.shapes = {k: tuple(v.shape) for k, v in base.get_weights().items()}

    @property
    def client_id(self) -> ClientId:
        return self.inner.client_id

    @property
    def store(self) -> MutableMapping[str, Any]:
        return self.inner.store

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        backend = StackedBackend(self.base, self.shapes, self._executor.current_round())
        return self.inner.handle(task, broadcast, backend)  # type: ignore[call-arg]


class BatchedExecutor(LocalExecutor):
    """A round's clients in this process, their local training stacked into one model (see the module's doc)."""

    name = "batched"

    def __init__(
        self,
        factory: ClientFactory | None = None,
        *,
        clients: Mapping[ClientId, SimClient] | Iterable[SimClient] | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        super().__init__(factory, clients=clients, threads_per_worker=threads_per_worker)
        self._round: _Round | None = None
        self._scratch: dict[int, torch.nn.Module] = {}  # per base backend: its architecture, for the stacked calls
        self._resident: dict[int, torch.Tensor] = {}  # id of a client's data tensor -> its copy on the device

    def _build(self, client_id: ClientId) -> SimClient:
        return _DeferringClient(self._client(client_id), self)

    def current_round(self) -> _Round:
        if self._round is None:
            raise RuntimeError("a batched client stepped outside its executor's round")
        return self._round

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        check_unique(jobs)
        self._batch += 1
        if self._factory is not None and self._builder is None and any(j.client_id not in self._given for j in jobs):
            self._builder = self._factory()  # once, here: not raced by the client threads
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        results: list[ClientResult | None] = [None] * len(jobs)
        refusals: list[str] = []
        self._round = rendezvous = _Round(len(jobs))

        def work(i: int, job: ClientJob) -> None:
            try:
                results[i] = self._host.run(job, (self._batch, id(job.broadcast)))[0]
            finally:
                rendezvous.finished()

        threads = [threading.Thread(target=work, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
        try:
            for t in threads:
                t.start()
            while (calls := rendezvous.next_calls()) is not None:
                self._serve(calls, refusals)
            for t in threads:
                t.join()
        finally:
            self._round = None
            torch.set_num_threads(previous)
        if refusals:
            raise ExecutorError(refusals[0])
        return [r for r in results if r is not None]

    def _serve(self, calls: list[_Call], refusals: list[str]) -> None:
        """Answer every waiting call: trainings by group, logits by weights, then wake their threads."""
        try:
            trainings: dict[tuple[object, ...], list[_Call]] = {}
            inferences: dict[tuple[int, ...], list[_Call]] = {}
            for c in calls:
                if c.kind == "train":
                    trainings.setdefault(group_key(c.payload), []).append(c)
                else:  # the same weight tensors (one decoded broadcast): one forward pass for all of them
                    inferences.setdefault(tuple(id(v) for v in c.weights.values()), []).append(c)
            groups = [(self._train, g) for g in trainings.values()]
            groups += [(self._logits, g) for g in inferences.values()]
            for serve, group in groups:
                try:
                    serve(group)
                except BatchedRefusal as exc:
                    refusals.append(str(exc))
                    for c in group:
                        c.error = exc
                except Exception as exc:  # answered to each client: its step fails as it would have alone
                    for c in group:
                        c.error = exc
        except Exception as exc:  # a call that cannot even be grouped fails its clients, never leaves them waiting
            for c in calls:
                c.error = c.error or exc
        finally:
            for c in calls:
                c.done.set()

    def _model(self) -> tuple[torch.nn.Module, torch.device]:
        client = next(iter(self._host.clients.values()))
        assert isinstance(client, _DeferringClient)
        base = client.base
        if id(base) not in self._scratch:
            model = copy.deepcopy(base.model).to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
            self._scratch[id(base)] = model
        return self._scratch[id(base)], base.device

    def resident(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``x`` on ``device``, copied once for as long as ``x`` lives: a client's data (the same tensor every round)
        stays on the GPU, and leaves it with the client's tensor."""
        if x.device == device:
            return x
        key = id(x)
        if key not in self._resident:
            self._resident[key] = x.to(device)
            weakref.finalize(x, self._resident.pop, key, None)
        return self._resident[key]

    def _train(self, group: list[_Call]) -> None:
        model, device = self._model()
        weights, requests = [c.weights for c in group], [c.payload for c in group]
        answers = train_stacked(model, weights, requests, device, lambda t: self.resident(t, device))
        for c, answer in zip(group, answers, strict=True):
            c.result = answer

    def _logits(self, group: list[_Call]) -> None:
        model, _ = self._model()
        load_exchanged_state(model, group[0].weights)
        out = predict_logits(model, torch.cat([c.payload for c in group]))
        for c, part in zip(group, out.split([len(c.payload) for c in group]), strict=True):
            c.result = part
