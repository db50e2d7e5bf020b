"""Serving a model directory's own ONNX graph, without PyTorch and without an export record.

The model hub ships many sentence-transformers models with their transformer as ONNX
(``onnx/model.onnx``) beside ``tokenizer.json``, ``modules.json`` and the pooling module's
``1_Pooling/config.json``. The install without PyTorch serves such a directory as it is:
the graph gives token vectors, pooled here in numpy as sentence-transformers' ``Pooling``
pools right-padded batches; the trailing ``Normalize`` is the engine's, as on every path.

Unlike a record (record.py), nothing here was compared with PyTorch's outputs: the graph is
whatever the directory ships, and the startup line says so. A pipeline with any other module
(a ``Dense`` layer, say) is refused: its weights are PyTorch's to compute.

>>> rows = np.array([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]], dtype=np.float32)
>>> mask = np.array([[1, 1, 0]])
>>> pool(rows, mask, ("mean", "max", "cls", "lasttoken")).tolist()
[[2.0, 3.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..settings import Settings
from . import runtime
from .encoder import ModelInfo, model_name
from .lean import LeanEncoder, threads_for
from .tokenizer import tokenizer_from_json

# sentence-transformers' pooling modes, in the order it concatenates the legacy flags
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "lasttoken"}
_SERVED_MODULES = ("Transformer", "Pooling", "Normalize")


class Unservable(ValueError):
    """This directory cannot be served from its own graph; the message says why."""


class DirectoryEncoder(LeanEncoder):
    """An embedding model served from its directory's ONNX graph, pooled in numpy.

    Example (``path`` holds ``onnx/model.onnx``, ``tokenizer.json`` and the pooling config)::

        enc = open_directory(Settings(model=str(path)))
        rows = enc.encode([enc.wrap(ids) for ids in enc.tokenize(["a text"])])
    """

    def __init__(self, graph: Path, tokenizer: str, pad_id: int, session: Any,
                 info: ModelInfo, modes: tuple[str, ...]) -> None:
        # LeanEncoder's attributes, read from the directory instead of a record
        self._text = tokenizer
        self._use_tokenizer(tokenizer_from_json(tokenizer))
        self._pad_id = pad_id
        self._token_types = "token_type_ids" in {i.name for i in session.get_inputs()}
        self._session = session
        self.graph = graph
        self.probe_inputs = []
        self.info = info
        self.modes = modes
        found = runtime.token_output(session)
        if found is None:
            raise Unservable(f"{graph} has no output of token vectors")
        self.output = found
        self.encode_tokens = self._encode_tokens

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        feeds = self.features(batch)
        tokens = runtime.run_sliced(self._session, self.output, feeds)
        return pool(tokens, feeds["attention_mask"], self.modes)

    def _encode_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        rows = runtime.run_sliced(self._session, self.output, self.features(batch))
        return [rows[row, : len(ids)] for row, ids in enumerate(batch)]


def pool(tokens: np.ndarray, mask: np.ndarray, modes: tuple[str, ...]) -> np.ndarray:
    """sentence-transformers' ``Pooling`` of right-padded ``tokens`` (batch, sequence, dim)
    under ``mask``: each mode's rows, concatenated in ``modes``' order (float32)."""
    tokens = tokens.astype(np.float32, copy=False)
    weight = mask[:, :, None].astype(np.float32)
    lengths = mask.sum(axis=1)
    count = np.maximum(weight.sum(axis=1), 1e-9)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(tokens[:, 0])
        elif mode == "max":
            parts.append(np.where(weight > 0, tokens, -np.inf).max(axis=1))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (tokens * weight).sum(axis=1)
            parts.append(total / (count if mode == "mean" else np.sqrt(count)))
        elif mode == "weightedmean":
            weighted = weight * np.arange(1, tokens.shape[1] + 1, dtype=np.float32)[None, :, None]
            parts.append((tokens * weighted).sum(axis=1) / np.maximum(weighted.sum(axis=1), 1e-9))
        else:  # lasttoken
            parts.append(tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)])
    return np.concatenate(parts, axis=1).astype(np.float32, copy=False)


def open_directory(settings: Settings, directory: Path) -> DirectoryEncoder:
    """The encoder of the ONNX graph that ``directory`` (MODEL) ships; Unservable if it
    ships none, or its pipeline is more than a transformer and pooling."""
    graph = runtime.shipped_graph(directory)
    if graph is None:
        raise Unservable(f"{directory} ships no ONNX graph ({' or '.join(runtime.SHIPPED_GRAPHS)})")
    if settings.quantize != "none":
        raise Unservable(f"QUANTIZE={settings.quantize} serves from an export record; a model "
                         "directory's own graph serves float32")
    if not (directory / "tokenizer.json").is_file():
        raise Unservable(f"{directory} has no tokenizer.json")
    modes, config = _pooling(directory)
    tokenizer = (directory / "tokenizer.json").read_text(encoding="utf-8")
    session = runtime.session(graph, threads_for(settings))
    tok = tokenizer_from_json(tokenizer)
    info = ModelInfo(
        name=model_name(settings.model), dimension=_dimension(config, session) * len(modes),
        max_input_tokens=_max_tokens(directory), device="cpu", dtype="float32",
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
        size_bytes=graph.stat().st_size, prompts=_prompts(directory),
        pooling=("last_token" if modes[0] == "lasttoken" else modes[0]) if len(modes) == 1
        else None, backend="onnx")
    return DirectoryEncoder(graph, tokenizer, _pad_id(directory, tok), session, info, modes)


def startup_line(encoder: DirectoryEncoder) -> str:
    threads = encoder._session.get_session_options().intra_op_num_threads
    return (f"backend: ONNX Runtime float32 on the CPU without PyTorch, {threads} intra-op "
            f"threads, the model directory's own graph {encoder.graph} with "
            f"{'+'.join(encoder.modes)} pooling (no export record: no PyTorch evidence was "
            "checked; `embedsvc export` where the torch extra is installed makes one)")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Unservable(f"{path} does not read ({exc})") from None


def _pooling(directory: Path) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The pooling modes of the pipeline in ``modules.json`` (mean for a plain transformer,
    as sentence-transformers adds it) and the pooling module's config."""
    modules = _read(directory / "modules.json")
    if modules is None:
        return ("mean",), {}
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if [k for k in kinds if k not in _SERVED_MODULES] or kinds[:2] != ["Transformer", "Pooling"]:
        raise Unservable(f"its pipeline is {' -> '.join(kinds)}: this install serves a "
                         "Transformer and Pooling (and Normalize) from a directory's graph")
    config = _read(directory / str(modules[1].get("path", "")) / "config.json") or {}
    mode = config.get("pooling_mode") or tuple(
        m for key, m in _LEGACY_MODES.items() if config.get(key)) or ("mean",)
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    if not set(modes) <= set(_LEGACY_MODES.values()):
        raise Unservable(f"its pooling mode {modes} is not one of sentence-transformers'")
    return modes, config


