"""Export (with PyTorch) the record that lean.py serves without it (see record.py).

The whole sentence-transformers pipeline goes into one graph: the transformer, then pooling,
Dense layers and the like as the model's own modules compute them (the trailing Normalize is
left to the engine, as for PyTorch); a cross-encoder's logits; SPLADE's MLM head, log1p(relu)
and max pooling over the mask. Exporting the modules themselves, rather than re-implementing
each pooling mode and layer in numpy, keeps one definition of what the model computes; the
cost is the same: on all-MiniLM-L6-v2, a batch of 32 took as long through the whole graph as
through the transformer's graph plus numpy mean pooling, within this loaded machine's noise
(bench/RESULTS.md, cold start).

The graph is traced on one batch and checked on the probe batch, of another shape, against
PyTorch's outputs: a module whose trace fixed a shape fails there, and its model gets a
record that says it cannot be served this way, and why.
"""

from __future__ import annotations

import copy
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .lean import activation_names, open_record
from .onnx_backend import OPSET, OnnxUnavailable, _check_exportable
from .record import GRAPH, PROBE, TOKENIZER, RecordError, describe_file, write_record
from .scorer import CrossEncoderScorer
from .sparse import SparseEmbedder
from .st_encoder import SentenceTransformerEncoder

log = logging.getLogger(__name__)

# The record's weights of more than HALF_FROM values are stored as float16, each followed by a
# Cast to float32 under its old name: ONNX Runtime folds the casts when it builds the session,
# so the graph computes in float32 as before, on weights rounded to float16's 11 bits. That
# halves the record (all-MiniLM-L6-v2's: 87 to 44 MiB), which the install without PyTorch
# carries beside its packages (bench/RESULTS.md, issue 39). Biases and LayerNorm weights
# stay float32: they weigh little. The probe decides: a model whose outputs the rounded
# weights do not reproduce to record.TOLERANCE and PARITY keeps them as float32.
HALF_FROM = 1000
HALF_ERROR = 1e-3  # float16 rounds by at most 2**-11 (4.9e-4) of a value in its normal range

# The probe: shapes unlike the trace's, padding, a pair for cross-encoders, non-ASCII text.
_TRACE = ["trace", "a second trace text"]
_PROBE = ["a probe", "a longer probe sentence, so that the batch holds padding", "x",
          "Ein Satz mit Umlauten: äöü, und 東京."]
_PAIRS: list[Any] = [["a query", "a document that answers the query at some length"],
                     "a text alone", ["x", "y"]]


def build_record(encoder: SentenceTransformerEncoder, key: str, path: Path,
                 kind_setting: str = "auto") -> None:
    """Write the record of ``encoder`` (on the CPU, float32, loaded with KIND
    ``kind_setting``) into the new directory ``path``: a servable one, or one that says why
    this model cannot be served without PyTorch."""
    path.mkdir()
    reason = _unexpressible(encoder)
    if reason is None:
        try:
            _write(encoder, {"fingerprint": key, "kind_setting": kind_setting}, path)
        except RecordError as exc:
            reason = f"its ONNX export does not reproduce PyTorch's outputs ({exc})"
        except Exception as exc:  # noqa: BLE001 - any failure: this model takes PyTorch's path
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            reason = f"its pipeline does not export to ONNX ({type(exc).__name__}: {first})"
    if reason is not None:
        for child in path.iterdir():
            child.unlink() if child.is_file() else shutil.rmtree(child)
        write_record(path, {"fingerprint": key, "kind_setting": kind_setting, "lean": False,
                            "reason": reason})


def _unexpressible(encoder: SentenceTransformerEncoder) -> str | None:
    try:
        _check_exportable(encoder)
    except OnnxUnavailable as exc:
        return str(exc)
    if isinstance(encoder, CrossEncoderScorer):
        name = type(encoder._activation).__name__
        if name not in activation_names():
            return (f"its activation is {name}; this path computes "
                    f"{', '.join(activation_names())}")
    return None


