"""FedBuff over a real mosquitto on the real clock (issue 53): ``fedge coordinator --aggregation fedbuff``.

- K = concurrency = the cohort, constant weight, no straggler: every step buffers one update of each client, all
  trained on the current version, and the run ends with synchronous FedAvg's model (in process, same seed).
- A client slowed until step 2 is taken: its update, trained on version 0, is buffered at version 2 (or later) with
  the weight ``1 / (1 + sqrt(s))`` as the move from the version it was sent; with ``--max-staleness 1`` it is
  dropped instead.
- A client silent past ``--round-timeout``, gone offline past ``--rejoin-grace``, or whose reply is refused frees its
  slot for another (a drop of the step).
- A coordinator SIGKILLed with two of three updates buffered and resumed with ``--resume`` loses neither: they are
  counted once and step 2 takes them with the third; the run ends with the same model (over a fleet kit's broker:
  TLS, a password per device, the least-privilege ACL).
- ``fedge status --json`` shows the version, the buffer's fill and size, and its staleness.

The clients serve from threads of the test (real MqttEdgeClient over the broker), so they outlive a killed coordinator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from insiders import Scaled
from mqtt_support import require_mosquitto
from safetensors.torch import load_file

import coordinator.fedbuff
from coordinator.engine import RoundEngine
from coordinator.fedbuff import BufferedFedAvg, buffered_strategy
from coordinator.mqtt_fedbuff import MqttFedBuffEngine
from coordinator.resume import RunJournal
from coordinator.run import provision_fleet, run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.accounting.ledger import read_ledger_csv
from fedge.aggregation.fedbuff import BufferedUpdate, StalenessWeight
from fedge.algorithms.base import UpdateReport, update_message
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import CodecError, JournalError
from fedge.learning.backend import Backend, TorchBackend
from fedge.types import StateDict
from fedge.wire import chunking
from fedge.wire.message import Message
from fedge.wire.protocol import BrokerAddress, ClientStatus, Topics, encode_status
from fedge_cli.main import main
from fedge_io.credentials import load_bundle
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import MqttLink, PacketLimit
from sim.brokers import fleet_mosquitto, free_port, mosquitto_broker
from sim.inprocess import InProcessTransport
from sim.run import run_inprocess

pytestmark = pytest.mark.broker

CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="synthetic",
    model="tiny_mlp",
    num_clients=3,
    rounds=3,
    partition="iid",
    aggregation="fedbuff",
    train=TrainConfig(local_epochs=1, batch_size=32),
)
TOLERANCE = 1e-5  # FedBuff sums the moves in float64, FedAvg averages the models: the two round differently


class Slowed(EdgeClient):
    """An honest client whose reply to the task of round ``at`` waits until ``release`` is set (once): it stays
    in flight while the others move the model on."""

    def __init__(self, honest: EdgeClient, at: int) -> None:
        super().__init__(honest.client_id, honest.data, honest.backend)
        self.at, self.release = at, threading.Event()
        self.sent: dict[int, tuple[StateDict, StateDict]] = {}  # round -> (broadcast received, weights sent)
        self.held = threading.Event()

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        reply = super().handle(task, broadcast, backend)
        assert broadcast is not None
        self.sent[task.round] = (dict(broadcast.tensors), dict(reply.tensors))
        if task.round == self.at and not self.held.is_set():
            self.held.set()
            assert self.release.wait(60), "the test never released the slowed client"
        return reply


@dataclasses.dataclass
class Fleet:
    url: str
    exp: Experiment
    clients: dict[str, EdgeClient]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """A mosquitto and three clients served from threads; c002 can be slowed by a test (``slow``)."""
    require_mosquitto()
    exp = prepare(CONFIG)
    clients: dict[str, EdgeClient] = {  # a backend each: they train at once, each on its own model
        c: EdgeClient(c, exp.client_data(c, None), TorchBackend(exp.model, exp.input_shape, exp.num_classes))
        for c in sorted(exp.parts)
    }
    with mosquitto_broker() as url:
        yield Fleet(url, exp, clients)


@pytest.fixture
def serve(fleet: Fleet) -> Iterator[Callable[..., list[MqttEdgeClient]]]:
    """Serve the given clients over the broker under ``run`` until the test ends (``max_packet_size``: what each
    client publishes in one packet, larger messages as chunks)."""
    servers: list[tuple[MqttEdgeClient, threading.Thread]] = []

    def start(run: str, clients: dict[str, EdgeClient], max_packet_size: PacketLimit = "auto") -> list[MqttEdgeClient]:
        started = []
        for cid, client in clients.items():
            info = ClientDataInfo(cid, fleet.exp.model, fleet.exp.input_shape, fleet.exp.num_classes)
            server = MqttEdgeClient(client, info, BrokerAddress.parse(fleet.url), run, max_packet_size=max_packet_size)
            thread = threading.Thread(target=server.serve, name=f"{run}-{cid}", daemon=True)
            thread.start()
            servers.append((server, thread))
            started.append(server)
        return started

    yield start
    for server, _ in servers:
        server.stop()
    for _, thread in servers:
        thread.join(10)


@pytest.fixture(scope="module")
def fedavg_model(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> StateDict:
    """Synchronous FedAvg, in process, same seed: what K = concurrency = the cohort must give."""
    sync = dataclasses.replace(CONFIG, aggregation="sync")
    run_dir = tmp_path_factory.mktemp("fedavg") / "run"
    run_inprocess(sync, run_dir, experiment=prepare(sync))
    return load_file(run_dir / "global_model.safetensors")


def _close(a: StateDict, b: StateDict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_fedbuff_deployment_keeps_the_mean_without_a_quorum() -> None:
    """The deployment's synchronous defaults (a robust rule, server-side clipping, half the sampled as quorum) would
    be refused with FedBuff: `fedge coordinator --aggregation fedbuff` keeps the papers' (and no simulated clock)."""
    from fedge_cli.main import _run_config, build_parser

    config = _run_config(build_parser().parse_args(["coordinator", "--aggregation", "fedbuff"]), deployment=True)
    assert config.buffered and not config.simulated_time
    assert (config.algo.robust, config.algo.clip_factor, config.min_replies) == ("mean", 0.0, 1.0)  # type: ignore[attr-defined]
    synchronous = _run_config(build_parser().parse_args(["coordinator"]), deployment=True)
    assert synchronous.algo.robust != "mean" and synchronous.min_replies < 1  # type: ignore[attr-defined]


