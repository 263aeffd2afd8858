"""Parity gates: an export is used or distributed only if it computes what eager PyTorch computes.

- Logits (:mod:`.logits`): the runtime's logits against the eager model's on the same inputs, at two batch sizes (1
  and 5, neither the export's example batch, so the dynamic batch dimension is exercised), difference below 1e-5.
- Training programs: each step from the same weights against eager float64's step (:mod:`.stepwise`, what measures
  the program's arithmetic), and the weights after several free-running SGD steps with momentum and weight decay on
  real-looking data (:mod:`.inputs`) at the batch size the program runs at against eager float64, within the spread
  of eager float32 under fedge's layouts and thread counts (:mod:`.drift`). This is what catches wrong gradients (the
  ExecuTorch 1.4.1 max-pool backward bug) and imprecise kernels (the portable batch-norm variance), which random
  inputs at a small batch size do not show. The eager references both measure against are in :mod:`.reference`.
- The gate of each export kind, on bytes or a file (:mod:`.check`); ONNX Runtime training artifacts have theirs in
  :mod:`export.ort_training.check`.

"Difference" is ``|a - b| / max(1, |b|)`` elementwise (:class:`.report.ParityReport`): absolute up to 1, relative
above. A failing check raises :class:`fedge.errors.ExportError` that names the export, the check, the measured
difference, where it was largest and the tolerance (:func:`.report.require`).
"""
