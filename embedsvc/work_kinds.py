"""One owner per kind of work: what a kind checks and how it tokenizes on the HTTP side, what
the model side makes of its rows, how its answer crosses between processes, and how the HTTP
side shapes it for the handler.

Every place that does something per kind asks the kind's object here (``WORK_KINDS[work.kind]``)
instead of switching on the name: ``EngineClient.run`` (``prepare``, ``shape``), the
``Runner`` (``refusal``, ``finish``, ``batched``), the engine process's loop (``batched``,
``pack``) and a front's link (``unpack``). A new kind of work is one subclass of ``Kind`` and
one entry in ``WORK_KINDS``; tests/integration/test_toy_kind.py adds one that way.

The HTTP side's methods take the ``EngineClient`` as ``client`` and use its helpers (the input
rules, the estimate, the tokenizer); the model side's take the encoder. Neither side's modules
are imported here: a front process holds this module and none of the model's.

>>> WORK_KINDS[EMBED].batched, WORK_KINDS[TOKENS].batched
(True, False)
>>> out = Embedded(np.ones((2, 3), np.float32), 0)
>>> WORK_KINDS[EMBED].unpack(WORK_KINDS[EMBED].pack(out)).vectors.shape
(2, 3)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import rules
from .errors import InvalidRequest
from .work import EMBED, IMAGE, SCORE, SPARSE, TOKENS, Embedded, ImageRef, Work

# /embed_all answers a vector per token (about 4,600 times its body): TEI's cap, 32 inputs.
EMBED_ALL_MAX_INPUTS = 32

Tokenize = Callable[[], list[list[int]]]


class Kind:
    """A kind of work. Subclasses say what differs; the defaults are a dense embedding's."""

    name = ""
    batched = True  # False: run alone between batches (``Runner.embed_all``), not queued
    normalises = False  # ``shape`` normalises the rows where the work asks it (``units``)

    # -- the HTTP side (EngineClient) ---------------------------------------------------------

    def prepare(self, client: Any, work: Work) -> tuple[int, Tokenize]:
        """Check ``work``'s inputs (400 before any admission), and say what admission
        reserves for it (tokens, estimated) and how it is tokenized."""
        work.inputs = client.decoded(work)
        client.check(work.inputs)
        return client.estimate(work.inputs), lambda: client.tokens(
            work.inputs, truncate=work.truncate, direction=work.direction,
            deadline=work.deadline, disconnected=work.disconnected)

    def shape(self, client: Any, work: Work, out: Embedded) -> Embedded:
        """The answer as the handler reads it."""
        return out

    # -- the model side (Runner) --------------------------------------------------------------

    def refusal(self, encoder: Any) -> InvalidRequest | None:
        """The 400 for a model that cannot do this kind of work, or None."""
        return None

    def finish(self, encoder: Any, work: Work, rows: np.ndarray) -> Embedded:
        """The answer from the batch's raw rows of ``work``'s inputs."""
        return Embedded(rows, 0)

    # -- between processes (remote/) ----------------------------------------------------------

    def pack(self, out: Embedded) -> list[np.ndarray]:
        """The answer as float32 and int32 arrays, for the answer frame (wire.Answer)."""
        return [np.ascontiguousarray(out.vectors, dtype="<f4")]

    def unpack(self, parts: Sequence[np.ndarray]) -> Embedded:
        """``pack``'s arrays back as the answer; ValueError for arrays it cannot be."""
        (vectors,) = parts
        if vectors.ndim != 2 or vectors.dtype != np.float32:
            raise ValueError("rows must be one float32 matrix")
        return Embedded(vectors, 0)


class Embed(Kind):
    """One vector per input, cut to ``dimensions`` and normalised as asked."""

    name = EMBED
    normalises = True

    def prepare(self, client: Any, work: Work) -> tuple[int, Tokenize]:
        rules.check_dimensions(work.dimensions, client.info.dimension, work.dimensions_param)
        return super().prepare(client, work)

    def shape(self, client: Any, work: Work, out: Embedded) -> Embedded:
        if work.dimensions is not None:  # a copy: rows from the engine process are views
            out.vectors = np.ascontiguousarray(out.vectors[:, :work.dimensions])
        if work.normalize:  # normalised with their batch already, where the rows are whole
            units = out.units if work.dimensions is None else None
            out.vectors = units if units is not None else l2_normalize(out.vectors)
        for dtype in work.codes:  # int8 and uint8 on the model's calibrated scale
            out.codes[dtype] = client.codes(out.vectors, dtype, normalize=work.normalize,
                                            dimensions=work.dimensions)
        return out


