"""The fleet view's rows from a run's records: what a client reports itself cannot make the run status one that every
monitor refuses."""

from __future__ import annotations

from coordinator.fleet_view import client_rows, outcome
from fedge.accounting.records import ByteCounts, ClientTiming, RoundRecord
from fedge.wire.run_status import RunStatus, decode_run_status, encode_run_status


def test_a_clients_absurd_step_time_is_capped_so_monitors_still_read_the_status() -> None:
    counts = ByteCounts({}, {}, 0, {}, {}, 0, 0, {})
    # A client says its step took 1e300 s: a finite, non-negative number, which the coordinator takes.
    r = RoundRecord(1, ("c1",), ("c1",), True, 1, counts, timings=(ClientTiming("c1", 1.0, 1e300),))
    rows = client_rows([r], [], {}, {}, {})
    status = RunStatus(run="lab", session="s", phase="done", round=1, clients=rows)
    got = decode_run_status(encode_run_status(status), "lab")
    assert got.clients[0].client == "c1" and 0 <= got.clients[0].step_s <= 1e9


def test_an_epsilon_beyond_the_wire_bound_is_capped() -> None:
    counts = ByteCounts({}, {}, 0, {}, {}, 0, 0, {})
    r = RoundRecord(1, ("c1",), ("c1",), True, 1, counts, metrics={"dp_epsilon": 1e12})  # a tiny noise multiplier
    status = RunStatus(run="lab", session="s", phase="done", round=1, history=(outcome(r),), epsilon=outcome(r).epsilon)
    got = decode_run_status(encode_run_status(status), "lab")
    assert got.history[0].epsilon == got.epsilon == 1e9
