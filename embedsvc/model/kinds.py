"""What a model directory holds, and the encoder that serves it: one kind per process.

Kinds, as text-embeddings-inference serves them:

- ``embedding``: a sentence-transformers embedding model (``/embed``, ``/v1/embeddings``)
- ``reranker``: a cross-encoder with one output label (``/rerank``, ``/v1/rerank``)
- ``classifier``: a cross-encoder or sequence classifier with labels (``/predict``)
- ``sparse``: a sentence-transformers SparseEncoder such as SPLADE (``/embed_sparse``)
- ``image-text``: a CLIP or SigLIP model, texts and images into one space (``/v1/embeddings``
  and ``/v2/embed`` with images; served from its two-tower record, image_export.py)

Detection reads only the small config files sentence-transformers and transformers write:

0. ``config.json`` with a ``text_config`` and a ``vision_config``: an image-text model;
1. ``config_sentence_transformers.json`` ``model_type`` (written by sentence-transformers
   since v5): ``SentenceTransformer``, ``SparseEncoder`` or ``CrossEncoder``;
2. else ``modules.json`` (any sentence-transformers model): sparse when a module is one of
   SPLADE's (``SpladePooling``, ``MLMTransformer``, ...), otherwise an embedding model;
3. else ``config.json``: a ``...ForSequenceClassification`` architecture, or a
   ``sentence_transformers`` section (older CrossEncoder saves) is a cross-encoder; a
   ``...ForMaskedLM`` is read as SPLADE (the only reason to serve a bare masked LM);
4. anything else is an embedding model (sentence-transformers adds mean pooling).

A cross-encoder with one label is a reranker, with several a classifier. The ``KIND``
setting overrides all of this, within the model's head: a reranker or classifier needs a
cross-encoder's classification head and a sparse model SPLADE's (or a masked LM's), so
``KIND=reranker`` on an embedding model (which would serve a randomly initialised head) is
refused; ``KIND=embedding`` takes any model's transformer and pools it.

>>> KINDS
('embedding', 'reranker', 'classifier', 'sparse', 'image-text')
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .encoder import bundled
from .hub import check_fetchable
from .image_export import is_image_text
from .st_encoder import SentenceTransformerEncoder

log = logging.getLogger(__name__)

KINDS = ("embedding", "reranker", "classifier", "sparse", "image-text")
_SPARSE_MODULES = ("SpladePooling", "MLMTransformer", "SparseStaticEmbedding", "SparseAutoEncoder")
_ST_TYPES = {"SentenceTransformer": "embedding", "SparseEncoder": "sparse"}
# A saved model holds at least one of these (transformers' save_pretrained writes config.json,
# sentence-transformers' save also modules.json).
_MODEL_FILES = ("config_sentence_transformers.json", "modules.json", "config.json")

ReadJson = Callable[[str], "dict[str, Any] | list[Any] | None"]


# The head each kind computes with; KIND may choose among kinds of one head only.
_HEADS = {"embedding": "no", "reranker": "a classification", "classifier": "a classification",
          "sparse": "a masked-language-model", "image-text": "a vision tower and a text"}


class KindMismatch(ValueError):
    """KIND asks for a head that the model does not have."""


@dataclass(frozen=True)
class Detected:
    """A model's kind and the file that told it (for the startup log); ``certain``: a file
    names its head (not the fallback for a config without an architecture)."""

    kind: str
    reason: str
    certain: bool = True


def detect(model: str, read: ReadJson | None = None) -> Detected:
    """The kind of ``model`` (a directory or a hub id; empty: the bundled embedding model)."""
    if bundled(model):
        return Detected("embedding", "the bundled model")
    read = read or _reader(model)
    config = read("config.json")
    if isinstance(config, dict) and is_image_text(config):
        return Detected("image-text", f"config.json: {config.get('model_type')} with a "
                                      "text and a vision tower")
    st_config = read("config_sentence_transformers.json")
    model_type = st_config.get("model_type") if isinstance(st_config, dict) else None
    if model_type in _ST_TYPES:
        return Detected(_ST_TYPES[model_type], f"config_sentence_transformers.json: {model_type}")
    config = read("config.json")
    config = config if isinstance(config, dict) else {}
    if model_type == "CrossEncoder":
        return Detected(_cross_kind(config), "config_sentence_transformers.json: CrossEncoder")
    modules = read("modules.json")
    if isinstance(modules, list):
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        if any(t.endswith(name) for t in types for name in _SPARSE_MODULES):
            return Detected("sparse", "modules.json: a SPLADE module")
        return Detected("embedding", "modules.json")
    architecture = str((config.get("architectures") or [""])[0])
    if architecture.endswith("ForSequenceClassification") or "sentence_transformers" in config:
        return Detected(_cross_kind(config), f"config.json: {architecture or 'CrossEncoder'}")
    if architecture.endswith("ForMaskedLM"):
        return Detected("sparse", f"config.json: {architecture}")
    return Detected("embedding", f"config.json: {architecture or 'no architecture'}",
                    certain=bool(architecture))


def resolve(setting: str, model: str, read: ReadJson | None = None) -> Detected:
    """The kind to serve: the KIND setting, unless ``auto``, else what ``detect`` finds;
    KindMismatch for a KIND whose head the model does not have."""
    found = detect(model, read)
    if setting == "auto":
        return found
    if setting != "embedding" and found.certain and _HEADS[setting] != _HEADS[found.kind]:
        raise KindMismatch(
            f"KIND={setting} needs a model with {_HEADS[setting]} head, but MODEL is "
            f"{_article(found.kind)} {found.kind} model ({found.reason}), which has "
            f"{_HEADS[found.kind]} head: serving it as {setting} would compute with randomly "
            f"initialised weights; set KIND=auto or {found.kind}, or MODEL to a {setting} model")
    return Detected(setting, "the KIND setting")


def load_model(model: str, kind: str = "auto") -> SentenceTransformerEncoder:
    """Load ``model`` on the CPU as the encoder of its kind; safe before fork."""
    from .scorer import CrossEncoderScorer
    from .sparse import SparseEmbedder

    read = None if bundled(model) else functools.cache(_reader(model))
    found = resolve(kind, model, read)
    if read is not None and all(read(name) is None for name in _MODEL_FILES):
        raise RuntimeError(_not_a_model(model))  # before the model libraries load (seconds)
    cls = {"embedding": SentenceTransformerEncoder, "sparse": SparseEmbedder}.get(
        found.kind, CrossEncoderScorer
    )
    try:
        encoder = cls.load(model)
    except Exception as exc:
        raise RuntimeError(
            f"cannot load {model or 'the bundled model'!r} as {_article(found.kind)} "
            f"{found.kind} model ({found.reason}): {exc}; check MODEL, or set KIND to the "
            "model's kind"
        ) from exc
    if isinstance(encoder, CrossEncoderScorer):
        encoder.serve_as(found.kind)
    log.debug("model kind: %s (%s)", found.kind, found.reason)  # "model ready" names it
    return encoder


def _cross_kind(config: dict[str, Any]) -> str:
    labels = config.get("id2label")
    count = len(labels) if isinstance(labels, dict) and labels else config.get("num_labels", 2)
    return "reranker" if count == 1 else "classifier"


def _reader(model: str) -> ReadJson:
    """Reads a JSON file of a local directory, or of a hub repository through its cache."""

    def read(name: str) -> dict[str, Any] | list[Any] | None:
        if os.path.isdir(model):
            path = os.path.join(model, name)
            if not os.path.isfile(path):
                return None
        else:
            found = _hub_file(model, name)
            if found is None:
                return None
            path = found
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    return read


def _hub_file(repo: str, name: str) -> str | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    check_fetchable(repo)  # at once, rather than after a minute of retries for each file
    try:
        return hf_hub_download(repo, name)
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


def _not_a_model(model: str) -> str:
    if os.path.isdir(model):
        return (f"cannot load {model!r}: the directory holds no config.json or modules.json, "
                "so it is not a saved model (transformers' save_pretrained and "
                "sentence-transformers' save write them); check MODEL")
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return (f"cannot load {model!r}: it is not in the hub cache ({constants.HF_HUB_CACHE}) "
                "and HF_HUB_OFFLINE is set; download it once with network access, or set MODEL "
                "to a model directory")
    return (f"cannot load {model!r}: the hub repository holds no config.json or modules.json; "
            "check MODEL")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
