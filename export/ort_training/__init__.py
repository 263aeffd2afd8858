"""ONNX Runtime training artifacts: the model and its loss as an ONNX graph, with ORT's gradient graph added.

Runs in the separate ``.venv-ort-training`` (``make ort-training``: onnxruntime-training 1.19.2, onnx 1.17.0, torch);
the device side is :mod:`edge_client.backends.ort_training`.

**The graph** (:mod:`.graph`). :class:`~.graph.TrainingGraph` is the module exported: ``(x, y, *objective inputs,
*anchors, *bn stats) -> (loss, logits, *new bn stats)``. The loss is the registered objective's own code
(:meth:`Objective.loss`, what eager clients run) plus FedProx's ``mu/2 ||w - anchor||^2`` when the artifacts have one,
so every objective (``ce``, ``ntd``, ``lsd``, ``soft``, ``fd``) goes through the same path as the ExecuTorch training
programs. It is exported by torch's TorchScript-based ONNX exporter (opset 17, training mode, no constant folding,
dynamic batch), which needs no onnxscript and keeps the parameters as initializers named ``model.<state-dict name>``.

**The artifacts** (:mod:`.artifacts`). ``onnxruntime.training.artifacts.generate_artifacts`` then adds the gradient
graph; its custom ``onnxblock`` loss block takes the graph's own ``loss`` output as the loss rather than building a
second one from the logits. ORT's gradient of ``SoftmaxCrossEntropyLoss`` (what ``F.cross_entropy`` exports to) reads
the node's optional second output, which the exporter omits, so it is added before.

**Batch norm.** ORT training keeps no mutable buffers: the gradient graph has no way to hand updated running
statistics back. So, as in the ExecuTorch programs, the running statistics are graph inputs and their updated
values graph outputs: each ``BatchNorm`` layer is swapped for :class:`~.graph.StatBatchNorm` (same parameters),
which normalizes with the batch statistics and computes the new running mean and unbiased variance as
``nn.BatchNorm`` does (momentum 0.1). The eval model (``eval_model.onnx``, exported from the same layers in eval mode
and sharing the parameters) normalizes with the running statistics passed in.

**The optimizer** is not in the artifacts: ORT's SGD has no momentum, so the client applies ``torch.optim.SGD``'s
update on the host from the gradients ORT exposes (:class:`edge_client.backends.ort_training.OrtTrainer`).

**Parity** (:mod:`.check`, :mod:`.cache`). :func:`~.check.check_artifacts` runs the gates of :mod:`export.gates`
(each step against a float64 step from the same weights, free-running steps with momentum and weight decay on
real-looking data against eager float64 within eager float32's own spread, then eval logits of the trained weights);
:class:`~.cache.ArtifactCache` makes, checks and caches artifacts for a client before it says hello.

**Speed** (:mod:`.timing`): step times against eager PyTorch, also from another environment. **Command line**
(:mod:`.cli`): ``python -m export.ort_training [generate|check|bench]``.
"""