def test_a_buffer_journaled_before_the_first_step_is_resumed(tmp_path: Path) -> None:
    """Killed before step 1: the journal of "round 0" holds the buffer and the step's record so far."""
    exp = prepare(CONFIG)

    def engine() -> RoundEngine:
        strategy = buffered_strategy(CONFIG, exp.strategy("j"))
        return RoundEngine(CONFIG, strategy, InProcessTransport([]), *exp.test_tensors())

    first = engine()
    assert isinstance(first.strategy, BufferedFedAvg)
    journal = RunJournal(tmp_path, CONFIG, exp.partition_summary(), first)
    move = {k: torch.full_like(v, 0.25) for k, v in first.strategy.global_weights().items()}
    first.strategy.buffer.buffer.append(BufferedUpdate("c001", 0, 667.0, move, 0.5))
    first.strategy.buffer.partial = {"entries": [], "drops": [], "rejections": [], "timings": [], "arrived": ["c001"]}
    journal.checkpoint(first.strategy.buffer.move_group)
    (side,) = (tmp_path / "journal-side").iterdir()  # the move, in a file of its own
    assert set(load_file(side)) == {f"strategy/fedbuff/buffer/0/{k}" for k in move}
    journal.checkpoint(first.strategy.buffer.move_group)  # nothing new: the side file stays as it was
    assert list((tmp_path / "journal-side").iterdir()) == [side]
    tensors = load_file(next(tmp_path.glob("journal-*.safetensors")))
    assert not any("buffer" in k for k in tensors) and any(k.startswith("strategy/") for k in tensors)

    second = engine()
    RunJournal(tmp_path, CONFIG, exp.partition_summary(), second, resume=True)
    assert isinstance(second.strategy, BufferedFedAvg) and second.history.resumed_after == [0]
    (update,) = second.strategy.buffer.buffer
    assert (update.client, update.base_version, update.weight, update.loss) == ("c001", 0, 667.0, 0.5)
    assert all(torch.equal(update.delta[k], move[k]) for k in move)
    assert second.strategy.buffer.partial["arrived"] == ["c001"]
    side.write_bytes(side.read_bytes()[:-4] + b"\0\0\0\0")  # a move altered on disk is refused, not resumed
    with pytest.raises(JournalError, match="SHA-256 differs"):
        RunJournal(tmp_path, CONFIG, exp.partition_summary(), engine(), resume=True)


