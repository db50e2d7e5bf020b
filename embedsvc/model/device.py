"""Which device and dtype serve: resolved once, in the process that serves."""

from __future__ import annotations

import importlib.util


def pytorch_installed() -> bool:
    """Whether the ``torch`` extra is installed (PyTorch and sentence-transformers), without
    importing either; an import hook that refuses them counts as not installed."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in ("torch", "sentence_transformers"))
    except ImportError:
        return False


def resolve_device(setting: str) -> str:
    """``auto`` -> cuda, then mps, then cpu. Call only in the process that will serve."""
    import torch

    if setting != "auto":
        if setting.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(
                f"DEVICE is {setting!r} but torch sees no CUDA device: check the driver and "
                "CUDA_VISIBLE_DEVICES, or set EMBEDSVC_DEVICE=cpu"
            )
        return setting
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def resolve_dtype(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "float16" if device.startswith("cuda") else "float32"
