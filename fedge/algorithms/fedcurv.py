"""FedCurv (Shoham et al. 2019, "Overcoming Forgetting in Federated Learning on Non-IID Data"): FedAvg whose
local loss keeps each client near what the other clients learned, weighted by how much each weight mattered to them
(their diagonal Fisher information, as in elastic weight consolidation).

Client k's local loss in round t is

    CE(w) + lambda * sum_{j != k} (u_j . w^2 - 2 v_j . w)

with ``u_j`` the diagonal Fisher information of client j's last local model ``w_j`` and ``v_j = u_j * w_j``; up to a
constant this is ``lambda * sum_j (w - w_j)^T diag(u_j) (w - w_j)``. With ``P = sum_{j != k} u_j`` and
``Q = sum_{j != k} v_j`` it is one Fisher-weighted pull ``lambda * sum P * (w - Q/P)^2`` (a constant apart) to the
other clients' Fisher-weighted mean weights: the local term :class:`FisherProximal` with ``mu = 2 * lambda``,
``weights = P`` and ``anchor = Q / P`` (0 where P = 0), which every runtime evaluates (both tensors are inputs of the
exported programs). The Fisher pass after training is every runtime's own (the request's ``fisher_samples``).

Where the paper is vague, this follows the FedNTD authors' implementation (Lee-Gihun/FedNTD,
``algorithms/fedcurv``), whose Table 1 includes FedCurv:
- ``u_k`` is the empirical Fisher: the mean over mini-batches of the squared gradient of the batch-mean cross-entropy
  at the trained weights, over one shuffled pass that stops after the first batch taking the count past
  ``fisher_samples`` (500), in training mode (:func:`fedge.learning.training.fisher_diagonal`); over trainable
  parameters only;
- lambda = 1 and s = 500 Fisher samples (FedNTD Table 5, and the authors' config/fedcurv.json);
- the server keeps the latest ``(u_j, v_j)`` of every client it has heard from (not only this round's), and the sums
  run over all of them but k; in round 1 nothing is kept yet, so the term is zero (their code skips it).
Their server subtracts client k's own terms from the sums in place, so each later client of a round gets the sums
minus every earlier client's terms too (a tensor aliasing slip); fedge subtracts client k's own terms only.

Traffic: the server broadcasts the model plus ``U = sum_j u_j`` and ``V = sum_j v_j``, and each client subtracts its
own ``(u_k, v_k)`` that U and V hold, kept in its store, to get P and Q; each update carries the model plus
``(u_k, v_k)``. Both directions carry the model plus two values per trainable parameter, three times FedAvg's
parameters. Which of the client's terms the server holds is the server's to say: its task names their round
(``kept_round``: that of its last accepted update; 0, none), since a reply dropped at the deadline, refused or lost
leaves the server with older terms or none. The client keeps its last upload's terms as pending beside those, and
takes them as held when the task names their round (:func:`_settle`). A client that lost its store cannot take its
held terms out (logged): P is clamped at 0 so the pull stays a pull. The server's memory grows with the number of
clients heard from: two values per trainable parameter per client, journaled with the run.

Under secure aggregation (:mod:`fedge.secagg.parts`) the server keeps no client's terms: it keeps ``U`` and ``V``
themselves and learns each round only sums. Each client k keeps in its store the terms of its that are in U and V
(``(u'_k, v'_k)``, "committed"; zeros at first) and uploads, beside its weights, the *changes* ``u_k - u'_k`` and
``v_k - v'_k``, masked as two unweighted parts after the model's weighted move, each clipped to L2 norm
``--secagg-clip`` on its own (the client computes the same clip, so it knows what the sums received). The server adds
their sums over the survivors U3 to U and V: the same "latest terms of every client heard from" as in the clear,
telescoped (``U = sum_k u'_k``), to within the fixed point's rounding. It tells each client in its task the round
whose terms of its are in U and V (``kept_round``; it knows U3, the client does not: its upload may have vanished in
the protocol), and the client then takes its last upload (``u'_k + clip(u_k - u'_k)``, kept as pending) as committed
if that is the round, and subtracts its committed terms from the broadcast sums for P and Q as in the clear. The
server learns, per round, the survivors' mean move and the sums of their terms' changes; U and V, which every client
receives, it holds anyway. The clear's server-side safeguards need each client's terms and are gone: a negative ``u``
and a ``v`` other than ``u * w`` are a client's own business (each change is bounded by the clip), the broadcast U is
clamped at 0, and ``--clip-factor`` (the median cap) is refused under secure aggregation. A client that lost its store
cannot take its old terms out of U and V: they stay there beside its new ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.algorithms.base import (
    Algorithm,
    CheckedReply,
    ClientStore,
    CostInputs,
    RoundPlan,
    RoundTraffic,
    ServerContext,
    StrategyState,
    TensorSpec,
    UpdateReport,
    tensors_like,
)
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import TrainRequest, TrainStats
from fedge.secagg.parts import SecurePart
from fedge.types import ClientId, StateDict
from fedge.wire import fields as wire
from fedge.wire.fields import bounded
from fedge.wire.message import Message

log = logging.getLogger(__name__)

FISHER_U = "fisher_u."  # broadcast: U = sum_j u_j; update: the client's u_k
FISHER_V = "fisher_v."  # broadcast: V = sum_j v_j; update: the client's v_k = u_k * w_k
_SAVED = "fedcurv.{}.{}."  # the server's kept (u_j, v_j) in its saved state: fedcurv.u.<client>.<param>
_OWN = "fedcurv.own_"  # the client's u_k, v_k that U and V hold, in its store
_SUMS = "fedcurv.sum_{}."  # secure aggregation: U and V in the server's saved state
_PENDING = "fedcurv.pending_"  # the client's last uploaded terms, not yet known to be in U and V
_PENDING_ROUND, _KEPT_ROUND = "fedcurv.pending_round", "fedcurv.kept_round"  # their rounds, in the client's store


@dataclass(frozen=True)
class FedCurvSettings(FedAvgSettings):
    curv_lambda: float = field(
        default=1.0, metadata=bounded(0.0, 1e6, help="weight lambda of the Fisher penalty (FedNTD Table 5: 1)")
    )
    fisher_samples: int = field(
        default=500, metadata=bounded(1, 10**7, help="samples for each client's diagonal Fisher (FedNTD Table 5: 500)")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.curv_lambda >= 0:
            raise ConfigError(f"curv_lambda must be >= 0, got {self.curv_lambda}")


@dataclass(frozen=True)
class FedCurvTask:
    """The round of this client's terms in the broadcast's U and V (0: none; None: unknown, a server resumed from an
    older journal) and, under secure aggregation only, the L2 bound of each uploaded change of its terms (the run's
    ``--secagg-clip``)."""

    kept_round: int | None = field(default=None, metadata=bounded(0, 2**31 - 1))
    term_clip: float | None = field(default=None, metadata=bounded(1e-9, 1e9))


@dataclass(frozen=True)
class FisherProximal(LocalTerm):
    """``mu/2 * sum F * (w - anchor)^2`` per element over the trainable parameters: a Fisher-weighted pull (F = 1 is
    FedProx's term)."""

    kind = "fisher_prox"
    tensors = ("anchor", "weights")
    mu: float = 2.0

    def __call__(self, b: TermBatch) -> torch.Tensor:
        anchor, weights = b.tensors["anchor"], b.tensors["weights"]
        squares = [(weights[k] * (p - anchor[k]).pow(2)).sum() for k, p in b.params.items()]
        return 0.5 * self.mu * sum(squares)  # type: ignore[return-value]

    def example_tensor(self, name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if name == "weights":  # a diagonal Fisher: >= 0, of the size the squared gradients have
            return torch.rand(param.shape, generator=gen, dtype=param.dtype)
        return super().example_tensor(name, param, gen)


class FedCurv(FedAvg[FedCurvSettings]):
    """Server half: FedAvg's average, plus every client's latest Fisher terms and their sums for the broadcast."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        self.trainable = tuple(name for name, _ in self._model.named_parameters())
        self._terms: dict[ClientId, tuple[StateDict, StateDict]] = {}  # client -> (u_j, v_j), its latest accepted
        self._kept: dict[ClientId, int] = {}  # client -> the round of its terms in U and V
        # Secure aggregation: U and V themselves (never a client's terms) and this round's survivors U3.
        self._secure = config.secure_aggregation
        self._u_sum, self._v_sum = self._zeros(), self._zeros()
        self._survivors: tuple[ClientId, ...] = ()

    def _zeros(self) -> StateDict:
        return {k: torch.zeros_like(self._weights[k]) for k in self.trainable}

    def state(self) -> StrategyState:
        tensors, values = super().state()
        values = {**values, "fedcurv_kept": dict(sorted(self._kept.items()))}
        if self._secure:
            tensors.update({_SUMS.format("u") + k: t for k, t in self._u_sum.items()})
            tensors.update({_SUMS.format("v") + k: t for k, t in self._v_sum.items()})
            return tensors, values
        for client, (u, v) in sorted(self._terms.items()):
            tensors.update({_SAVED.format("u", client) + k: t for k, t in u.items()})
            tensors.update({_SAVED.format("v", client) + k: t for k, t in v.items()})
        return tensors, {**values, "fedcurv_clients": sorted(self._terms)}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        super().load_state(tensors, values)
        kept = values.get("fedcurv_kept", {})  # absent from an older journal of a run in the clear
        if not (isinstance(kept, dict) and all(isinstance(c, str) and type(r) is int for c, r in kept.items())):
            raise ConfigError("the saved state's fedcurv_kept must map client ids to rounds")
        self._kept = dict(kept)
        if self._secure:
            self._u_sum = tensors_like(tensors, _SUMS.format("u"), self._zeros())
            self._v_sum = tensors_like(tensors, _SUMS.format("v"), self._zeros())
            return
        clients = values.get("fedcurv_clients", [])
        if not (isinstance(clients, list) and all(isinstance(c, str) for c in clients)):
            raise ConfigError("the saved state's fedcurv_clients must be a list of client ids")
        like = self._zeros()
        self._terms = {
            c: (tensors_like(tensors, _SAVED.format("u", c), like), tensors_like(tensors, _SAVED.format("v", c), like))
            for c in clients
        }

    def sums(self) -> tuple[StateDict, StateDict]:
        """U = sum_j u_j and V = sum_j v_j over every client heard from (zeros before any), in client-id order; under
        secure aggregation the sums kept, U clamped at 0 (the fixed point's rounding can take a sum of zeros below)."""
        if self._secure:
            return {k: t.clamp(min=0) for k, t in self._u_sum.items()}, dict(self._v_sum)
        u_sum, v_sum = self._zeros(), self._zeros()
        for client in sorted(self._terms):
            u, v = self._terms[client]
            u_sum = {k: u_sum[k] + u[k] for k in u_sum}
            v_sum = {k: v_sum[k] + v[k] for k in v_sum}
        return u_sum, v_sum

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        u_sum, v_sum = self.sums()
        tensors = {
            **self._weights,
            **{FISHER_U + k: t for k, t in u_sum.items()},
            **{FISHER_V + k: t for k, t in v_sum.items()},
        }
        clip = self.config.secagg_clip if self._secure else None
        # A client whose terms the server holds from an older journal, which kept no rounds: unknown (None).
        kept = {c: self._kept.get(c, None if c in self._terms else 0) for c in clients}
        tasks = {c: self.task(rnd, c, FedCurvTask(kept[c], clip)) for c in clients}
        return RoundPlan(broadcast=self.broadcast(rnd, tensors), tasks=tasks)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        out = super().reply_tensors()
        for prefix in (FISHER_U, FISHER_V):
            out.update({prefix + k: (tuple(self._weights[k].shape), self._weights[k].dtype) for k in self.trainable})
        return out

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        """Also refuses, in an uncompressed update, a negative Fisher value (a squared gradient is never negative; a
        negative weight would push the other clients away from this one's weights) and a ``v`` other than ``u * w``
        of the update's own weights (the client computes it so in float32: anything else moves the others' anchor
        where this client's weights are not). A lossy upload codec can move a small value below zero or ``v`` off
        ``u * w`` a little: compressed values are clamped at 0 instead, and every kept ``v`` is recomputed as ``u * w``
        (in :meth:`aggregate`), where ``u``'s size is also bounded under a clip factor."""
        report = super().check_reply(rnd, client, reply)
        if self.config.upload_codec != "float32" or self._secure:  # secure: changes of the terms, either sign
            return report
        for k in self.trainable:
            u, v = reply.tensors[FISHER_U + k], reply.tensors[FISHER_V + k]
            if bool((u < 0).any()):
                raise CodecError(f"tensor {FISHER_U + k!r} has negative values; a diagonal Fisher is >= 0")
            if not torch.equal(v, u * reply.tensors[k]):
                raise CodecError(f"tensor {FISHER_V + k!r} is not {FISHER_U + k!r} times the update's weights")
        return report

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """FedAvg's aggregate, then each replying client's terms kept: ``u`` clamped at 0 and, with a clip factor
        (a deployment's default), scaled down to at most that factor times the round's median Fisher norm, so that
        one client cannot make every other client's pull overflow; ``v`` recomputed here as ``u * w`` from the
        update's own (decoded) weights, so that no upload, compressed or not, moves the others' anchor elsewhere."""
        metrics = super().aggregate(rnd, replies)
        if self._secure:  # one reply standing for the survivors U3: the sums of their terms' changes
            (stand_in,) = replies.values()
            for k in self.trainable:
                self._u_sum[k] = self._u_sum[k] + stand_in.update.tensors[FISHER_U + k]
                self._v_sum[k] = self._v_sum[k] + stand_in.update.tensors[FISHER_V + k]
            self._kept.update({c: rnd for c in self._survivors})
            return metrics
        fisher = {c: {k: replies[c].update.tensors[FISHER_U + k].clamp(min=0) for k in self.trainable} for c in replies}
        norms = {c: float(torch.stack([(u * u).sum() for u in f.values()]).sum().sqrt()) for c, f in fisher.items()}
        clip = self.settings.clip_factor
        cap = clip * float(torch.tensor(sorted(norms.values())).median()) if clip > 0 and norms else float("inf")
        for client in sorted(replies):
            scale = min(1.0, cap / norms[client]) if norms[client] > 0 else 1.0
            u = {k: t * scale if scale < 1.0 else t for k, t in fisher[client].items()}
            self._terms[client] = (u, {k: u[k] * replies[client].update.tensors[k] for k in self.trainable})
            self._kept[client] = rnd
        return metrics

    def secure_parts(self) -> tuple[SecurePart, ...]:
        """Under secure aggregation (:mod:`fedge.secagg.parts`): the model's weighted move, then the changes of the
        Fisher terms u and v as sent, each summed unweighted (U and V are sums) and clipped to the bound on its own."""
        u = tuple(FISHER_U + k for k in self.trainable)
        v = tuple(FISHER_V + k for k in self.trainable)
        return (
            SecurePart(tuple(self._weights)),
            SecurePart(u, relative=False, weighted=False),
            SecurePart(v, relative=False, weighted=False),
        )

    def secure_survivors(self, rnd: int, reports: Mapping[ClientId, UpdateReport]) -> None:
        """The clients whose terms' changes are in this round's sums (U3): their terms in U and V are this round's."""
        self._survivors = tuple(reports)


class FedCurvClient(FedAvgClient[FedCurvSettings]):
    settings_type = FedCurvSettings

    def received_weights(self, broadcast: Message) -> StateDict:
        return {k: v for k, v in broadcast.tensors.items() if not k.startswith((FISHER_U, FISHER_V))}

    def request(self, r: LocalRound[FedCurvSettings]) -> TrainRequest:
        u_sum, v_sum = _sums(r.broadcast, r.global_weights)
        own_u, own_v = _own_terms(r, u_sum)
        p = {k: (u_sum[k] - own_u[k]).clamp(min=0) for k in u_sum}  # sum over the other clients
        q = {k: v_sum[k] - own_v[k] for k in v_sum}
        anchor = {k: torch.where(p[k] > 0, q[k] / p[k], torch.zeros_like(q[k])) for k in p}
        request = super().request(r)
        pull = TermCall(FisherProximal(mu=2.0 * r.settings.curv_lambda), {"anchor": anchor, "weights": p})
        terms = (*request.terms, pull) if r.settings.curv_lambda > 0 else request.terms
        return dataclasses.replace(request, terms=terms, fisher_samples=r.settings.fisher_samples)

    def upload(self, r: LocalRound[FedCurvSettings], weights: StateDict, stats: TrainStats) -> dict[str, torch.Tensor]:
        if stats.fisher is None:
            raise ConfigError(f"the {r.backend.runtime} runtime returned no Fisher information; FedCurv needs it")
        u = {k: stats.fisher[k].to(torch.float32).contiguous() for k in _sums(r.broadcast, r.global_weights)[0]}
        v = {k: (u[k] * weights[k]).contiguous() for k in u}
        secure = wire.from_params(FedCurvTask, r.task.params)
        if secure.term_clip is not None:  # secure aggregation: the changes of the terms in U and V
            own_u, own_v = _own_terms(r, u)
            du = {k: (u[k] - own_u[k]).contiguous() for k in u}
            dv = {k: (v[k] - own_v[k]).contiguous() for k in v}
            # What U and V will hold of this client if its upload is in the sums: the secure part clips each change
            # to the bound as this does (so secagg_clipped counts it).
            du_sent, dv_sent = _clipped(du, secure.term_clip), _clipped(dv, secure.term_clip)
            for k in u:
                r.store[_PENDING + "u." + k] = own_u[k] + du_sent[k]
                r.store[_PENDING + "v." + k] = own_v[k] + dv_sent[k]
            r.store[_PENDING_ROUND] = torch.tensor(r.task.round)
            return {**weights, **{FISHER_U + k: t for k, t in du.items()}, **{FISHER_V + k: t for k, t in dv.items()}}
        for k in u:  # what the server will hold of this client if it accepts this reply (up to its own safeguards)
            r.store[_PENDING + "u." + k], r.store[_PENDING + "v." + k] = u[k], v[k]
        r.store[_PENDING_ROUND] = torch.tensor(r.task.round)
        return {**weights, **{FISHER_U + k: t for k, t in u.items()}, **{FISHER_V + k: t for k, t in v.items()}}


def _sums(broadcast: Message, weights: StateDict) -> tuple[StateDict, StateDict]:
    """U and V from the broadcast, by parameter name; CodecError unless they are the same parameters of the weights'
    shapes, non-negative U."""
    u = {k[len(FISHER_U) :]: t for k, t in broadcast.tensors.items() if k.startswith(FISHER_U)}
    v = {k[len(FISHER_V) :]: t for k, t in broadcast.tensors.items() if k.startswith(FISHER_V)}
    if not u or u.keys() != v.keys() or any(k not in weights or u[k].shape != weights[k].shape for k in u):
        raise CodecError("a FedCurv broadcast carries U and V for the model's parameters")
    if any(v[k].shape != u[k].shape for k in u) or any(bool((t < 0).any()) for t in u.values()):
        raise CodecError("a FedCurv broadcast's U must be >= 0 and V of U's shapes")
    return u, v


def _own(store: ClientStore, like: StateDict) -> tuple[StateDict, StateDict]:
    """This client's (u_k, v_k) that U and V hold, zeros before its first round (or after it lost its store)."""
    u = {k: store.get(_OWN + "u." + k, torch.zeros_like(t)) for k, t in like.items()}
    v = {k: store.get(_OWN + "v." + k, torch.zeros_like(t)) for k, t in like.items()}
    return u, v


def _own_terms(r: LocalRound[FedCurvSettings], like: StateDict) -> tuple[StateDict, StateDict]:
    """This client's terms in the broadcast's U and V: those of the round the task names (:func:`_settle`); its last
    upload's when the task names none (a server resumed from an older journal, which assumed so)."""
    kept_round = wire.from_params(FedCurvTask, r.task.params).kept_round
    if kept_round is None and _PENDING_ROUND in r.store:
        kept_round = int(r.store[_PENDING_ROUND])
    if kept_round is not None:
        _settle(r.store, kept_round, like)
    return _own(r.store, like)


def _settle(store: ClientStore, kept_round: int, like: StateDict) -> None:
    """Make the store's committed terms (:data:`_OWN`) those the server says U and V hold of this client, from round
    ``kept_round`` (0: none): the pending upload of that round, or the committed terms already."""
    pending = int(store[_PENDING_ROUND]) if _PENDING_ROUND in store else -1
    kept = int(store[_KEPT_ROUND]) if _KEPT_ROUND in store else 0
    if kept_round == pending:  # moved, not copied: one copy in memory, and a store of unshared tensors to save
        for k in like:
            store[_OWN + "u." + k] = store.pop(_PENDING + "u." + k)
            store[_OWN + "v." + k] = store.pop(_PENDING + "v." + k)
        del store[_PENDING_ROUND]
    elif kept_round == 0:  # the server holds nothing of this client
        for k, t in like.items():
            store[_OWN + "u." + k], store[_OWN + "v." + k] = torch.zeros_like(t), torch.zeros_like(t)
    elif kept_round != kept:
        log.warning(
            "round %d's Fisher terms of this client are in the server's sums, but this client no longer has them (a "
            "lost store): they stay in the sums beside its new ones",
            kept_round,
        )
    store[_KEPT_ROUND] = torch.tensor(kept_round)


def _clipped(terms: StateDict, bound: float) -> StateDict:
    """``terms`` scaled down to L2 norm ``bound`` over all of them when longer (as :meth:`fedge.secagg.parts.PartLayout.
    vector` clips a part: the same factor to within float64 rounding)."""
    norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in terms.values()))
    if norm <= bound:
        return {k: t.contiguous() for k, t in terms.items()}
    return {k: (t * (bound / norm)).contiguous() for k, t in terms.items()}


def fedcurv_traffic(inputs: CostInputs) -> RoundTraffic:
    """The model plus two Fisher terms (u and v, or their sums) per trainable parameter in each direction."""
    size = (inputs.model_values + 2 * inputs.trainable_values) * 4
    return RoundTraffic(up_per_client=size, down_broadcast=size)


ALGORITHM = Algorithm(
    name="fedcurv",
    label="FedCurv",
    paper="Shoham et al. 2019 (as the FedNTD authors implement it)",
    settings=FedCurvSettings,
    server=FedCurv,
    client=FedCurvClient(),
    traffic=fedcurv_traffic,
    describe=lambda s: f"λ={s.curv_lambda:g}",
    secagg_gap="",
    dp_gap="FedCurv's server keeps U and V, sums of each client's latest Fisher terms that stay in them after its "
    "round, so a client's share of a release is not that round's upload alone, and noised Fisher changes would add "
    "up in U round after round (std z C sqrt(T)), far above the Fisher diagonals (docs/privacy.md)",
    terms=(FisherProximal,),
)