def test_a_kill_inside_a_checkpoints_journal_commit_resumes_from_the_one_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints commit the journal of one round again and again: each names a tensor file of its own, so a kill
    after the new tensor file is in place but before journal.json names it leaves the journal (and its fallback)
    naming the bytes they recorded. Killed in the third commit: the second's buffer comes back."""
    import fedge_io.journal

    exp = prepare(CONFIG)

    def engine() -> RoundEngine:
        strategy = buffered_strategy(CONFIG, exp.strategy("k"))
        return RoundEngine(CONFIG, strategy, InProcessTransport([]), *exp.test_tensors())

    first = engine()
    assert isinstance(first.strategy, BufferedFedAvg)
    journal = RunJournal(tmp_path, CONFIG, exp.partition_summary(), first)
    st = first.strategy.buffer
    for i, client in enumerate(["c000", "c001", "c002"]):
        move = {k: torch.full_like(v, 0.1 * (i + 1)) for k, v in first.strategy.global_weights().items()}
        st.buffer.append(BufferedUpdate(client, 0, 600.0, move, 0.5))
        st.partial = {
            "entries": [],
            "drops": [],
            "rejections": [],
            "timings": [],
            "arrived": [u.client for u in st.buffer],
        }
        if client == "c002":  # dies once the new tensor file is renamed into place, before journal.json names it

            def killed(path: Path, data: bytes) -> None:
                raise KeyboardInterrupt("kill -9")

            monkeypatch.setattr(fedge_io.journal, "atomic_write", killed)
            with pytest.raises(KeyboardInterrupt):
                journal.checkpoint(st.move_group)
            monkeypatch.undo()
        else:
            journal.checkpoint(st.move_group)

    second = engine()
    RunJournal(tmp_path, CONFIG, exp.partition_summary(), second, resume=True)
    assert isinstance(second.strategy, BufferedFedAvg)
    assert [u.client for u in second.strategy.buffer.buffer] == ["c000", "c001"]


def test_k_equal_to_the_cohort_is_fedavg_and_status_shows_the_buffer(
    fleet: Fleet,
    serve: Callable[..., None],
    fedavg_model: StateDict,
    tmp_path: Path,
) -> None:
    serve("buf-sync", fleet.clients)
    result = run_coordinator(
        CONFIG, tmp_path / "run", broker=fleet.url, run="buf-sync", experiment=fleet.exp, round_timeout=60,
        join_timeout=60,
    )  # fmt: skip
    assert _close(load_file(tmp_path / "run" / "global_model.safetensors"), fedavg_model) < TOLERANCE
    lines = _lines(result.path)
    assert [line["fedbuff_version"] for line in lines] == [1.0, 2.0, 3.0]
    assert all(line["buffer_fill"] == 3 and line["staleness_max"] == 0 for line in lines)
    assert all(line["replied"] == ["c000", "c001", "c002"] for line in lines)
    ledger = read_ledger_csv(result.path / "ledger.csv")
    for step in (1, 2, 3):  # one broadcast, three tasks and three updates a step: every transfer counted once
        own = [(e.direction, e.client, e.kind) for e in ledger if e.round == step]
        assert sorted(own) == sorted(
            [("down", "*", "broadcast")] + [("down", c, "task") for c in fleet.clients]
            + [("up", c, "update") for c in fleet.clients]
        )  # fmt: skip
    assert result.summary["fedbuff"]["versions"] == 3 and result.summary["fedbuff"]["dispatched"] == 9

    # The CLI as an operator runs it (its parser imports no torch: cheap as a process).
    cli = [sys.executable, "-m", "fedge_cli.main", "status", "--broker", fleet.url, "--run", "buf-sync", "--once"]
    shown = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60, check=True).stdout
    status = json.loads(shown)["status"]
    assert (status["phase"], status["version"], status["buffer_size"]) == ("finished", 3, 3)
    assert status["buffer_fill"] == 0 and status["staleness_max"] == -1  # stepped: the buffer is empty
    assert status["in_flight"] == 0 and status["replied"] == ["c000", "c001", "c002"]  # the last step's