class Images(Embed):
    """Texts and images into one space (image-text models: CLIP, SigLIP), shaped as Embed's.

    An input is a text, tokenized as Embed's, or an ``ImageRef``, decoded and preprocessed
    on this side (image/: ``EngineClient.images``) into ``Pixels`` once admitted, so that
    ``--workers N`` spreads the decoding and the model side receives pixel arrays. Admission
    reserves an image's cost (``ModelInfo.image_tokens``) before any byte of it is decoded."""

    name = IMAGE

    def prepare(self, client: Any, work: Work) -> tuple[int, Tokenize]:
        info = client.info
        if "image" not in info.modalities:
            raise InvalidRequest(f"the {info.kind} model {info.name!r} embeds text only: send "
                                 "texts, or name an image-text model in 'model' where the "
                                 "server serves several", param=work.param,
                                 code="not_supported")
        rules.check_dimensions(work.dimensions, info.dimension, work.dimensions_param)
        rules.check_count(len(work.inputs), client.settings.max_inputs_per_request,
                          param=work.param)
        images = [i for i, item in enumerate(work.inputs) if isinstance(item, ImageRef)]
        texts = [i for i, item in enumerate(work.inputs) if not isinstance(item, ImageRef)]
        most = client.settings.max_images_per_request
        if len(images) > most:
            raise InvalidRequest(f"the request has {len(images)} images, more than "
                                 f"MAX_IMAGES_PER_REQUEST ({most}); send at most that many at "
                                 "once", param=work.param, code="too_many_images")
        strings = [work.inputs[i] for i in texts]
        if strings:
            client.check(strings)
        estimate = (client.estimate(strings) if strings else 0) + len(images) * info.image_tokens

        def tokenize() -> list[Any]:
            ids: list[Any] = [None] * len(work.inputs)
            if strings:
                rows = client.tokens(strings, truncate=work.truncate, direction=work.direction,
                                     deadline=work.deadline, disconnected=work.disconnected)
                for i, row in zip(texts, rows, strict=True):
                    ids[i] = row
            pixels = client.images([work.inputs[i] for i in images], deadline=work.deadline,
                                   disconnected=work.disconnected)
            for i, image in zip(images, pixels, strict=True):
                ids[i] = image
            return ids

        return estimate, tokenize

    def refusal(self, encoder: Any) -> InvalidRequest | None:
        if "image" in encoder.info.modalities:
            return None
        return _not_serving(encoder, "embeds no images")


class Score(Kind):
    """A row of scores per text or (text, text) pair: rerankers and classifiers."""

    name = SCORE

    def prepare(self, client: Any, work: Work) -> tuple[int, Tokenize]:
        s = client.settings
        if work.query is not None:  # a rerank: each text against the query
            rules.check_query(work.query, s.max_input_chars)
            rules.check_listed(work.inputs, work.param)
            work.inputs = [(work.query, text) for text in work.inputs]
        rules.check_sequences(work.inputs, max_inputs=s.max_inputs_per_request,
                              max_chars=s.max_input_chars)
        truncate = s.auto_truncate if work.truncate is None else work.truncate
        return client.estimate_sequences(work.inputs), lambda: client.sequences(work, truncate)

    def refusal(self, encoder: Any) -> InvalidRequest | None:
        from .model.encoder import Scorer  # the model side's; a front never asks

        return None if isinstance(encoder, Scorer) else \
            _not_serving(encoder, "scores no texts or pairs")

    def finish(self, encoder: Any, work: Work, rows: np.ndarray) -> Embedded:
        return Embedded(encoder.activate(rows, work.raw), 0)


