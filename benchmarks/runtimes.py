"""On-device runtimes against eager PyTorch, measured in one run on the same CPU.

For each model: the size of each export (ONNX, ExecuTorch inference .pte with XNNPACK, ExecuTorch training program),
inference latency (eager PyTorch, ONNX Runtime, ExecuTorch XNNPACK, ExecuTorch portable = the training program's
eval method that the ExecuTorch client uses) and training-step latency (eager PyTorch step vs an ExecuTorch
training-program step, FedNTD loss, momentum SGD; beside it the same lowering with plain copies,
``export_training(..., faster_copies=False)``, the baseline of the cheaper copies), each as a ratio to eager PyTorch.
Then a short FedNTD run with every client on ExecuTorch against the same run with every client on PyTorch (in
process): accuracy per round and the largest difference between the two final global models.

All runtimes get the same number of CPU threads (``--threads``, default 1: one core of a small device; ExecuTorch's
portable kernels are single-threaded anyway). Absolute times depend on the machine and its load; the ratios are the
result: the runtimes run interleaved, one step (or one inference) each in turn, and a ratio is the median of the
per-turn ratios to eager PyTorch. ONNX Runtime training runs in its own environment, where its worker interleaves it
pass by pass with eager PyTorch (``export.ort_training.timing.step_times``). The report prints the load average. Every
export passes its parity check before it is timed.

Usage: python benchmarks/runtimes.py [--models fedavg_cnn dsfl_mnist_cnn] [--batch 50] [--repeats 20]
           [--fl-dataset digits] [--fl-rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge_client.backends.executorch import ExecuTorchBackend
from edge_client.backends.runners import OnnxRunner, PteRunner, PteTrainer
from export.cache import ExportingSource
from export.executorch import export_inference, export_training
from export.gates.check import check_training
from export.gates.logits import check_onnx, check_pte
from export.gates.report import require
from export.onnx import export_onnx
from export.ort_training.timing import step_times_in_env
from fedge.accounting.markdown import markdown_table
from fedge.algorithms.fedavg import CrossEntropy
from fedge.algorithms.fedntd import NotTrueDistillation
from fedge.config import RunConfig, TrainConfig
from fedge.learning.models import example_input, exchanged_state
from fedge.learning.training import MomentumSGD, SGDSettings, TrainRequest
from fedge.programs.spec import ModelSpec, TrainingLoss
from sim.run import run_inprocess


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, dict[str, float]]:
    """Each function once per repeat, in turn (so every runtime sees the same machine load, step by step): per
    function its median ms and the median of its per-repeat ratio to the first function's time (the baseline)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = next(iter(times.values()))
    return {
        name: {
            "ms": 1000.0 * statistics.median(ts),
            "ratio": statistics.median(t / b for t, b in zip(ts, base, strict=True)),
        }
        for name, ts in times.items()
    }