def _write(encoder: SentenceTransformerEncoder, names: dict[str, str], path: Path) -> None:
    inputs = _PAIRS if isinstance(encoder, CrossEncoderScorer) else _PROBE
    batch = _batch(encoder, inputs)
    outputs = _outputs(encoder)
    probe = _torch_outputs(encoder, batch, outputs)
    _export_graph(encoder, outputs, path / GRAPH)
    np.savez(path / PROBE, **probe)  # type: ignore[arg-type]  # numpy's stub types allow_pickle only
    encoder._tokenizer.save(str(path / TOKENIZER))
    _store(path, {
        **names, "lean": True, "kind": encoder.kind,
        "info": _info(encoder),
        "tokenizer": {"pad_id": encoder._pad_id, "token_types": encoder._with_token_types,
                      "prefix": encoder._prefix, "suffix": encoder._suffix,
                      "truncate_at": encoder.info.max_input_tokens},
        "pipeline": {"modules": [repr(m) for m in encoder._model],
                     "graph_computes": [type(m).__name__ for m in encoder._modules],
                     "inputs": encoder.input_names, "outputs": outputs,
                     "activation": _activation(encoder),
                     "max_active_dims": getattr(encoder, "max_active_dims", None)},
        "probe": {"inputs": inputs, "ids": [list(ids) for ids in batch]},
    })


def _store(path: Path, fields: dict[str, Any]) -> None:
    """Write ``record.json`` with ``fields`` over the graph that ``path`` holds, its weights
    stored as float16 where the probe allows it (``half_weights``), else as exported;
    RecordError when not even that reproduces PyTorch's outputs."""
    import onnx

    exported = onnx.load(str(path / GRAPH))
    half, count = half_weights(exported)
    for storage, graph in (("float16", half), ("float32", exported)):
        if storage == "float16" and not count:
            continue
        onnx.save(graph, str(path / GRAPH))
        write_record(path, {**fields, "weights": storage, "files": {
            name: describe_file(path / name) for name in (GRAPH, TOKENIZER, PROBE)}})
        if not reproduces(path, storage, fields["info"]["name"]):
            continue
        which = f" ({count} tensors of more than {HALF_FROM} values)" if graph is half else ""
        log.info("exported %s: weights stored as %s%s, computed in float32; %s %.1f MiB",
                 fields["info"]["name"], storage, which, GRAPH,
                 (path / GRAPH).stat().st_size / 2**20)
        return


def reproduces(path: Path, storage: str, name: str) -> bool:
    """Whether the record written at ``path`` gives PyTorch's probe outputs: False (said in
    one line) for float16 weights that miss them, RecordError for float32 ones."""
    try:
        open_record(path, threads=1)  # what the export gives must be what PyTorch gives
    except RecordError as exc:
        if storage == "float32":
            raise
        log.info("exported %s: its float16 weights miss PyTorch's probe outputs (%s); "
                 "storing them as float32", name, exc)
        return False
    return True


