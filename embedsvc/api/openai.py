"""The OpenAI embeddings route: ``POST /v1/embeddings`` (and ``/embeddings``)."""

from __future__ import annotations

import base64
from functools import partial
from typing import Any

from .bodies import as_list, parse
from .openai_tokens import decode_ids
from .schemas import EmbeddingsRequest
from .web import Call, Reply, embedded_reply


def embeddings(call: Call) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(EmbeddingsRequest, call)
    inputs = as_list(req.input)
    engine = call.engine()
    # OpenAI clients send ids of the tiktoken encoding of the model they name
    decode = (partial(decode_ids, model=req.model) if engine.settings.token_ids == "openai"
              else None)
    out = engine.embed(inputs, normalize=True, dimensions=req.dimensions, decode=decode,
                       **call.waits)
    if req.encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(r.astype("<f4").tobytes()).decode()
                              for r in out.vectors]
    else:
        encoded = list(out.vectors)
    body = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e}
                 for i, e in enumerate(encoded)],
        "model": engine.info.name,
        "usage": {"prompt_tokens": out.tokens, "total_tokens": out.tokens},
    }
    return embedded_reply(body, out, len(inputs))
