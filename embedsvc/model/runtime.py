"""ONNX Runtime on the CPU, as both ONNX paths use it: sessions, sliced runs, vector quality.

Imports neither torch nor transformers: lean.py serves from it alone.

>>> a = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
>>> quality(a, a).min
1.0
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..settings import Settings
from .retrieval import K, recall

# Padded tokens per session run. ONNX Runtime on the CPU computes no faster in larger runs:
# per input, batch 128 of short sentences ran slower than batch 32 (331 against 362/s) and
# 256-token chunks ran at 18-19/s at every batch from 1 to 32. Served in one run
# (bench/RESULTS.md, 2026-12-01), 1,024 beat 2,048 on 32 clients x 1 input (0.85 of the
# offline rate against 0.79), 4 x 32 (1.18 against 1.06) and chunks (1.01 against 0.90),
# and a smaller run is a shorter wait for the device: a run of chunks takes about 0.2 s
# here, and the next client's batch waits for it. With MAX_BATCH_TOKENS at its default, the
# lean encoders cap the batcher's batches at it (``run_tokens``), so that the batcher, not a
# run of slices, decides what the device computes next; a larger batch (a MAX_BATCH_TOKENS
# that was set, bulk, the onnx-torch backend) runs in slices.
RUN_TOKENS = 1024
_DEFAULT_BATCH_TOKENS = Settings.__dataclass_fields__["max_batch_tokens"].default
# Where a model directory ships its transformer as ONNX (the model hub's layout for
# sentence-transformers models), and the names such a graph gives its token vectors.
SHIPPED_GRAPHS = ("onnx/model.onnx", "model.onnx")
TOKEN_OUTPUTS = ("token_embeddings", "last_hidden_state")


def shipped_graph(directory: Path) -> Path | None:
    """The ONNX graph a model directory ships, if any."""
    return next((directory / g for g in SHIPPED_GRAPHS if (directory / g).is_file()), None)


def token_output(session: Any) -> str | None:
    """The output of a transformer's graph that holds its token vectors (None: none)."""
    outputs = session.get_outputs()
    for wanted in TOKEN_OUTPUTS:
        if any(o.name == wanted for o in outputs):
            return wanted
    return next((o.name for o in outputs if len(o.shape) == 3), None)


class QualityBelowFloor(RuntimeError):
    """The int8 graph's vectors are too far from float32's to serve."""


@dataclass(frozen=True)
class Quality:
    """How one set of rows compares with another of the same ``texts``: ``recall``, the share
    of each text's 10 nearest others (by cosine) that it keeps; ``mean``, ``min``: the
    cosine of each row to its counterpart."""

    mean: float
    min: float
    texts: int
    recall: float


def session(path: Path, threads: int) -> Any:
    """An ONNX Runtime session on the CPU for the graph at ``path``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    # Idle pool threads would otherwise spin for the next batch, taking the cores that the
    # request threads need to parse, tokenize and answer (bench/RESULTS.md).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def run_tokens(info: Any, max_batch_tokens: int) -> int:
    """MAX_BATCH_TOKENS on ONNX Runtime's CPU: left at its default, RUN_TOKENS (never below
    one input at the model's limit); a value that was set is kept."""
    if max_batch_tokens != _DEFAULT_BATCH_TOKENS:
        return max_batch_tokens
    return max(info.max_input_tokens, min(max_batch_tokens, RUN_TOKENS))


def run_sliced(session: Any, output: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """``output`` of ``session`` on ``feeds``, run in slices of about RUN_TOKENS tokens."""
    rows, width = feeds["input_ids"].shape
    step = max(1, RUN_TOKENS // max(1, width))
    parts = [session.run([output], {k: v[i:i + step] for k, v in feeds.items()})[0]
             for i in range(0, rows, step)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter else os.cpu_count() or 1


def quality(reference: np.ndarray, got: np.ndarray) -> Quality:
    """``got`` against ``reference``: recall@10 of their neighbours, row-wise cosine."""
    a = reference / (np.linalg.norm(reference, axis=1, keepdims=True) + 1e-12)
    b = got / (np.linalg.norm(got, axis=1, keepdims=True) + 1e-12)
    cos = (a * b).sum(1)
    kept = recall(a @ a.T, b @ b.T) if len(a) > K else 1.0
    return Quality(float(cos.mean()), float(cos.min()), len(cos), kept)
