"""An admitted but malicious client over a real mosquitto: the run completes, every attack is refused with its
category, and with robust aggregation the one valid-looking poisoned update does not cost accuracy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from mqtt_support import mosquitto_url  # noqa: F401 - pytest fixture

from common.experiment import prepare
from common.mqtt import MqttLink
from coordinator.run import run_coordinator
from edge_client.cli import runtime_capabilities
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.messages import BROADCAST, TASK, UPDATE, Message, decode, encode
from fedge.protocol import BrokerAddress, ClientStatus, Topics, encode_status
from sim.laptop import client_processes
from sim.provision import write_client_files
from sim.run import run_inprocess

pytestmark = pytest.mark.broker
ATTACKER = "c005"


class Attacker:
    """Says a valid hello as ATTACKER, then answers every task with a volley of attacks and a sign-flipped model."""

    def __init__(self, url: str, run: str, exp) -> None:
        self.topics = Topics(run)
        hello = ClientStatus(
            client=ATTACKER,
            state="online",
            runtime="torch",
            dataset_size=len(exp.parts[ATTACKER]),
            model=exp.model,
            input_shape=exp.input_shape,
            num_classes=exp.num_classes,
            capabilities=runtime_capabilities("torch", False),
        )
        self._hello = encode_status(hello, run)
        self._broadcasts: dict[int, Message] = {}
        self.link = MqttLink(
            BrokerAddress.parse(url),
            f"attacker-{run}",
            subscriptions=[(self.topics.task(ATTACKER), 1), (self.topics.broadcast, 1)],
            on_ready=lambda link: link.publish(self.topics.status(ATTACKER), self._hello, retain=True),
        ).start(10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        pending: list[Message] = []
        while not self._stop.is_set():
            item = self.link.get(0.1)
            if item is None:
                continue
            msg = decode(item.payload)
            if msg.kind == BROADCAST:
                self._broadcasts[msg.round] = msg
            elif msg.kind == TASK:
                pending.append(msg)
            for task in [t for t in pending if t.round in self._broadcasts]:
                pending.remove(task)
                self._attack(task, dict(self._broadcasts[task.round].tensors))

    def _attack(self, task: Message, weights: dict[str, torch.Tensor]) -> None:
        def send(rnd: int, tensors: dict[str, torch.Tensor], **params: str) -> bytes:
            reply = Message(UPDATE, rnd, run=task.run, client=ATTACKER, params=params, tensors=tensors)
            return encode(reply)

        ok = {"num_examples": str(len(weights)), "loss": "0.5"}
        volley = [
            b"\x00garbage",  # unparseable
            send(task.round, weights, num_examples=str(10**12)),  # the averaging weight inflated: invalid
            send(task.round, {k: torch.full_like(v, float("nan")) for k, v in weights.items()}, **ok),  # invalid
            send(task.round, {k: v * 1e6 for k, v in weights.items()}, **ok),  # model replacement, scaled: invalid
            send(task.round, {k: torch.full_like(v, 3e38) for k, v in weights.items()}, **ok),  # invalid
            send(task.round + 1, weights, **ok),  # wrong round
            b"\x00" * 2_000_000,  # oversize
            # Within every bound: the global model with its sign flipped (update norm 2x the model's). Accepted.
            send(task.round, {k: -v for k, v in weights.items()}, num_examples="1", loss="0.5"),
        ]
        for payload in volley:
            self.link.publish(self.topics.update(ATTACKER), payload, qos=1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.link.close()


def test_a_malicious_admitted_client_cannot_crash_stall_or_poison_a_robust_run(
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
) -> None:
    config = RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=6,
        rounds=3,
        partition="iid",
        train=TrainConfig(local_epochs=1, lr=0.05),
        algo=FedAvgSettings(robust="median"),
    )
    exp = prepare(config)
    files = write_client_files(exp, tmp_path / "data")
    honest = {c: p for c, p in files.items() if c != ATTACKER}
    attacker = None
    with client_processes(honest, mosquitto_url, "hostile", log_dir=tmp_path / "logs"):
        attacker = Attacker(mosquitto_url, "hostile", exp)
        try:
            result = run_coordinator(
                exp.config, tmp_path / "attacked", broker=mosquitto_url, run="hostile", experiment=exp, round_timeout=60
            )
        finally:
            attacker.close()
    assert [r.aggregated for r in result.rounds] == [True, True, True]
    assert all(ATTACKER in r.replied for r in result.rounds)  # the flipped model passed every check...
    categories = {x.category for r in result.rounds for x in r.rejections if x.client == ATTACKER}
    assert {"unparseable", "invalid", "wrong round", "oversize"} <= categories, categories
    assert result.summary["rejected_by_reason"]["invalid"] >= 4 * 3
    # ...and the median keeps it from costing accuracy: within 1 point of the same run with an honest sixth client.
    clean = run_inprocess(exp.config, tmp_path / "clean", experiment=exp)
    attacked_acc, clean_acc = result.rounds[-1].accuracy, clean.rounds[-1].accuracy
    assert attacked_acc is not None and clean_acc is not None
    assert abs(attacked_acc - clean_acc) <= 0.01, (attacked_acc, clean_acc)
