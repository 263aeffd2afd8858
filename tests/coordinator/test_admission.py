"""Who the coordinator admits: clients say truthfully what they can run, and a hello that cannot serve the run, or
that claims more data than it was provisioned with, is refused with the reason."""

from __future__ import annotations

from common.experiment import prepare
from coordinator.run import admission_rule
from edge_client.cli import runtime_capabilities
from fedge.config import RunConfig
from fedge.protocol import ClientStatus


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
