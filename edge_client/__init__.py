"""The edge client: local data, a compute runtime (PyTorch, ExecuTorch, ONNX Runtime) and the client halves."""