class Sparse(Kind):
    """The active (index, value) pairs of each input (SPLADE)."""

    name = SPARSE

    def refusal(self, encoder: Any) -> InvalidRequest | None:
        from .model.encoder import Sparse as SparseEncoder  # the model side's

        return None if isinstance(encoder, SparseEncoder) else \
            _not_serving(encoder, "gives no sparse vectors; use /embed")

    def finish(self, encoder: Any, work: Work, rows: np.ndarray) -> Embedded:
        from .model.sparse import active  # the model side's; a front never finishes work

        pairs = active(rows, encoder.max_active_dims)
        return Embedded(np.empty((len(rows), 0), np.float32), 0, sparse=pairs)

    def pack(self, out: Embedded) -> list[np.ndarray]:
        assert out.sparse is not None
        counts = np.array([len(i) for i, _ in out.sparse], dtype="<i4")
        indices = np.concatenate([i for i, _ in out.sparse] or [np.empty(0)]).astype("<i4")
        values = np.concatenate([v for _, v in out.sparse] or [np.empty(0)]).astype("<f4")
        return [counts, indices, values]

    def unpack(self, parts: Sequence[np.ndarray]) -> Embedded:
        counts, indices, values = parts
        bounds = _bounds(counts, len(indices))
        if len(values) != len(indices) or values.dtype != np.float32:
            raise ValueError("sparse values must match their indices")
        pairs = [(indices[a:b].astype(np.int64), values[a:b])
                 for a, b in itertools.pairwise(bounds)]
        return Embedded(np.empty((len(pairs), 0), np.float32), 0, sparse=pairs)


class Tokens(Kind):
    """One vector per token of each input (/embed_all): never batched with other work; at
    most EMBED_ALL_MAX_INPUTS inputs, admitted at the model's limit for each (what it can
    produce), run by the model side one slice at a time between batches."""

    name = TOKENS
    batched = False

    def prepare(self, client: Any, work: Work) -> tuple[int, Tokenize]:
        client.check(work.inputs)
        rules.check_embed_all_count(work.count, EMBED_ALL_MAX_INPUTS)
        most = work.count * client.info.max_input_tokens
        return most, lambda: client.tokens(
            work.inputs, truncate=work.truncate, direction=work.direction,
            deadline=work.deadline, disconnected=work.disconnected)

    def refusal(self, encoder: Any) -> InvalidRequest | None:
        if getattr(encoder, "encode_tokens", None) is None:
            return InvalidRequest("this model's backend gives no per-token vectors; use "
                                  "/embed", code="not_supported")
        return None

    def pack(self, out: Embedded) -> list[np.ndarray]:
        rows = out.token_vectors or []
        counts = np.array([len(r) for r in rows], dtype="<i4")
        flat = np.concatenate(rows).astype("<f4") if rows else np.empty((0, 0), "<f4")
        return [counts, flat]

    def unpack(self, parts: Sequence[np.ndarray]) -> Embedded:
        counts, rows = parts
        if rows.ndim != 2 or rows.dtype != np.float32:
            raise ValueError("per-token rows must be one float32 matrix")
        bounds = _bounds(counts, len(rows))
        vectors = [rows[a:b] for a, b in itertools.pairwise(bounds)]
        return Embedded(np.empty((len(vectors), 0), np.float32), 0, token_vectors=vectors)


# The kinds of work, by name: a new kind is a subclass above and one line here.
WORK_KINDS: dict[str, Kind] = {kind.name: kind for kind in (Embed(), Images(), Score(), Sparse(),
                                                             Tokens())}


def kind_of(work: Work) -> Kind:
    """``work``'s kind; a 400 for a name no kind has (a frame from another version)."""
    kind = WORK_KINDS.get(work.kind)
    if kind is None:
        raise InvalidRequest(f"unknown kind of work {work.kind!r}", code="not_supported")
    return kind


def _not_serving(encoder: Any, what: str) -> InvalidRequest:
    """A 400 that says what this model is."""
    return InvalidRequest(f"this server's {encoder.info.kind} model {what}",
                          code="not_supported")


def wants_units(work: Work) -> bool:
    """Whether ``work``'s answer is its rows at unit length, whole: the model side may
    normalise a one-input request's row with its batch (``Batcher.unit``, ``Submit.unit``)."""
    return WORK_KINDS[work.kind].normalises and work.normalize and work.dimensions is None


def l2_normalize(rows: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]
    return rows / np.maximum(norms, 1e-12)


def _bounds(counts: np.ndarray, total: int) -> list[int]:
    """Where each input's slice of ``total`` items starts, from the counts of each."""
    if counts.ndim != 1 or counts.dtype != np.int32 or (counts < 0).any() \
            or int(counts.sum()) != total:
        raise ValueError("the counts do not add up to the items")
    return [0, *np.cumsum(counts).tolist()]
