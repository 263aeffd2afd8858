"""Exports of fedge models for device runtimes: ONNX, ExecuTorch inference and training programs, and parity checks.

- :mod:`export.onnx`, :mod:`export.executorch`: the exporters (what an export is: :mod:`fedge.programs.spec`);
- :mod:`export.gates`: the checks every export must pass before it is used or distributed, run on the device-side
  runners of :mod:`edge_client.backends.runners`;
- :mod:`export.cache`: export-on-demand program directories for workstation clients;
- :mod:`export.cli`: ``fedge export`` and ``fedge export check``.

See docs/on_device.md.
"""
