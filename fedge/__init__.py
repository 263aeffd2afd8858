"""fedge: federated learning for edge devices.

The ``fedge`` package is the pure core shared by every role: models, datasets and partitioners, losses, algorithms,
the wire codec, byte accounting and metrics. It does no network I/O and keeps no global state; randomness is passed
in as seeds or generators. The roles live beside it: ``coordinator/``, ``edge_client/``, ``export/`` and ``sim/``.
"""

__version__ = "0.1.0"
