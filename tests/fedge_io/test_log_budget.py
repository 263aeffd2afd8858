"""A peer's log lines are capped per round: the first few, a line saying the rest are held back, then silence."""

from __future__ import annotations

import logging

import pytest

from coordinator.replies import RoundContext, reject
from fedge_io.log_budget import LogBudget


def test_a_flooding_peer_gets_its_first_lines_then_one_saying_the_rest_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = LogBudget(logging.getLogger("test.budget"), per_peer=3)
    with caplog.at_level(logging.WARNING, logger="test.budget"):
        for i in range(100):
            budget.warn("mallory", "refused message %d", i)
        budget.warn("alice", "refused message %d", 0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refused message 0", "refused message 1", "refused message 2"]
    assert "further ones this round are counted in the ledger, not logged" in lines[3]
    assert lines[4:] == ["refused message 0"]  # another peer has its own budget
    assert budget.held_back == {"mallory": 97}
    with pytest.raises(ValueError, match="per_peer"):
        LogBudget(logging.getLogger("x"), per_peer=0)


def test_the_coordinators_rejections_go_through_the_rounds_budget(caplog: pytest.LogCaptureFixture) -> None:
    ctx = RoundContext(rnd=1, sampled=frozenset({"c000"}), check=lambda client, msg: None)  # type: ignore[arg-type,return-value]
    with caplog.at_level(logging.WARNING, logger="coordinator.replies"):
        rejections = [reject(ctx, "mallory", "not sampled", f"message {i}") for i in range(50)]
    assert len(rejections) == 50  # every one is still recorded
    assert len(caplog.records) == ctx.log_budget.per_peer + 1
