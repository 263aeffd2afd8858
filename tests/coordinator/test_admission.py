"""Who the coordinator admits: clients say truthfully what they can run, and a hello that cannot serve the run, or
that claims more data than it was provisioned with, is refused with the reason."""

from __future__ import annotations

from dataclasses import replace

from coordinator.presence import Presence
from coordinator.run import admission_rule
from edge_client.cli import runtime_capabilities
from fedge.config import RunConfig
from fedge.wire.protocol import ClientStatus, encode_status
from fedge_io.experiment import prepare


def _hello(exp, client: str, runtime: str, predict_only: bool = False, **changes) -> ClientStatus:
    fields = dict(
        client=client,
        state="online",
        runtime=runtime,
        dataset_size=len(exp.parts[client]),
        model=exp.model,
        input_shape=exp.input_shape,
        num_classes=exp.num_classes,
        capabilities=runtime_capabilities(runtime, predict_only),
    )
    fields.update(changes)
    return ClientStatus(**fields)  # type: ignore[arg-type]


def test_an_inference_only_client_is_refused_by_a_training_run_with_the_reason() -> None:
    exp = prepare(RunConfig(algorithm="fedntd", dataset="digits", num_clients=3))
    admit = admission_rule(exp)
    assert admit(_hello(exp, "c000", "torch")) is None
    assert admit(_hello(exp, "c001", "executorch")) is None
    why = admit(_hello(exp, "c002", "onnxruntime"))
    assert why == "its onnxruntime runtime cannot run 'fedntd' (it can run no algorithm)"
    why = admit(_hello(exp, "c002", "onnxruntime", predict_only=True))
    assert why is not None and "it can run fd, dsfl" in why


def test_a_predict_only_client_is_admitted_to_dsfl_and_a_size_claim_must_match_its_data() -> None:
    exp = prepare(RunConfig(algorithm="dsfl", dataset="digits", num_clients=3, open_size=400))
    admit = admission_rule(exp)
    assert admit(_hello(exp, "c001", "onnxruntime", predict_only=True, open_size=400)) is None
    why = admit(_hello(exp, "c001", "torch", open_size=400, dataset_size=10**9))
    assert why is not None and "declares 1000000000 samples" in why


def _status(hello: ClientStatus) -> bytes:
    return encode_status(hello, "run")


def test_admission_state_changes_only_by_admission() -> None:
    """A last will, a refused hello or a contradicting hello never changes what replies are judged against."""
    exp = prepare(RunConfig(algorithm="fedavg", dataset="digits", num_clients=3))
    presence = Presence(admit=admission_rule(exp), min_interval_s=0.0)
    honest = _hello(exp, "c000", "torch")
    size = honest.dataset_size
    assert presence.update("c000", _status(honest), now=1.0).came_online
    assert presence.declared_size("c000") == size
    will = ClientStatus(client="c000", state="offline", reason="connection lost")  # dataset size 0
    presence.update("c000", _status(will), now=2.0)
    assert presence.declared_size("c000") == size  # the will is not an admission
    assert presence.update("c000", _status(honest), now=3.0).came_online  # a reconnect: the same hello is welcome
    # A hello claiming 2^40 samples: refused, for the rest of the run, and the cap stays the admitted size.
    inflated = replace(honest, dataset_size=2**40)
    change = presence.update("c000", _status(inflated), now=4.0)
    assert change is not None and "changed dataset_size from" in str(change.refused)
    assert presence.declared_size("c000") == size
    again = presence.update("c000", _status(honest), now=5.0)  # the original hello does not re-admit it
    assert again is not None and again.refused and "c000" not in presence.available()
    assert "c000" in presence.banned


def test_a_refused_first_hello_admits_nothing() -> None:
    exp = prepare(RunConfig(algorithm="fedavg", dataset="digits", num_clients=3))
    presence = Presence(admit=admission_rule(exp), min_interval_s=0.0)
    wrong = _hello(exp, "c001", "torch", model="some_other_model")
    change = presence.update("c001", _status(wrong), now=1.0)
    assert change is not None and change.refused
    assert presence.declared_size("c001") is None and "c001" not in presence.admitted
    fixed = _hello(exp, "c001", "torch")  # the device restarted with the right model: admitted then
    change = presence.update("c001", _status(fixed), now=2.0)
    assert change is not None and change.refused is None and "c001" in presence.available()
    assert presence.declared_size("c001") == fixed.dataset_size
