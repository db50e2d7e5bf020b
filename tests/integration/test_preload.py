import subprocess
import sys


def test_loading_weights_for_a_preforking_master_never_touches_cuda():
    """What a `gunicorn --preload` master runs: the real model loads with CUDA untouched."""
    code = """
import torch
calls = []
for name in ("is_available", "device_count", "_lazy_init", "init", "current_device"):
    setattr(torch.cuda, name, lambda *a, _n=name: calls.append(_n))
from embedsvc.model.st_encoder import SentenceTransformerEncoder
enc = SentenceTransformerEncoder.load("")
assert enc.info.dimension == 384, enc.info
assert calls == [], calls
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
