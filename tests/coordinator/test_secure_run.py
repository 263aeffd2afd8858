"""A whole FedNTD run over TLS with per-device passwords and the kit's ACL, on mosquitto started from the kit.

The equivalence that holds over plain MQTT must hold over TLS: the final global model equals the in-process
simulator's for the same config and seeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mqtt_support import require_mosquitto
from safetensors.torch import load_file

from coordinator.run import provision_fleet, run_coordinator
from fedge.config import RunConfig, TrainConfig
from fedge_io.credentials import load_bundle
from fedge_io.experiment import prepare
from sim.brokers import fleet_mosquitto, free_port
from sim.laptop import client_processes
from sim.provision import write_client_files
from sim.run import run_inprocess

pytestmark = pytest.mark.broker


def test_a_fedntd_run_over_tls_with_passwords_and_acls_equals_the_in_process_run(tmp_path: Path) -> None:
    require_mosquitto()
    config = RunConfig(
        algorithm="fedntd",
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=2,
        train=TrainConfig(local_epochs=1, batch_size=32),
    )
    exp = prepare(config)
    files = write_client_files(exp, tmp_path / "data")
    kit = provision_fleet(exp, tmp_path / "kit", run="secure", broker_hosts=["127.0.0.1"], port=free_port())
    bundle = load_bundle(kit.coordinator_dir)
    assert bundle.address.tls and bundle.address.password and bundle.clients == ("c000", "c001", "c002")
    with fleet_mosquitto(kit.broker_dir) as url:
        assert url.startswith("mqtts://")
        bundles = {c: kit.root / "clients" / c for c in files}
        with client_processes(files, url, "secure", log_dir=tmp_path / "logs", bundles=bundles):
            result = run_coordinator(
                exp.config,
                tmp_path / "tls",
                broker=bundle.address,
                run=bundle.run,
                provisioned=bundle.clients,
                experiment=exp,
                round_timeout=120,
                join_timeout=120,
            )
    assert all(r.replied == ("c000", "c001", "c002") for r in result.rounds)
    assert all(r.bytes.wire > 0 for r in result.rounds)
    run_inprocess(exp.config, tmp_path / "inprocess", experiment=exp)
    a = load_file(tmp_path / "tls" / "global_model.safetensors")
    b = load_file(tmp_path / "inprocess" / "global_model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0  # both with one torch thread per client step
    for log in (tmp_path / "logs").iterdir():
        assert bundle.address.password not in log.read_text()  # no secret in any log