def test_chunked_replies_are_reassembled_and_counted_whole(
    fleet: Fleet, serve: Callable[..., list[MqttEdgeClient]], fedavg_model: StateDict, tmp_path: Path
) -> None:
    """Replies larger than the clients' packet limit travel as chunks: each task's chunks are collected and the
    whole reply judged and buffered as a one-packet reply is (the same model as FedAvg's), its ledger entry counting
    every chunk's bytes."""
    limit = 2048
    servers = serve("buf-chunks", fleet.clients, max_packet_size=limit)
    result = run_coordinator(
        CONFIG, tmp_path / "run", broker=fleet.url, run="buf-chunks", experiment=fleet.exp, round_timeout=60,
        join_timeout=60, max_packet_size=limit,
    )  # fmt: skip
    assert _close(load_file(tmp_path / "run" / "global_model.safetensors"), fedavg_model) < TOLERANCE
    assert all(server.link.chunked == 3 for server in servers)  # one chunked reply a step each
    updates = [e for e in read_ledger_csv(result.path / "ledger.csv") if e.kind == "update"]
    assert len(updates) == 9 and all(e.payload_bytes > limit and e.wire_bytes > e.payload_bytes for e in updates)
    assert not [e for e in read_ledger_csv(result.path / "ledger.csv") if e.kind in ("invalid", "incomplete")]
    assert 0 < result.summary["reassembly_peak_bytes"] <= 2 * max(e.payload_bytes for e in updates)


def test_a_reply_short_of_a_chunk_is_given_up_with_its_task(
    fleet: Fleet, serve: Callable[..., list[MqttEdgeClient]], tmp_path: Path
) -> None:
    """c001's first reply loses a chunk: its task is dropped at the round timeout with the reason, the chunks that
    came are counted as an ``incomplete`` entry, and its freed slot takes it again on the next version."""
    limit, timeout = 2048, 6.0
    held = Slowed(fleet.clients["c002"], at=2)  # keeps step 2 waiting until c001's first task has timed out
    _, c001, _ = serve("buf-lossy", {**fleet.clients, "c002": held}, max_packet_size=limit)
    publish = c001.link.publish
    lost: list[int] = []

    def lose_one(topic: str, payload: bytes, **kwargs: Any) -> Any:
        if "/update/" in topic and chunking.is_chunk(payload) and not lost:
            lost.append(chunking.parse_header(payload).index)  # its first chunk never reaches the broker
            return None
        return publish(topic, payload, **kwargs)

    c001.link.publish = lose_one  # type: ignore[method-assign]
    config = dataclasses.replace(CONFIG, rounds=2, buffer_size=2)
    try:
        result = run_coordinator(
            config, tmp_path / "run", broker=fleet.url, run="buf-lossy", experiment=prepare(config),
            round_timeout=timeout, join_timeout=60, max_packet_size=limit,
        )  # fmt: skip
    finally:
        held.release.set()
    assert lost == [0]
    (drop,) = [d for d in result.summary["drops"] if d["client"] == "c001"]
    assert drop["round"] == 2 and drop["reason"].startswith(f"silent past the {timeout:g} s round timeout")
    assert "(incomplete reply: " in drop["reason"] and " chunks)" in drop["reason"]
    ledger = read_ledger_csv(result.path / "ledger.csv")
    (incomplete,) = [e for e in ledger if e.kind == "incomplete"]
    assert incomplete.client == "c001" and incomplete.payload_bytes > limit
    assert [e.client for e in ledger if e.kind == "update" and e.round == 2].count("c001") == 1  # its second task


