"""The public parameters of one secure-aggregation round, which the coordinator sends with the round's task.

Every party derives the same neighbour graph (:mod:`fedge.secagg.graph`) and the same Shamir x-coordinates (a
client's index in the sorted cohort, plus one) from these fields, so nothing about the graph travels per message.
A restarted round (a coordinator that resumes after a crash) must use a new ``session`` or ``round`` and a new
``round_seed``: keys are bound to (run, session, round), and clients draw fresh key pairs every round anyway.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from fedge.secagg.encoding import RingPlan, ring_plan
from fedge.secagg.errors import MessageError, SecAggConfigError
from fedge.secagg.graph import Graph, default_degree, default_threshold, neighbour_graph
from fedge.secagg.keys import RoundContext
from fedge.secagg.messages import MAX_CLIENTS, MAX_DIM, PREFIX, Fields, check_client_id

if TYPE_CHECKING:
    from fedge.types import ClientId  # annotations only: fedge.types imports torch

SEED_BYTES = 32
"""The round seed (public): it draws the neighbour graph."""

_CONFIG_KEY = PREFIX + "config."
_INT = re.compile(r"-?[0-9]{1,19}")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


@dataclass(frozen=True)
class RoundConfig:
    """Who takes part (``clients``, sorted), how values map to the ring (``plan``), the vector length, the graph
    (``degree``, ``round_seed``), the Shamir ``threshold`` and the fewest survivors a round may finish with."""

    run: str
    session: str
    round: int
    clients: tuple[ClientId, ...]
    round_seed: bytes
    plan: RingPlan
    dim: int
    degree: int
    threshold: int
    min_survivors: int

    @classmethod
    def new(
        cls,
        *,
        run: str,
        session: str,
        round: int,
        clients: Sequence[ClientId],
        round_seed: bytes,
        dim: int,
        bound: float,
        ring_bits: int = 32,
        degree: int | None = None,
        threshold: int | None = None,
        min_survivors: int | None = None,
    ) -> RoundConfig:
        """A config with SecAgg+'s defaults: degree min(N - 1, 2 ceil(log2 N) + 1), threshold floor(k / 2) + 1,
        at least ``threshold`` survivors (Bonawitz et al.'s bound), and the ring plan for a cohort of N."""
        ids = tuple(sorted(clients))
        k = default_degree(len(ids)) if degree is None else degree
        t = default_threshold(k) if threshold is None else threshold
        plan = ring_plan(bound, len(ids), ring_bits)
        return cls(
            run=run,
            session=session,
            round=round,
            clients=ids,
            round_seed=round_seed,
            plan=plan,
            dim=dim,
            degree=k,
            threshold=t,
            min_survivors=t if min_survivors is None else min_survivors,
        )

    def __post_init__(self) -> None:
        n = len(self.clients)
        if not 2 <= n <= MAX_CLIENTS:
            raise SecAggConfigError(f"a secure-aggregation round needs 2 to {MAX_CLIENTS} clients, got {n}")
        try:
            for c in self.clients:
                check_client_id(c)
        except MessageError as exc:
            raise SecAggConfigError(str(exc)) from None
        if any(a >= b for a, b in pairwise(self.clients)):
            raise SecAggConfigError("the round's clients must be sorted and distinct")
        if not isinstance(self.round_seed, bytes) or len(self.round_seed) != SEED_BYTES:
            raise SecAggConfigError(f"the round seed is {SEED_BYTES} bytes")
        if self.plan.cohort_size < n:
            raise SecAggConfigError(f"the ring plan is sized for {self.plan.cohort_size} clients, the round has {n}")
        if not 1 <= self.dim <= MAX_DIM:
            raise SecAggConfigError(f"the vector length must lie in [1, {MAX_DIM}], got {self.dim}")
        if not 1 <= self.degree <= n - 1:
            raise SecAggConfigError(f"the degree must lie in [1, {n - 1}] for {n} clients, got {self.degree}")
        if not 1 <= self.threshold <= self.degree:
            raise SecAggConfigError(f"the threshold must lie in [1, {self.degree}] (the degree), got {self.threshold}")
        if not 1 <= self.min_survivors <= n:
            raise SecAggConfigError(f"min_survivors must lie in [1, {n}], got {self.min_survivors}")
        RoundContext(self.run, self.session, self.round)  # validates the round number

    @property
    def context(self) -> RoundContext:
        """What every key and sealed bundle of this round is bound to."""
        return RoundContext(self.run, self.session, self.round)

    @cached_property
    def graph(self) -> Graph:
        """Each client's neighbours (sorted), the same on every party."""
        return neighbour_graph(self.clients, self.round_seed, self.degree)

    @cached_property
    def index(self) -> dict[ClientId, int]:
        """Each client's position in ``clients``; its Shamir x-coordinate is this plus one."""
        return {c: i for i, c in enumerate(self.clients)}

    def x_of(self, client: ClientId) -> int:
        """The Shamir x-coordinate of the shares ``client`` holds."""
        return self.index[client] + 1

    def to_fields(self) -> Fields:
        """The config as a seed tensor and ``secagg.config.*`` metadata, to travel with the round's task."""
        p = self.plan
        meta = {
            "run": self.run,
            "session": self.session,
            "round": str(self.round),
            "clients": ",".join(self.clients),
            "bound": repr(p.bound),
            "ring_bits": str(p.ring_bits),
            "frac_bits": str(p.frac_bits),
            "cohort_size": str(p.cohort_size),
            "dim": str(self.dim),
            "degree": str(self.degree),
            "threshold": str(self.threshold),
            "min_survivors": str(self.min_survivors),
        }
        seed = np.frombuffer(self.round_seed, dtype=np.uint8).copy()
        return {"secagg.round_seed": seed}, {_CONFIG_KEY + k: v for k, v in meta.items()}

    @classmethod
    def from_fields(cls, tensors: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> RoundConfig:
        """The config from :meth:`to_fields` output; MessageError for anything malformed or inconsistent."""
        seed = tensors.get("secagg.round_seed")
        if not isinstance(seed, np.ndarray) or seed.dtype != np.uint8 or seed.shape != (SEED_BYTES,):
            raise MessageError(f"tensor 'secagg.round_seed' must be {SEED_BYTES} uint8 values")

        def text(key: str, limit: int = 256) -> str:
            raw = meta.get(_CONFIG_KEY + key)
            if not isinstance(raw, str) or len(raw) > limit:
                raise MessageError(f"metadata {_CONFIG_KEY + key!r} is missing or longer than {limit} characters")
            return raw

        def integer(key: str) -> int:
            raw = text(key, 20)
            if not _INT.fullmatch(raw):
                raise MessageError(f"metadata {_CONFIG_KEY + key!r} is not an integer")
            return int(raw)

        bound_text = text("bound", 40)
        if not _FLOAT.fullmatch(bound_text) or not math.isfinite(float(bound_text)):
            raise MessageError(f"metadata {_CONFIG_KEY}bound is not a finite number")
        clients_text = text("clients", 65 * MAX_CLIENTS)
        try:
            return cls(
                run=text("run"),
                session=text("session"),
                round=integer("round"),
                clients=tuple(clients_text.split(",")) if clients_text else (),
                round_seed=seed.tobytes(),
                plan=RingPlan(
                    bound=float(bound_text),
                    ring_bits=integer("ring_bits"),
                    frac_bits=integer("frac_bits"),
                    cohort_size=integer("cohort_size"),
                ),
                dim=integer("dim"),
                degree=integer("degree"),
                threshold=integer("threshold"),
                min_survivors=integer("min_survivors"),
            )
        except SecAggConfigError as exc:
            raise MessageError(f"invalid secure-aggregation config: {exc}") from None
