"""Exports of fedge models for device runtimes: ONNX, ExecuTorch inference and training programs, and parity checks."""
