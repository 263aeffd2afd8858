"""SIGTERM as an exception: :class:`Terminated`, which the ``fedge`` command's handler raises in the main thread.

A module of its own that imports nothing: the handler raises it wherever the main thread happens to be, in the middle
of an import too, so the handler must not import anything itself (an import begun inside a half-done one can meet
that module partially initialized and fail with an ImportError), and ``fedge status`` loads it without torch.
"""

from __future__ import annotations


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the ``fedge`` command's handler: a run stops as on Ctrl-C, cleanup
    included (a KeyboardInterrupt, so every ``except KeyboardInterrupt`` treats it alike)."""