def _dimension(config: dict[str, Any], session: Any) -> int:
    """The width of one token vector: the pooling config's, else the graph's."""
    found = config.get("embedding_dimension") or config.get("word_embedding_dimension")
    if found:
        return int(found)
    name = runtime.token_output(session)
    width = next((o.shape[-1] for o in session.get_outputs() if o.name == name), None)
    if not isinstance(width, int):
        raise Unservable("its graph's token vectors have no fixed width, and the pooling "
                         "config states none (word_embedding_dimension)")
    return width


def _max_tokens(directory: Path) -> int:
    """sentence-transformers' ``max_seq_length``: its own config's (``max_seq_length``), else
    the tokenizer's ``model_max_length``, else the model's ``max_position_embeddings``."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"),
                      ("tokenizer_config.json", "model_max_length"),
                      ("config.json", "max_position_embeddings")):
        limit = (_read(directory / name) or {}).get(key)
        if isinstance(limit, int | float) and 0 < limit < 1e6:  # 1e30: transformers' "none"
            return int(limit)
    raise Unservable("it states no input limit (max_seq_length in sentence_bert_config.json)")


def _prompts(directory: Path) -> dict[str, str]:
    prompts = (_read(directory / "config_sentence_transformers.json") or {}).get("prompts")
    return {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}


def _pad_id(directory: Path, tok: Any) -> int:
    """The pad token's id, as transformers' tokenizer reads it (RoBERTa-like models compute
    positions from it, so it matters beyond the mask)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = (_read(directory / name) or {}).get("pad_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            return int(tok.token_to_id(token))
    return int((_read(directory / "config.json") or {}).get("pad_token_id") or 0)
