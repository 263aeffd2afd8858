"""A fleet kit for a secure-aggregation run: provisioned (no longer refused), and its broker ACL the same as a plain
run's. The protocol's stage messages ride each client's own task and update topics, so no topic is opened for it:
a client still reads only its own task topic (where its peers' sealed shares and its unmask requests arrive) and
the broadcast, and publishes only its own update and status (the live broker tests of tests/coordinator/
test_fleet_kit.py check that the broker enforces exactly this)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from coordinator.run import provision_fleet
from fedge.config import RunConfig, TrainConfig
from fedge_io.experiment import prepare

CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    model="tiny_mlp",
    num_clients=3,
    rounds=1,
    train=TrainConfig(local_epochs=1),
    secure_aggregation=True,
)


def test_a_secure_aggregation_kit_opens_no_topic_a_plain_one_does_not(tmp_path: Path) -> None:
    exp = prepare(CONFIG)
    secure = provision_fleet(exp, tmp_path / "secure", run="lab", broker_hosts=["127.0.0.1"], port=18883)
    plain_exp = dataclasses.replace(exp, config=dataclasses.replace(CONFIG, secure_aggregation=False))
    plain = provision_fleet(plain_exp, tmp_path / "plain", run="lab", broker_hosts=["127.0.0.1"], port=18883)
    acl = (secure.broker_dir / "acl").read_text()
    assert acl == (plain.broker_dir / "acl").read_text()
    client = acl.split("user fedge-lab-c001\n")[1].split("\n\n")[0].splitlines()
    assert client == [
        "topic write fedge/lab/update/c001",
        "topic write fedge/lab/status/c001",
        "topic read fedge/lab/task/c001",
        "topic read fedge/lab/broadcast",
    ]
    assert "pattern" not in acl and "#" not in acl.replace("# ", "")
