"""The boundary between the HTTP side and the model: one typed request, one typed result.

A handler says what it wants computed as one ``Work``: the kind (``EMBED``, ``SCORE``,
``SPARSE``, ``TOKENS``), the inputs (texts, token ids, or for scorers texts and pairs) and
the options. The front side (engine_client.py) checks and tokenizes the inputs into ``Work.ids``;
the model side (runner.py) admits them, batches them with every other request's and computes
their rows; the answer is one ``Embedded``. In one process the same ``Work`` is passed along;
between an HTTP process and the engine process it travels as a frame (remote/wire.py) holding
the model side's fields only, and ``Embedded`` comes back the same way.

>>> work = Work(EMBED, ["a text"], dimensions=8)
>>> work.kind, work.normalize, work.count
('embed', True, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EMBED = "embed"  # one vector per input (dense embedding models)
SCORE = "score"  # one row of scores per text or pair (rerankers, classifiers)
SPARSE = "sparse"  # the active (index, value) pairs of each input (SPLADE)
TOKENS = "tokens"  # one vector per token of each input (/embed_all): never batched
IMAGE = "image"  # one vector per text or image, in one space (image-text models: CLIP, SigLIP)

# Token-id inputs of another tokenizer (OpenAI's) to texts, each as it is decoded, given
# ``max_chars`` (MAX_INPUT_CHARS) so that one input's decoding stops once it is too long.
Decoder = Callable[..., Iterable[str]]
Disconnected = Callable[[], bool] | None
SparseRow = tuple[np.ndarray, np.ndarray]  # the active dimensions' indices and values
Sequenced = str | tuple[str, str]  # one input of a cross-encoder: a text or a pair of texts


class Pair(list):
    """Token ids of a text pair, special tokens in; ids from ``second`` on are segment B.

    It is a list of ids, as the batcher expects of any input (it only takes ``len``), so a
    pair's tokens count against MAX_BATCH_TOKENS like any input's; ``encode`` reads
    ``second`` to give segment B token type 1. ``cut``: a text was read only as far as the
    model's limit (its full token count is unknown, and over the limit).
    """

    __slots__ = ("second", "cut")

    def __init__(self, ids: Sequence[int], second: int, cut: bool = False) -> None:
        super().__init__(ids)
        self.second = second
        self.cut = cut


@dataclass(frozen=True)
class ImageRef:
    """An image input as a client sent it (a data URI, or a URL where fetching is allowed);
    ``param`` names it in errors (the field, as the error shape's ``param``), ``where`` in their
message. The front side decodes and preprocesses it to ``Pixels``."""

    source: str
    param: str = "input"
    where: str = ""  # which of the request's inputs it is, as its 400 names it: "input[3]"


class Pixels:
    """One preprocessed image (float32 CHW) as the batcher holds an input: it only takes
    ``len``, which is what the image costs the device in token-equivalents (the vision
    tower's patches and its class token), so that images count against MAX_BATCH_TOKENS and
    admission like texts of that length."""

    __slots__ = ("array", "cost")

    def __init__(self, array: np.ndarray, cost: int) -> None:
        self.array = array
        self.cost = cost

    def __len__(self) -> int:
        return self.cost


@dataclass(frozen=True)
class Piece:
    """One token as /tokenize shows it; ``start``/``stop`` are character offsets."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


@dataclass(frozen=True)
class ShutdownReport:
    """What a drain did: counted in inputs (``Batcher.shutdown``, the engine's answer)."""

    completed: int  # inputs computed while draining, for requests that got them
    failed: int  # inputs of the requests that got no answer (503 at the timeout, or cut off)
    clean: bool  # the thread ended within the timeout
    uncomputed: int = 0  # of ``failed``, those never computed (the rest were, for nobody)


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, as both sides of the boundary and the clients see it."""

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
    modalities: tuple[str, ...] = ("text",)  # an image-text model's: ("text", "image")
    image_tokens: int = 0  # what one image costs the device, in token-equivalents (Pixels)
    image: dict[str, Any] | None = None  # its preprocessor_config.json (image/preprocess.py)


@dataclass(slots=True)
class Work:
    """One request for the model, as a handler builds it.

    ``inputs``: texts or token-id lists (``EMBED``, ``SPARSE``, ``TOKENS``), or texts and
    (text, text) pairs (``SCORE``); with ``query``, ``SCORE`` inputs are texts, each scored
    against it (a rerank; ``param`` names the list in errors). Options: ``normalize`` and
    ``dimensions`` (``EMBED``: the first N components, then L2-normalised; refused by the
    name ``dimensions_param``, the field the request sent it in), ``truncate``
    (None: the AUTO_TRUNCATE setting) and ``direction``, ``raw`` (``SCORE``: logits instead
    of the model's activation), ``decode`` (token ids of another tokenizer, turned to text
    first), ``codes`` (``EMBED``: the vectors also as these dtypes, ``Embedded.codes``:
    int8, uint8, binary, ubinary). What the pipeline knows of the request: ``deadline``
    (monotonic seconds; reaching the model after it is a 504), ``disconnected`` (True once
    the client left), ``flow`` (the client's connection: its turn among others') and
    ``tenant`` (the API key's name). ``ids`` are filled in by the front side: the wrapped
    token ids the model computes.
    """

    kind: str
    inputs: Sequence[Any]
    normalize: bool = True
    dimensions: int | None = None
    truncate: bool | None = None
    direction: str = "right"
    raw: bool = False
    query: str | None = None
    param: str = "input"
    dimensions_param: str = "dimensions"
    decode: Decoder | None = None
    codes: tuple[str, ...] = ()
    deadline: float | None = None
    disconnected: Disconnected = None
    flow: Hashable | None = None
    tenant: str | None = None
    front: int | None = None  # the HTTP process it came from, when the model is elsewhere
    ids: list[list[int]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.inputs)


@dataclass(slots=True)
class Embedded:
    """The rows for one ``Work``, in input order, and where its time went.

    ``vectors``: one row per input (``EMBED``: the vector; ``SCORE``: a score per label);
    ``sparse``: ``SPARSE``'s active pairs per input; ``token_vectors``: ``TOKENS``' per-token
    vectors per input. ``tokens``: the real tokens computed (special tokens included).
    ``queue_s`` is the wait for admission (``admit_s``) and then in the batcher's queue;
    ``batch_size``: the inputs of the largest device batch that held some of this work's.
    ``codes``: the vectors as each dtype ``Work.codes`` asked for. ``units``: ``vectors`` at
    unit length, where the model side normalised them with their batch (``Batcher.unit``).
    """

    vectors: np.ndarray
    tokens: int
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    admit_s: float = 0.0
    inference_s: float = 0.0
    total_s: float = 0.0
    batch_size: int = 0
    sparse: list[SparseRow] | None = None
    token_vectors: list[np.ndarray] | None = None
    codes: dict[str, np.ndarray] = field(default_factory=dict)
    units: np.ndarray | None = None


def elements(indices: np.ndarray, values: np.ndarray) -> list[dict[str, Any]]:
    """One sparse vector in TEI's shape (``/embed_sparse``, ``embedsvc embed``'s JSONL).

    >>> elements(np.array([1, 3]), np.array([1.5, 0.25], dtype=np.float32))
    [{'index': 1, 'value': 1.5}, {'index': 3, 'value': 0.25}]
    """
    return [{"index": i, "value": v}
            for i, v in zip(indices.tolist(), values.tolist(), strict=True)]


class Pending:
    """An answer on its way: ``result()`` waits for it (or raises the request's error)."""

    __slots__ = ("result",)

    def __init__(self, result: Callable[[], Embedded]) -> None:
        self.result = result
