"""Exports of fedge models for device runtimes: ONNX, ExecuTorch inference and training programs, and parity checks.

- :mod:`export.program`: what an export is (the description embedded in every file, state-dict name mapping);
- :mod:`export.onnx`, :mod:`export.executorch`: the exporters;
- :mod:`export.runners`: running exports on ONNX Runtime and ExecuTorch (what the edge-client backends use);
- :mod:`export.parity`: the checks every export must pass before it is used or distributed;
- :mod:`export.cli`: ``fedge export`` and ``fedge export check``.

See docs/on_device.md.
"""
