"""The sentence-transformers encoder: the model's own modules on PyTorch (or a runtime that
stands in for its transformer, onnx_backend.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import DeviceOutOfMemory
from .device import resolve_device, resolve_dtype
from .encoder import ModelInfo, bundled, bundled_model_path, model_name
from .tokenizer import TextSide, padded, plain_tokenizer

log = logging.getLogger(__name__)


class SentenceTransformerEncoder(TextSide):
    """A sentence-transformers model, loaded on the CPU first and placed on a device later.

    Loading and placing are separate so that a pre-forking server can load the weights once
    in its master (CPU only, no device probing) and let each worker place them after fork.
    ``use_forward`` swaps the first module (the transformer) for another runtime, such as an
    ONNX Runtime session (see onnx_backend.py): tokenizing, special tokens, truncation and
    the modules after it (pooling, dense layers) stay the model's own.

    Example (loads the bundled model)::

        enc = SentenceTransformerEncoder.load("")
        enc.place("auto", "auto")

    The other model kinds (scorer.py, sparse.py) subclass it for its tokenizer handling,
    placing and description, and run their own forward pass.
    """

    kind = "embedding"

    def __init__(self, model: Any, name: str, source: str | None = None) -> None:
        self._model = model
        self._name = name
        self.source = source  # the model's directory, when it was loaded from one
        tokenizer = model.tokenizer
        self._use_tokenizer(plain_tokenizer(tokenizer))
        self._pad_id = tokenizer.pad_token_id or 0
        self._with_token_types = "token_type_ids" in tokenizer.model_input_names
        self._modules = _modules_without_normalize(model)
        self._pipeline: list[Callable[[dict[str, Any]], dict[str, Any]]] = list(self._modules)
        self._backend = "torch"
        self._precision: str | None = None  # what a replaced forward computes in, if not dtype
        self._device = "cpu"
        self._dtype = "float32"
        self.info = self._describe()

    @classmethod
    def load(cls, model: str) -> SentenceTransformerEncoder:
        """Load the weights onto the CPU. Touches no accelerator, so it is safe before fork."""
        path = bundled_model_path() if bundled(model) else model
        st = cls._model_class()(path, device="cpu")
        st.eval()
        source = path if os.path.isdir(path) else None
        return cls(st, model_name(model), source)

    @staticmethod
    def _model_class() -> Any:
        """The sentence-transformers class that loads this kind of model directory."""
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer

    def place(self, device: str, dtype: str) -> None:
        """Move to the resolved device and dtype, then warm up. Call in the serving process."""
        import torch

        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        if self._device == "cpu" and self._dtype == "float16":
            log.warning("float16 on the CPU is slow and imprecise; consider DTYPE=float32")
        self._model.to(device=self._device, dtype=getattr(torch, self._dtype))
        self.info = self._describe()
        self.encode([self.wrap(self.tokenize(["warm up"])[0])])

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        return self._run(self._pipeline, batch)

    def encode_with(
        self, forward: Callable[[dict[str, Any]], dict[str, Any]] | None,
        batch: Sequence[Sequence[int]],
    ) -> np.ndarray:
        """``encode`` with ``forward`` in place of the first module; None: the model's own."""
        return self._run(self._modules if forward is None else [forward, *self._modules[1:]],
                         batch)

    def release_replaced(self) -> None:
        """Free the weights of the transformer that ``use_forward`` replaced (ONNX Runtime
        holds its own copy). Their shapes stay, so ``info`` still counts the parameters;
        ``encode_with(None, ...)`` and ``place`` no longer work. Call after ``place``."""
        import torch

        if self._modules and self._pipeline[0] is not self._modules[0]:
            self._modules[0].to(torch.device("meta"))

    @property
    def forward(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """What computes the transformer: the first module, or the forward that replaced it."""
        return self._pipeline[0]

    @property
    def input_module(self) -> Any:
        """The first module: the transformer that a replacement forward stands in for."""
        return self._modules[0] if self._modules else None

    @property
    def input_names(self) -> list[str]:
        """The tensors the first module reads from a batch, in the order a graph takes them."""
        return ["input_ids", "attention_mask", *(["token_type_ids"] * self._with_token_types)]

    def use_forward(
        self, forward: Callable[[dict[str, Any]], dict[str, Any]], backend: str, precision: str
    ) -> None:
        """Run ``forward`` in place of the first module; it reads and returns the batch's
        features (``input_names`` in, the first module's output added) as that module does."""
        self._pipeline = [forward, *self._modules[1:]]
        self._backend, self._precision = backend, precision
        self.info = self._describe()

    def _run(self, modules: Sequence[Callable[[Any], Any]],
             batch: Sequence[Sequence[int]]) -> np.ndarray:
        return torch_forward(modules, self.features(batch), "sentence_embedding")

    def encode_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        import torch

        features = self.features(batch)
        with torch.inference_mode():
            # the first module (the transformer, or the ONNX graph standing in for it) gives
            # the token vectors; pooling comes after
            tokens = torch.as_tensor(self._pipeline[0](features)["token_embeddings"])
            rows = tokens.float().cpu().numpy()
        return [rows[row, : len(ids)] for row, ids in enumerate(batch)]

    def features(self, batch: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The padded tensors the first module reads for ``batch`` (wrapped ids)."""
        import torch

        input_ids, mask = padded(batch, self._pad_id)
        device = self._device
        features: dict[str, Any] = {
            "input_ids": torch.from_numpy(input_ids).to(device, non_blocking=True),
            "attention_mask": torch.from_numpy(mask).to(device, non_blocking=True),
            "modality": "text",
        }
        if self._with_token_types:
            features["token_type_ids"] = self._token_types(batch, features["input_ids"])
        return features

    def _token_types(self, batch: Sequence[Sequence[int]], input_ids: Any) -> Any:
        """Segment ids: all 0 for single texts; a pair's second segment is 1 (scorer.py)."""
        import torch

        return torch.zeros_like(input_ids)

    def _describe(self) -> ModelInfo:
        params = sum(p.numel() for p in self._model.parameters())
        size = sum(p.numel() * p.element_size() for p in self._model.parameters())
        return ModelInfo(
            name=self._name,
            dimension=self._dimension(),
            max_input_tokens=int(self._model.max_seq_length),
            vocab_size=int(self._tokenizer.get_vocab_size(with_added_tokens=True)),
            device=self._device,
            dtype=self._precision or self._dtype,
            parameters=int(params),
            size_bytes=int(size),
            prompts=dict(getattr(self._model, "prompts", None) or {}),
            kind=self.kind,
            labels=self._labels(),
            pooling=_pooling(self._model),
            backend=self._backend,
        )

    def _dimension(self) -> int:
        """The width of the rows ``encode`` returns."""
        # sentence-transformers renamed the method in v5; older releases have only the old name
        dimension_of = getattr(self._model, "get_embedding_dimension", None)
        dim = dimension_of() if dimension_of else self._model.get_sentence_embedding_dimension()
        return int(dim)

    def _labels(self) -> tuple[str, ...]:
        return ()


def _pooling(model: Any) -> str | None:
    """The pooling module's mode, spelled as TEI spells it in /info (``last_token``)."""
    for module in model:
        mode = getattr(module, "pooling_mode", None)
        if isinstance(mode, str):
            return "last_token" if mode == "lasttoken" else mode
    return None


def torch_forward(modules: Sequence[Any], features: dict[str, Any], output: str) -> np.ndarray:
    """Run ``modules`` (sentence-transformers modules, or a forward that replaces the first)
    on ``features``; their ``output`` as float32 rows."""
    import torch

    try:
        with torch.inference_mode():
            for module in modules:
                features = module(features)
            out = features[output].float()
            return out.cpu().numpy()
    except torch.OutOfMemoryError as exc:
        raise DeviceOutOfMemory(str(exc)) from exc


def _modules_without_normalize(model: Any) -> list[Any]:
    # The engine normalises (or not, as the request asks), so the model's own step is skipped.
    modules = list(model)
    if modules and type(modules[-1]).__name__ == "Normalize":
        return modules[:-1]
    return modules