def test_a_slowed_client_is_buffered_stale_with_its_weight(
    fleet: Fleet, serve: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = Slowed(fleet.clients["c002"], at=1)  # its version-0 update waits until step 2 is taken
    serve("buf-stale", {**fleet.clients, "c002": slow})
    steps: list[tuple[int, list[BufferedUpdate], StateDict]] = []
    delta = coordinator.fedbuff.buffered_delta

    def spy(updates: list[BufferedUpdate], version: int, weight: StalenessWeight) -> StateDict:
        out = delta(updates, version, weight)
        steps.append((version, list(updates), out))
        return out

    monkeypatch.setattr(coordinator.fedbuff, "buffered_delta", spy)

    def on_round(record: Any) -> None:
        if record.round == 2:
            slow.release.set()

    # Four steps: c002's reply, released once step 2 is taken, arrives while step 3 fills (or, should the other two
    # both beat it there, step 4's): at least 2 steps old.
    config = dataclasses.replace(CONFIG, rounds=4, buffer_size=2, staleness_weight="sqrt")
    result = run_coordinator(
        config, tmp_path / "run", broker=fleet.url, run="buf-stale", experiment=prepare(config), round_timeout=60,
        join_timeout=60, on_round=on_round,
    )  # fmt: skip
    assert [v for v, _, _ in steps] == [0, 1, 2, 3]
    assert all(u.client != "c002" for _, buffered, _ in steps[:2] for u in buffered)  # held back
    late = [step for step in steps if any(u.client == "c002" and u.base_version == 0 for u in step[1])]
    ((version, buffered, moved),) = late  # (it may train again, on a later version, once back)
    # Back, c002 may train again on a later version and land in the same step: its stale update is the one from 0.
    (stale,) = [u for u in buffered if u.client == "c002" and u.base_version == 0]
    age = version - stale.base_version
    assert age >= 2
    # Its move is the weights it sent less the version-0 model it was sent.
    received, sent = slow.sent[1]
    assert _close(stale.delta, {k: sent[k] - received[k] for k in received}) == 0
    # The step: sum_i weight(s_i) n_i delta_i / sum_i n_i, with weight(s) = 1 / (1 + sqrt s) (sqrt).
    total = sum(u.weight for u in buffered)
    share = [(1 / (1 + math.sqrt(version - u.base_version))) * u.weight / total for u in buffered]
    mine = next(w for w, u in zip(share, buffered, strict=True) if u is stale)
    assert mine == pytest.approx(stale.weight / total / (1 + math.sqrt(age))) and mine < 0.5
    expected = {k: sum(w * u.delta[k].double() for w, u in zip(share, buffered, strict=True)) for k in moved}
    assert max(float((moved[k].double() - expected[k]).abs().max()) for k in moved) < 1e-6
    lines = _lines(result.path)
    assert lines[version]["staleness_max"] == age and lines[0]["staleness_max"] == 0


def test_max_staleness_drops_the_slowed_clients_update(
    fleet: Fleet, serve: Callable[..., None], tmp_path: Path
) -> None:
    slow = Slowed(fleet.clients["c002"], at=1)  # as above: its version-0 update arrives at version 2
    serve("buf-cut", {**fleet.clients, "c002": slow})
    config = dataclasses.replace(CONFIG, rounds=4, buffer_size=2, staleness_weight="sqrt", max_staleness=1)
    result = run_coordinator(
        config, tmp_path / "run", broker=fleet.url, run="buf-cut", experiment=prepare(config), round_timeout=60,
        join_timeout=60, on_round=lambda r: slow.release.set() if r.round == 2 else None,
    )  # fmt: skip
    lines = _lines(result.path)
    assert all("c002" not in line["replied"] for line in lines[:2])  # held back (later it may train again)
    (dropped,) = [line for line in lines if "c002" in line.get("drop_reasons", {})]
    assert dropped["drop_reasons"]["c002"] == "stale: trained on version 0, 2 steps old > --max-staleness 1"
    assert dropped["dropped_stale"] == 1 and result.summary["fedbuff"]["dropped_stale"] == 1
    assert all(line["staleness_max"] <= 1 for line in lines)


def test_a_silent_client_frees_its_slot_at_the_round_timeout(
    fleet: Fleet, serve: Callable[..., None], tmp_path: Path
) -> None:
    silent = Slowed(fleet.clients["c002"], at=1)  # holds its version-0 reply for the whole run
    serve("buf-silent", {**fleet.clients, "c002": silent})
    config = dataclasses.replace(CONFIG, rounds=1, buffer_size=1, concurrency=1)
    try:
        result = run_coordinator(
            config, tmp_path / "run", broker=fleet.url, run="buf-silent", experiment=prepare(config),
            round_timeout=2, join_timeout=60,
        )  # fmt: skip
    finally:
        silent.release.set()
    # One slot: seed 0 samples c002 first (dispatch group 1), and c001 (group 2) once c002's task is 2 s old.
    (line,) = _lines(result.path)
    assert line["replied"] == ["c001"] and line["dispatched"] == 2
    assert line["drop_reasons"]["c002"] == "silent past the 2 s round timeout"
    assert line["drop_after_s"]["c002"] >= 2


def test_a_client_gone_offline_frees_its_slot_after_the_rejoin_grace(
    fleet: Fleet, serve: Callable[..., None], tmp_path: Path
) -> None:
    run = "buf-gone"
    held = Slowed(fleet.clients["c002"], at=1)
    serve(run, {**fleet.clients, "c002": held})
    config = dataclasses.replace(CONFIG, rounds=1, buffer_size=1, concurrency=1)

    def last_will() -> None:  # what the broker publishes for a device that lost power while training
        held.held.wait(60)
        will = encode_status(ClientStatus(client="c002", state="offline", reason="power lost"), run)
        link = MqttLink(BrokerAddress.parse(fleet.url), "will-of-c002").start(10)
        link.publish(Topics(run).status("c002"), will, qos=1, retain=True)
        link.close(wait=0.5)

    thread = threading.Thread(target=last_will, daemon=True)
    thread.start()
    try:
        result = run_coordinator(
            config, tmp_path / "run", broker=fleet.url, run=run, experiment=prepare(config), round_timeout=60,
            join_timeout=60, rejoin_grace=0.5,
        )  # fmt: skip
    finally:
        held.release.set()
        thread.join(10)
    # Seed 0 samples c002 first; once it has been offline for the grace, its slot goes to c001 (c002 is not online).
    (line,) = _lines(result.path)
    assert line["replied"] == ["c001"] and line["dispatched"] == 2
    assert line["drop_reasons"]["c002"].startswith("went offline")


def test_a_refused_reply_frees_the_slot(fleet: Fleet, serve: Callable[..., None], tmp_path: Path) -> None:
    run = "buf-refused"
    serve(run, {**fleet.clients, "c002": Scaled(fleet.clients["c002"], "sign_flip", 1000.0)})  # beyond the bound
    config = dataclasses.replace(CONFIG, rounds=1, buffer_size=1, concurrency=1)
    result = run_coordinator(
        config, tmp_path / "run", broker=fleet.url, run=run, experiment=prepare(config), round_timeout=60,
        join_timeout=60,
    )  # fmt: skip
    (line,) = _lines(result.path)  # seed 0 samples c002 first: refused, its slot goes to c001 at once
    assert line["replied"] == ["c001"] and line["dispatched"] == 2
    assert [(r["client"], r["category"]) for r in line["rejected"]] == [("c002", "invalid")]
    assert line["drop_reasons"]["c002"].startswith("its reply was refused: invalid: the update moves the model by")


@contextmanager
def kit_fleet(exp: Experiment, clients: Mapping[str, EdgeClient], root: Path, run: str) -> Iterator[tuple[str, Path]]:
    """A fleet kit for ``run`` (TLS, one password per device, the least-privilege ACL), its mosquitto, and the clients
    served from threads with their own device bundles; yields the broker's URL and the coordinator's bundle."""
    kit = provision_fleet(exp, root / "kit", run=run, broker_hosts=["127.0.0.1"], port=free_port())
    with fleet_mosquitto(kit.broker_dir) as url, ExitStack() as stack:
        for cid, client in clients.items():
            address = load_bundle(kit.root / "clients" / cid, broker=url).address
            info = ClientDataInfo(cid, exp.model, exp.input_shape, exp.num_classes)
            server = MqttEdgeClient(client, info, address, run)
            thread = threading.Thread(target=server.serve, name=f"{run}-{cid}", daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(server.stop)
        yield url, kit.coordinator_dir


def test_a_killed_coordinator_resumes_mid_buffer_and_loses_no_update(
    fleet: Fleet, fedavg_model: StateDict, tmp_path: Path
) -> None:
    """Over a fleet kit's broker, as deployed: `fedge coordinator --bundle` in its own process, SIGKILLed."""
    slow = Slowed(fleet.clients["c002"], at=2)  # holds step 2 open: c000's and c001's updates wait in the buffer
    with kit_fleet(fleet.exp, {**fleet.clients, "c002": slow}, tmp_path, "buf-kill") as (url, bundle):
        _kill_and_resume(url, bundle, slow, fedavg_model, tmp_path)


def _kill_and_resume(url: str, bundle: Path, slow: Slowed, fedavg_model: StateDict, tmp_path: Path) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(CONFIG.to_dict()))
    args = ["coordinator", "--bundle", str(bundle), "--broker", url, "--config", str(config_file)]
    args += ["--round-timeout", "60", "--join-timeout", "60", "--no-report", "--broker-counters", "off"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same float sums as this process
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "fedge_cli.main", *args, "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        journal: dict[str, Any] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(out.glob("*/journal.json"))
            if found:
                try:
                    journal = json.loads(found[0].read_text())
                except ValueError:  # replaced while read
                    journal = {}
                if journal.get("round") == 1 and len(journal["values"]["strategy"]["fedbuff"]["buffer"]) == 2:
                    proc.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.05)
        assert proc.wait(10) == -signal.SIGKILL, "the coordinator was not killed mid-buffer"
    finally:
        if proc.poll() is None:
            proc.kill()
    buffered = journal["values"]["strategy"]["fedbuff"]["buffer"]
    assert sorted(u["client"] for u in buffered) == ["c000", "c001"] and {u["base_version"] for u in buffered} == {1}
    slow.release.set()  # its reply goes to the dead session: refused as late by the next one
    (killed,) = out.iterdir()
    assert len(list((killed / "journal-side").iterdir())) == 2  # the two buffered moves, a file each

    assert main([*args, "--resume", str(killed)]) == 0
    assert _close(load_file(killed / "global_model.safetensors"), fedavg_model) < TOLERANCE
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_after"] == [1] and not (killed / "journal-side").exists()  # finished: not needed
    lines = _lines(killed)
    assert [line["round"] for line in lines] == [1, 2, 3]
    assert lines[1]["replied"] == ["c000", "c001", "c002"] and lines[1]["buffer_fill"] == 3
    # Every accepted update of step 2 is counted once: the killed session's two from its journal, c002's from the
    # resumed one (and a reply to the dead session, when it arrives, as a refused one besides).
    ups = [e for e in read_ledger_csv(killed / "ledger.csv") if e.round == 2 and e.direction == "up"]
    assert sum(e.client == "c000" for e in ups) == 1 and sum(e.client == "c001" for e in ups) == 1
    late = [r for r in lines[1]["rejected"] if r["client"] == "c002"]
    assert sum(e.client == "c002" for e in ups) == 1 + len(late)
    assert all(r["category"] == "late" for r in late)


def test_a_stale_reply_is_bounded_by_its_move_from_the_version_it_trained_on() -> None:
    """The update bound measures a reply's move from the model its task sent (as the simulator, which judges at
    dispatch, does), not from the model two steps later: an honest small move is accepted, and a reply near the
    current model, which replays the steps taken since as a move of its own, is refused. In process (no broker)."""
    config = dataclasses.replace(CONFIG, algo=FedAvgSettings(max_update_ratio=5.0))
    exp = prepare(config)
    strategy = buffered_strategy(config, exp.strategy("stale-bound"))
    engine = MqttFedBuffEngine(config, strategy, InProcessTransport([]), *exp.test_tensors())  # type: ignore[arg-type]
    w0 = {k: v.clone() for k, v in strategy.global_weights().items()}
    engine.bases[0] = w0  # version 0: what the task of round 1 sent
    task = strategy.configure(1, ["c000"]).tasks["c000"]
    strategy.inner.apply_average({k: 11 * v for k, v in w0.items()})  # the model moved on, far (10 |w0|)
    check = engine._check_at(1)

    def reply(weights: StateDict) -> Message:
        return update_message(task, weights, UpdateReport(num_examples=50, loss=0.5))

    honest = {k: v + 1e-3 for k, v in w0.items()}  # a small move from version 0
    assert check("c000", reply(honest)).report.num_examples == 50
    replay = {k: v + 1e-3 for k, v in strategy.global_weights().items()}  # a move of 10 |w0| from version 0
    with pytest.raises(CodecError, match="moves the model by"):
        check("c000", reply(replay))