def load_average() -> str:
    """The machine's load while the numbers were taken (ratios hold under load; absolute times do not)."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


def bench_model(spec: ModelSpec, batch: int, repeats: int, threads: int) -> dict[str, Any]:
    model = spec.build(seed=0)
    weights = exchanged_state(model)
    ntd = TrainingLoss(NotTrueDistillation())
    t = time.perf_counter()
    files = {
        "onnx": export_onnx(model, spec),
        "pte (XNNPACK)": export_inference(model, spec, max_batch=max(batch, 64)),
        "pte training (ntd)": export_training(model, spec, ntd, max_batch=max(batch, 64)),
    }
    # The "before": the same program without lowering (portable convolution loops). It fails the drift gate on
    # batch-norm models (the portable variance kernel), so it is timed here only, never checked or used.
    unlowered = export_training(model, spec, ntd, max_batch=max(batch, 64), lower=False)
    export_s = time.perf_counter() - t
    require(check_onnx(files["onnx"], weights))
    require(check_pte(files["pte (XNNPACK)"], weights))
    require(check_training(files["pte training (ntd)"], weights))

    x1, xb = spec.example(1, seed=1), spec.example(batch, seed=2)
    y = torch.randint(0, spec.num_classes, (batch,), generator=torch.Generator().manual_seed(3))
    teacher = torch.randn(batch, spec.num_classes, generator=torch.Generator().manual_seed(4))
    ort = OnnxRunner(files["onnx"], threads=threads)
    pte = PteRunner(files["pte (XNNPACK)"])
    trainer = PteTrainer(files["pte training (ntd)"])
    trainer.set_weights(weights)
    before = PteTrainer(unlowered)
    before.set_weights(weights)
    model.eval()

    def eager(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    runners: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager PyTorch": eager,
        "ONNX Runtime": ort.logits,
        "ExecuTorch XNNPACK": pte.logits,
        "ExecuTorch portable (client)": trainer.logits,
    }
    by_batch = {
        n: interleaved({name: functools.partial(run, x) for name, run in runners.items()}, repeats)
        for n, x in ((1, x1), (batch, xb))
    }
    inference = {name: {n: by_batch[n][name] for n in by_batch} for name in runners}

    sgd = SGDSettings(lr=0.01, momentum=0.9, weight_decay=1e-5)
    train_model = spec.build(seed=0).train()
    opt = MomentumSGD(list(train_model.parameters()), sgd)  # the optimizer of fedge's PyTorch client
    objective = NotTrueDistillation()

    def eager_step() -> None:
        loss = objective.loss(train_model(xb), y, {"teacher": teacher})
        opt.zero_grad()
        loss.backward()
        opt.step()

    et_opt = trainer.optimizer(sgd)
    idx = torch.arange(batch)
    request = TrainRequest(xb, y, objective, sgd, 1, batch, 0, inputs={"teacher": teacher})
    inputs = trainer.step_inputs(request, idx)
    before_opt = before.optimizer(sgd)
    before_inputs = before.step_inputs(request, idx)
    plain_copies = PteTrainer(export_training(model, spec, ntd, max_batch=max(batch, 64), faster_copies=False))
    plain_copies.set_weights(weights)
    plain_opt = plain_copies.optimizer(sgd)
    plain_inputs = plain_copies.step_inputs(request, idx)
    training = interleaved(
        {
            "eager PyTorch": eager_step,
            "ExecuTorch training program": lambda: trainer.step(et_opt, inputs),
            "ExecuTorch lowered, plain copies": lambda: plain_copies.step(plain_opt, plain_inputs),
        },
        repeats,
    )
    # Seconds per step: a few repeats are enough, each beside an eager step for its ratio.
    slow = interleaved(
        {"eager PyTorch": eager_step, "before": lambda: before.step(before_opt, before_inputs)}, 3, warmup=1
    )
    training["ExecuTorch before lowering"] = slow["before"]
    # ONNX Runtime training lives in its own environment: its worker times it pass by pass against eager PyTorch
    # in the same process (export.ort_training.timing.step_times), so its ratio is from one run too.
    ort = step_times_in_env(spec, batch=batch, threads=threads, repeats=max(3, repeats // 4))
    if ort is not None:
        training["ONNX Runtime training"] = {"ms": ort["ort_training_ms"], "ratio": ort["ratio"]}
    return {
        "model": spec.name,
        "input_shape": list(spec.input_shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "file_bytes": {k: len(v) for k, v in files.items()},
        "state_bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        "export_s": export_s,
        "inference_ms": inference,
        "train_step": training,
        "load_average": load_average(),
    }


def fl_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """The same short FedNTD run with all-PyTorch and with all-ExecuTorch clients."""
    config = RunConfig(
        algorithm="fedntd",
        dataset=args.fl_dataset,
        data_dir=args.fl_data_dir,
        model=args.fl_model,
        num_clients=args.fl_clients,
        rounds=args.fl_rounds,
        train=TrainConfig(local_epochs=args.fl_epochs),
    )
    out: dict[str, Any] = {
        "config": {"dataset": config.dataset, "rounds": config.rounds, "clients": config.num_clients}
    }
    out["config"]["local_epochs"] = config.train.local_epochs
    with tempfile.TemporaryDirectory(prefix="fedge-bench-") as tmp:
        from fedge_io.experiment import prepare

        exp = prepare(config)
        et = ExecuTorchBackend(
            exp.model, exp.input_shape, exp.num_classes, programs=ExportingSource(Path(tmp) / "programs")
        )
        t = time.perf_counter()
        losses = [TrainingLoss(CrossEntropy()), TrainingLoss(NotTrueDistillation())]
        et.prepare(losses, config.train.batch_size)  # export + check, not timed below
        out["export_and_check_s"] = time.perf_counter() - t
        runs = {}
        for name, backend_for in (("PyTorch clients", None), ("ExecuTorch clients", lambda c: et)):
            t = time.perf_counter()
            result = run_inprocess(config, Path(tmp) / name.split()[0], experiment=exp, backend_for=backend_for)
            runs[name] = {
                "accuracy": [r.accuracy for r in result.rounds],
                "wall_s": time.perf_counter() - t,
            }
        from safetensors.torch import load_file

        a = load_file(str(Path(tmp) / "PyTorch" / "global_model.safetensors"))
        b = load_file(str(Path(tmp) / "ExecuTorch" / "global_model.safetensors"))
        out["runs"] = runs
        out["model"] = exp.model
        out["max_global_weight_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    return out


def print_report(results: list[dict[str, Any]], fl: dict[str, Any] | None, batch: int, threads: int) -> None:
    print(f"# On-device runtimes vs eager PyTorch ({threads} thread(s), torch {torch.__version__})\n")
    print("## Export sizes\n")
    header = ["model", "parameters", "state (float32)", "ONNX", ".pte XNNPACK", ".pte training (ntd)"]
    files = ("onnx", "pte (XNNPACK)", "pte training (ntd)")
    sizes = [
        [f"{r['model']} {r['input_shape']}", f"{r['parameters']:,}", f"{r['state_bytes']:,}"]
        + [f"{r['file_bytes'][k]:,}" for k in files]
        for r in results
    ]
    print(markdown_table(header, sizes, "lrrrrr"), end="")
    print("\nEvery ratio is the median of per-repeat ratios, the runtimes interleaved step by step with eager PyTorch.")
    print("Load average while measuring: " + "; ".join(f"{r['model']}: {r['load_average']}" for r in results))
    print("\n## Inference latency (median ms; ratio to eager PyTorch)\n")
    inference = []
    for r in results:
        for name, by in r["inference_ms"].items():
            one, big = by[1], by[batch]
            times = [f"{one['ms']:.3f}", f"{one['ratio']:.2f}", f"{big['ms']:.2f}", f"{big['ratio']:.2f}"]
            inference.append([r["model"], name, *times])
    header = ["model", "runtime", "batch 1", "x", f"batch {batch}", "x"]
    print(markdown_table(header, inference, "llrrrr"), end="")
    print(f"\n## Training step, batch {batch}, FedNTD loss, momentum SGD (median ms; ratio to eager PyTorch)\n")
    steps = [
        [r["model"], name, f"{t['ms']:.2f}", f"{t['ratio']:.2f}"]
        for r in results
        for name, t in r["train_step"].items()
    ]
    print(
        markdown_table(["model", "runtime", "ms per step", "x eager"], steps, "llrr"),
        end="",
    )
    if not any("ONNX Runtime training" in r["train_step"] for r in results):
        print("\n(ONNX Runtime training not measured: its environment is missing; `make ort-training` installs it.)")
    if fl is not None:
        c = fl["config"]
        print(
            f"\n## FedNTD, {c['clients']} clients, {c['rounds']} rounds of {c['local_epochs']} local epochs on "
            f"{c['dataset']} ({fl['model']}; ExecuTorch export + check {fl['export_and_check_s']:.0f} s, not in wall)\n"
        )
        runs = [
            [name, " ".join(f"{a:.4f}" for a in run["accuracy"]), f"{run['wall_s']:.1f}"]
            for name, run in fl["runs"].items()
        ]
        print(markdown_table(["clients", "accuracy per round", "wall s"], runs, "llr"), end="")
        print(f"\nlargest difference between the final global models: {fl['max_global_weight_diff']:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["fedavg_cnn", "dsfl_mnist_cnn"])
    p.add_argument("--batch", type=int, default=50, help="batch of the training step and of batched inference")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fl-dataset", default="digits", help="dataset of the FedNTD comparison ('none' to skip)")
    p.add_argument("--fl-data-dir", default=None)
    p.add_argument("--fl-model", default=None, help="model of the FedNTD comparison (default: the dataset's)")
    p.add_argument("--fl-rounds", type=int, default=10)
    p.add_argument("--fl-epochs", type=int, default=3, help="local epochs per round (FedNTD's default)")
    p.add_argument("--fl-clients", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(args.threads)  # XNNPACK's thread pool (portable kernels are single-threaded)

    results = []
    for name in args.models:
        shape = tuple(example_input(name, batch=1).shape[1:])
        spec = ModelSpec(name, shape, 2 if name == "imdb_lstm" else 10)
        results.append(bench_model(spec, args.batch, args.repeats, args.threads))
    fl = None
    if args.fl_dataset != "none":
        fl = fl_accuracy(args)
    print_report(results, fl, args.batch, args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps({"models": results, "fedntd": fl}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
