"""Device-side checks that scripts/aarch64-emulated-check.sh runs on the host and under emulated aarch64 (issue 56).

    python scripts/aarch64_check.py loss              # one training step's loss and gradient, three numeric modes
    python scripts/aarch64_check.py gate tiny_mlp     # the stepwise gate on eager float32 channels-last
    python scripts/aarch64_check.py gate fedavg_cnn [--steps N]

Both print one ``RESULT {json}`` line per measurement (easy to diff between machines) besides readable lines.
One thread throughout: emulation is slow and the host is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
import time

import torch

torch.set_num_threads(1)


def _machine() -> dict[str, str]:
    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": str(torch.backends.mkldnn.is_available()),
    }


def _result(**fields: object) -> None:
    print("RESULT " + json.dumps({**_machine(), **fields}, sort_keys=True), flush=True)


def loss(batch: int) -> None:
    """fedavg_cnn (seed 0) on a fixed batch: cross-entropy loss and the gradient's L-inf norm in float32 (default
    kernels), float32 with oneDNN off, float32 channels-last (fedge's client layout) and float64; the gradient's
    largest difference from float64's. The batch is drawn in float64 (no vectorized float32 sampler, so the same
    numbers on every CPU) and its checksum printed so that machines can be seen to start from the same inputs."""
    from fedge.learning.models import build_model

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(batch, 1, 28, 28, generator=gen, dtype=torch.float64)
    y = torch.arange(batch) % 10
    model0 = build_model("fedavg_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0)
    wsum = sum(float(p.detach().double().sum()) for p in model0.parameters())
    print(f"inputs checksum {float(x64.float().double().sum()):.12g}, weights checksum {wsum:.12g}")

    def step(dtype: torch.dtype, *, mkldnn: bool = True, channels_last: bool = False) -> tuple[float, dict, float]:
        model = build_model("fedavg_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0).to(dtype)
        x = x64.float().to(dtype)  # float32's inputs, widened for float64: the same values in every mode
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        before = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = mkldnn
        try:
            start = time.perf_counter()
            value = torch.nn.functional.cross_entropy(model(x), y)
            value.backward()
            seconds = time.perf_counter() - start
        finally:
            torch.backends.mkldnn.enabled = before
        grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        return float(value.detach()), grads, seconds

    ref_loss, ref_grads, ref_s = step(torch.float64)
    ref_linf = max(float(g.abs().max()) for g in ref_grads.values())
    modes = {
        "float32": dict(dtype=torch.float32),
        "float32-no-mkldnn": dict(dtype=torch.float32, mkldnn=False),
        "float32-channels-last": dict(dtype=torch.float32, channels_last=True),
    }
    for mode, kwargs in modes.items():
        value, grads, seconds = step(**kwargs)  # type: ignore[arg-type]
        linf = max(float(g.abs().max()) for g in grads.values())
        gdiff = max(float((g - ref_grads[n]).abs().max()) for n, g in grads.items())
        print(
            f"{mode:22s} loss {value:.7f} (float64 {ref_loss:.7f}, diff {value - ref_loss:+.2e}) grad L-inf "
            f"{linf:.7g}, grad max diff from float64 {gdiff:.2e} ({gdiff / ref_linf:.2e} of L-inf), {seconds:.2f} s"
        )
        _result(
            check="loss",
            mode=mode,
            loss=value,
            loss_diff=value - ref_loss,
            grad_linf=linf,
            grad_diff=gdiff,
            seconds=round(seconds, 3),
        )
    print(f"{'float64':22s} loss {ref_loss:.12f} grad L-inf {ref_linf:.12g}, {ref_s:.2f} s")
    _result(check="loss", mode="float64", loss=ref_loss, grad_linf=ref_linf, seconds=round(ref_s, 3))


def gate(name: str, steps: int | None) -> None:
    """export.gates.stepwise.stepwise_parity with eager float32 channels-last (one thread) as the program, as
    tests/export/test_executorch.py::test_the_stepwise_gate_accepts_a_max_pool_tie_that_float32_breaks_the_other_way
    runs it: a correct program, which the gate must accept. Prints the verdict, the ties it flipped per suspect step and
    whether the jitter allowance was needed."""
    from export.gates import inputs, reference, stepwise
    from fedge.algorithms.fedavg import CrossEntropy
    from fedge.learning.models import exchanged_state
    from fedge.learning.training import train as eager_train
    from fedge.programs.spec import ModelSpec, TrainingLoss

    shapes = {"tiny_mlp": (1, 8, 8), "fedavg_cnn": (1, 28, 28)}
    spec = ModelSpec(name, shapes[name], 10)
    start = exchanged_state(spec.build(seed=0))
    request = inputs.drift_request(
        spec, TrainingLoss(CrossEntropy()), batch_size=inputs.DRIFT_BATCH, steps=steps or inputs.DRIFT_STEPS
    )

    calls = [0]

    def channels_last_float32(begin, one):  # type: ignore[no-untyped-def]
        calls[0] += 1
        print(f"  step {calls[0]}: program step at {time.perf_counter() - t0:.0f} s", flush=True)
        model = reference.reference_model(spec, begin).to(memory_format=torch.channels_last)
        with reference.torch_threads(1):
            eager_train(model, dataclasses.replace(one, x=one.x.contiguous(memory_format=torch.channels_last)))
        return exchanged_state(model)

    flipped: list[list[str]] = []
    spreads: list[int] = []
    flip_ties, jitter_spread = stepwise._flip_ties, stepwise._jitter_spread

    def recorded_flips(*args):  # type: ignore[no-untyped-def]
        result = flip_ties(*args)
        flipped.append([str(t) for t in result[0]])
        return result

    def recorded_spread(*args, **kwargs):  # type: ignore[no-untyped-def]
        spreads.append(kwargs.get("seed", -1))
        return jitter_spread(*args, **kwargs)

    stepwise._flip_ties, stepwise._jitter_spread = recorded_flips, recorded_spread
    t0 = begin = time.perf_counter()
    report = stepwise.stepwise_parity(channels_last_float32, spec, start, request, source="eager", runtime="torch")
    seconds = time.perf_counter() - begin
    # What the test asserts: passed, under 1e-6, every suspect step explained by ReLU / max-pool flips alone.
    explained = all(flipped) and all(t.startswith(("max-pool window ", "ReLU ")) for s in flipped for t in s)
    verdict = "PASS" if report.passed and report.max_scaled_diff < 1e-6 and explained and not spreads else "FAIL"
    print(f"{name}: {verdict} ({'accepted' if report.passed else 'REFUSED'}) {report}")
    print(f"  suspect steps (ties flipped): {flipped}; jitter allowance at steps: {spreads}; {seconds:.1f} s")
    _result(
        check="gate",
        model=name,
        steps=len(request.x) // request.batch_size,
        verdict=verdict,
        passed=report.passed,
        max_scaled_diff=report.max_scaled_diff,
        worst=report.worst,
        flips=flipped,
        allowance_steps=spreads,
        seconds=round(seconds, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p_loss = sub.add_parser("loss")
    p_loss.add_argument("--batch", type=int, default=50)
    p_gate = sub.add_parser("gate")
    p_gate.add_argument("model", choices=["tiny_mlp", "fedavg_cnn"])
    p_gate.add_argument("--steps", type=int, default=None, help="steps of the drift request (default: the gate's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s", stream=sys.stdout)
    print(" ".join(f"{k}={v}" for k, v in _machine().items()), flush=True)
    if args.what == "loss":
        loss(args.batch)
    else:
        gate(args.model, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
