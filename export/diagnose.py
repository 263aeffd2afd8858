"""When an export fails: which layer of the model cannot be lowered, in one line, and what to do about it.

torch.export (the front end of both the ONNX and the ExecuTorch exporter) reports a failure as pages of graph and
trace naming an op, not the user's layer. :func:`explain_export_failure` records each submodule's inputs in one eager
forward, exports the submodules on their own, and names the innermost one that fails: the layer to rewrite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Probe = Callable[[nn.Module, tuple[Any, ...]], object]
"""Exports one module for the recorded positional inputs; raises when it cannot."""

ADVICE = (
    "rewrite its forward with ops torch.export can trace (no Python branch or loop on tensor values, no .item(), "
    ".tolist() or numpy, no in-place change of an input), or keep this model on the torch runtime "
    "(fedge client --runtime torch, the default)"
)


def _front_end(module: nn.Module, args: tuple[Any, ...]) -> object:
    return torch.export.export(module, args, strict=False)


def failing_layer(model: nn.Module, example: torch.Tensor, probe: Probe = _front_end) -> tuple[str, str, str] | None:
    """``(dotted name, class name, first line of its error)`` of the innermost submodule that ``probe`` fails on, in
    forward order; None when every submodule exports alone (the failure is in the model's own forward)."""
    inputs: dict[str, tuple[Any, ...]] = {}

    def recorder(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def record(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:  # None: the output is kept
            inputs.setdefault(name, args)

        return record

    handles = [module.register_forward_hook(recorder(name)) for name, module in model.named_modules() if name]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example)
    except Exception:  # the eager forward fails itself: nothing to localize here
        return None
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    modules = dict(model.named_modules())
    failures: dict[str, str] = {}
    for name, args in inputs.items():  # forward order (hooks fire after a module's children: innermost first)
        try:
            probe(modules[name], args)
        except Exception as exc:
            failures[name] = f"{type(exc).__name__}: {_first_line(exc)}"
    for name, error in failures.items():
        if not any(other.startswith(name + ".") for other in failures):  # no failing submodule of its own
            return name, type(modules[name]).__name__, error
    return None


def explain_export_failure(what: str, model: nn.Module, example: torch.Tensor, exc: BaseException) -> str:
    """One line for a failed export ``what`` (e.g. "ONNX export of wine_mlp"): the layer, its error, the advice."""
    found = failing_layer(model, example)
    if found is None:
        return f"{what} failed: {_first_line(exc)}; if the model's own forward is the cause, {ADVICE}"
    name, kind, error = found
    return f"{what} failed: layer {name!r} ({kind}) cannot be lowered ({error}); {ADVICE}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."
