"""Rewrites of an ExecuTorch edge program that keep what it computes and make its copies cheaper.

ExecuTorch 1.4.1's portable ``permute_copy`` computes a source index per element (5-8 ns per element on one core
of the project's machine, measured on a (39200, 32) transpose and an NCHW -> NHWC permute of 1.25M floats), while
``as_strided_copy`` walks the source with fixed strides (0.9-2.1 ns per element on the same tensors). A permutation
of a dense tensor *is* a strided read of it: ``permute(x, dims)`` equals ``as_strided(x, [x.size(d) for d in dims],
[x.stride(d) for d in dims])`` when ``x`` is dense in the default (contiguous) dim order, which every tensor of an
edge program is unless its dim order says otherwise. :func:`permutes_as_strided_copies` makes that substitution on
the final graph, so it also reaches the transposes autograd writes into a training program's backward pass (the
weight gradient of every ``mm``), which model code cannot touch.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

__all__ = ["alias_copies_removed", "permutes_as_strided_copies"]


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _static(value: object) -> int | None:
    """``value`` as a Python int if it is one (not a symbolic size), else None."""
    return value if isinstance(value, int) else None


def permutes_as_strided_copies(graph_module: fx.GraphModule) -> PassResult:
    """Replace each ``permute_copy`` of a contiguous tensor with the equivalent ``as_strided_copy``.

    A permute is left alone when its input is not in the default dim order, or when a stride would depend on a
    symbolic size (a dynamic dimension that is not the outermost one): the rewrite needs the strides as constants.
    Output sizes may be symbolic; they are read from the input with ``sym_size`` at run time, as the exporter does.
    """
    from executorch.exir.dialects._ops import ops as exir_ops

    permute = exir_ops.edge.aten.permute_copy.default
    as_strided = exir_ops.edge.aten.as_strided_copy.default
    changed = False
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != permute:
            continue
        source, dims = node.args[0], [int(d) for d in node.args[1]]
        value = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(value, torch.Tensor) or not value.is_contiguous():
            continue
        dim_order = getattr(value, "dim_order", None)
        if dim_order is not None and list(dim_order()) != list(range(value.dim())):
            continue
        shape = tuple(value.shape)
        static_tail = [_static(s) for s in shape[1:]]
        if any(s is None for s in static_tail):
            continue  # a stride would be symbolic
        strides = _contiguous_strides((1, *(s for s in static_tail if s is not None)))  # stride 0 is the tail's size
        sizes: list[object] = []
        with graph.inserting_before(node):
            for d in dims:
                size = _static(shape[d])
                if size is None:
                    size_node = graph.call_function(torch.ops.aten.sym_size.int, (source, d))
                    size_node.meta["val"] = shape[d]
                    sizes.append(size_node)
                else:
                    sizes.append(size)
        node.target = as_strided
        node.args = (source, sizes, [strides[d] for d in dims])
        node.kwargs = {}
        changed = True
    if changed:
        graph.lint()
        graph_module.recompile()
    return PassResult(graph_module, changed)


def alias_copies_removed(graph_module: fx.GraphModule) -> PassResult:
    """Read the source of an ``alias_copy`` instead of the copy, where the copy is not a graph output.

    ``detach`` (the masks of the lowered ReLU and max pooling) and the outputs of custom operators become
    ``alias_copy`` in an edge program, and ExecuTorch runs each as a real copy (a 7.84M-element one for fedavg_cnn's
    saved patches). The graph is functional: nothing writes to either tensor afterwards, so every reader can take
    the source. A copy that is itself returned stays, so that no two outputs share memory.
    """
    from executorch.exir.dialects._ops import ops as exir_ops

    alias = exir_ops.edge.aten.alias_copy.default
    changed = False
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != alias:
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        graph_module.recompile()
    return PassResult(graph_module, changed)
