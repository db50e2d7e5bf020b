"""The model: the ``Encoder`` interface and the encoders behind it, the device, the model
kinds, the token window, and the runtimes that compute (PyTorch, ONNX Runtime, and ONNX
Runtime without PyTorch from an export record: export.py, record.py, lean.py)."""
