"""export.edge_passes: the rewritten edge program computes bit for bit what the original computes, with fewer copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim

pytest.importorskip("executorch")

from executorch.exir import EdgeCompileConfig, to_edge
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

from export.edge_passes import alias_copies_removed, permutes_as_strided_copies


class _Permutes(nn.Module):
    """Permutes of a batch-dynamic tensor (NCHW -> NHWC, a 2-D transpose), a detach (an alias) and a returned one."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nhwc = (x * 2.0).permute(0, 2, 3, 1)  # (N, H, W, C)
        flat = nhwc.reshape(-1, 3)
        mask = torch.relu(flat.detach())  # detach -> alias_copy, read by a multiplication
        out = torch.mm(flat * mask, self.weight.t())  # weight.t() -> a permute of a static tensor
        return out.t().contiguous(), (out * 1.0).detach(), mask  # a transpose with a symbolic size; an output alias


def _targets(manager: object) -> list[str]:
    graph = manager.exported_program().graph  # type: ignore[attr-defined]
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_the_passes_remove_permute_and_alias_copies_and_keep_every_output_bit_for_bit() -> None:
    model = _Permutes()
    ep = torch.export.export(model, (torch.randn(2, 3, 4, 6),), dynamic_shapes={"x": {0: Dim("batch", max=16)}})
    plain = to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    rewritten = copy.deepcopy(plain).transform([permutes_as_strided_copies, alias_copies_removed])
    before, after = _targets(plain), _targets(rewritten)
    assert sum("permute_copy" in t for t in before) == 3
    assert not any("permute_copy" in t for t in after)
    assert sum("as_strided_copy" in t for t in after) == 3
    aliases = sum("alias_copy" in t for t in before)
    assert aliases >= 2 and sum("alias_copy" in t for t in after) == 1  # only the returned one stays
    buffers = [bytes(m.to_executorch().buffer) for m in (plain, rewritten)]  # kept alive while the programs run
    programs = [_load_for_executorch_from_buffer(b) for b in buffers]
    for batch in (1, 5, 16):  # other batch sizes than the example: the symbolic sizes are read at run time
        xb = torch.randn(batch, 3, 4, 6)
        expected, got = (p.run_method("forward", (xb,)) for p in programs)
        with torch.no_grad():
            eager = model(xb)
        for e, g, ref in zip(expected, got, eager, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)  # copies are exact: the same bits
            torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)


def test_export_training_faster_copies_changes_the_program_and_not_its_step() -> None:
    # tiny_mlp: its linear layers' transposes are permutes; quick to export twice (the convolution and pooling
    # operators behind the flag are tested in test_lowering.py).
    from edge_client.backends.runners import PteTrainer
    from export.executorch import export_training
    from fedge.algorithms.fedavg import CrossEntropy
    from fedge.learning.models import exchanged_state
    from fedge.learning.training import SGDSettings, TrainRequest
    from fedge.programs.spec import ModelSpec, TrainingLoss

    spec = ModelSpec("tiny_mlp", (1, 8, 8), 10)
    model = spec.build(seed=0)
    weights = exchanged_state(model)
    loss = TrainingLoss(CrossEntropy())
    programs = {fast: export_training(model, spec, loss, max_batch=16, faster_copies=fast) for fast in (True, False)}
    assert programs[True] != programs[False]
    x, y = spec.example(12, seed=1), torch.arange(12) % 10
    request = TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.05), 1, 12, 0)
    after = {}
    for fast, data in programs.items():
        trainer = PteTrainer(data)
        trainer.set_weights(weights)
        trainer.step(trainer.optimizer(request.sgd), trainer.step_inputs(request, torch.arange(12)))
        after[fast] = trainer.get_weights()
    for k, v in after[False].items():
        torch.testing.assert_close(after[True][k], v, rtol=1e-5, atol=1e-6, msg=k)