def half_weights(model: Any) -> tuple[Any, int]:
    """A copy of the ONNX ``model`` whose float32 initializers of more than HALF_FROM values
    are float16, each cast back to float32 under its own name, and how many it converted;
    a tensor float16 does not hold to HALF_ERROR of its largest value stays float32."""
    from onnx import TensorProto, helper, numpy_helper

    half = copy.deepcopy(model)
    graph = half.graph
    inputs = {i.name for i in graph.input}  # an initializer a caller may override stays
    initializers, casts = [], []
    for tensor in graph.initializer:
        values = (numpy_helper.to_array(tensor) if tensor.data_type == TensorProto.FLOAT
                  and np.prod(tensor.dims) > HALF_FROM and tensor.name not in inputs else None)
        rounded = None if values is None else _rounded(values)
        if rounded is None:
            initializers.append(tensor)
            continue
        initializers.append(numpy_helper.from_array(rounded, f"{tensor.name}.float16"))
        casts.append(helper.make_node("Cast", [f"{tensor.name}.float16"], [tensor.name],
                                      to=TensorProto.FLOAT, name=f"{tensor.name}.float32"))
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    nodes = [*casts, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    return half, len(casts)


def _rounded(values: np.ndarray) -> np.ndarray | None:
    """``values`` as float16, or None where they do not hold there (past 65,504, or rounded
    by more than HALF_ERROR of the largest value: an embedding table's rows that the probe
    does not reach would otherwise go unchecked)."""
    with np.errstate(over="ignore"):
        rounded = values.astype(np.float16)
    scale = float(np.abs(values).max(initial=0.0))
    error = np.abs(rounded.astype(np.float32) - values).max(initial=0.0)
    return rounded if np.isfinite(rounded).all() and error <= HALF_ERROR * scale else None


def _batch(encoder: SentenceTransformerEncoder, inputs: list[Any]) -> list[list[int]]:
    if isinstance(encoder, CrossEncoderScorer):
        return list(encoder.tokenize_sequences(
            [tuple(i) if isinstance(i, list) else i for i in inputs], None))
    return [encoder.wrap(ids) for ids in encoder.tokenize(inputs)]


def _outputs(encoder: SentenceTransformerEncoder) -> list[str]:
    """The graph's outputs: what ``encode`` returns, and the token vectors of /embed_all
    (for embedding models: SPLADE's would be as wide as the vocabulary for every token)."""
    if isinstance(encoder, CrossEncoderScorer):
        return ["scores"]
    if isinstance(encoder, SparseEmbedder):
        return ["sentence_embedding"]
    return ["sentence_embedding", "token_embeddings"]


def _torch_outputs(encoder: SentenceTransformerEncoder, batch: list[list[int]],
                   outputs: list[str]) -> dict[str, np.ndarray]:
    import torch

    with torch.inference_mode():
        features = encoder.features(batch)
        for module in encoder._modules:
            features = module(features)
        probe = {name: features[name].float().cpu().numpy() for name in outputs}
    if isinstance(encoder, CrossEncoderScorer):
        probe["activated"] = encoder.activate(probe["scores"].reshape(len(batch), -1), raw=False)
        probe["scores"] = probe["scores"].reshape(len(batch), -1)
    return probe


def _export_graph(encoder: SentenceTransformerEncoder, outputs: list[str], path: Path) -> None:
    import torch

    names = encoder.input_names
    features = encoder.features(_batch(encoder, _trace_inputs(encoder)))
    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "token_embeddings"]}
    axes.update({name: {0: "batch"} for name in ("sentence_embedding", "scores")})
    graph = _Pipeline(encoder._modules, names, outputs, encoder)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer notes about shapes; the probe checks them
        torch.onnx.export(graph, tuple(features[n] for n in names), str(path),
                          input_names=names, output_names=outputs,
                          dynamic_axes={k: v for k, v in axes.items() if k in [*names, *outputs]},
                          opset_version=OPSET, dynamo=False)


def _trace_inputs(encoder: SentenceTransformerEncoder) -> list[Any]:
    return [["trace", "a second trace text"], "trace"] if isinstance(
        encoder, CrossEncoderScorer) else _TRACE


def _Pipeline(modules: list[Any], names: list[str], outputs: list[str],
              encoder: SentenceTransformerEncoder) -> Any:
    """The model's modules as one ``torch.nn.Module`` taking positional tensors."""
    import torch

    class Pipeline(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = torch.nn.ModuleList(modules)

        def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            features: dict[str, Any] = dict(zip(names, tensors, strict=True))
            features["modality"] = "text"
            for stage in self.stages:
                features = stage(features)
            if "scores" in outputs:
                features["scores"] = features["scores"].reshape(tensors[0].shape[0], -1)
            return tuple(features[name] for name in outputs)

    return Pipeline().eval()


def _info(encoder: SentenceTransformerEncoder) -> dict[str, Any]:
    info = encoder.info
    return {"name": info.name, "dimension": info.dimension,
            "max_input_tokens": info.max_input_tokens, "vocab_size": info.vocab_size,
            "parameters": info.parameters, "size_bytes": info.size_bytes,
            "prompts": info.prompts, "labels": list(info.labels), "pooling": info.pooling}


def _activation(encoder: SentenceTransformerEncoder) -> str | None:
    if isinstance(encoder, CrossEncoderScorer):
        return type(encoder._activation).__name__
    return None
