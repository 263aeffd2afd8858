"""fedge.algorithms.wrapping: a wrapper is its inner strategy in everything it does not override."""

from __future__ import annotations

import inspect

import pytest
import torch
from algorithm_support import TwoClients, config

from coordinator.engine import RoundEngine
from fedge.algorithms.base import CheckedReply, Strategy
from fedge.algorithms.wrapping import WrappingStrategy
from fedge.errors import CodecError
from fedge.types import ClientId
from fedge.wire.message import Message

HELPERS = {"local_training", "task", "broadcast"}  # build a subclass's own messages from its config: not the inner's


def test_every_strategy_method_is_forwarded() -> None:
    """A method added to Strategy later fails here until WrappingStrategy forwards it (else a wrapper would answer
    with Strategy's default instead of the wrapped algorithm's)."""
    methods = {n for n, v in vars(Strategy).items() if inspect.isfunction(v) and not n.startswith("_")} - HELPERS
    assert methods - set(vars(WrappingStrategy)) == set()


def test_a_wrapped_run_is_the_inner_strategy_s_run_bit_for_bit() -> None:
    """SCAFFOLD (a broadcast of two tensors, a reply of two, server state beyond the weights) through a wrapper that
    overrides nothing: the same model, metrics, state and saved state round trip as the bare strategy's."""
    cfg = config("scaffold")
    bare, wrapped = TwoClients(cfg), TwoClients(cfg)
    wrapper = WrappingStrategy(wrapped.strategy, cfg)
    engine = RoundEngine(cfg, wrapper, wrapped.transport, wrapped.engine.test_x, wrapped.engine.test_y)
    for rnd in (1, 2):
        expected, got = bare.round(rnd), engine.run_round(rnd)
        assert got.aggregated and not got.rejections
        assert got.metrics == expected.metrics
    weights = wrapper.global_weights()
    assert weights is not None and torch.equal(weights["weight"], bare.global_weight())
    tensors, values = wrapper.state()
    want_tensors, want_values = bare.strategy.state()
    assert values == want_values and tensors.keys() == want_tensors.keys()
    assert all(torch.equal(tensors[k], want_tensors[k]) for k in tensors)
    wrapper.load_state({k: torch.zeros_like(v) for k, v in tensors.items()}, values)
    assert not bool(wrapped.global_weight().any())  # loaded into the inner strategy


class _Refusing(WrappingStrategy):
    """Overrides accept only."""

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        raise CodecError(f"{client} refused by the wrapper")


def test_check_reply_is_the_overridden_accept_s_verdict() -> None:
    """A wrapper that changes what it accepts (decoding, a protocol's keys) changes check_reply with it."""
    run = TwoClients(config("fedavg"))
    plan = run.strategy.configure(1, ["a"])
    reply = run.clients[0].handle(plan.tasks["a"], plan.broadcast)
    assert run.strategy.check_reply(1, "a", reply).num_examples == 2  # the inner strategy accepts it
    with pytest.raises(CodecError, match="a refused by the wrapper"):
        _Refusing(run.strategy, run.strategy.config).check_reply(1, "a", reply)
