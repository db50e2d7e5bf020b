"""The OpenAI embeddings route: ``POST /v1/embeddings`` (and ``/embeddings``)."""

from __future__ import annotations

import base64
from typing import Any

from .. import rules
from .bodies import as_list, parse
from .openai_tokens import decode_ids
from .schemas import EmbeddingsRequest
from .web import Call, Reply, embedded_reply


def embeddings(call: Call) -> Reply:
    """POST /v1/embeddings and /embeddings: the OpenAI shape."""
    req = parse(EmbeddingsRequest, call.body)
    inputs = as_list(req.input)
    engine = call.engine()
    if inputs and isinstance(inputs[0], list) and engine.settings.token_ids == "openai":
        # OpenAI clients send ids of the tiktoken encoding of the model they name. The
        # rules run on the ids as sent (count, empty lists) before they become texts.
        s = engine.settings
        rules.check_inputs(inputs, max_inputs=s.max_inputs_per_request,
                           max_chars=s.max_input_chars)
        inputs = decode_ids(inputs, req.model)
    out = engine.embed(inputs, normalize=True, dimensions=req.dimensions,
                       deadline=call.deadline, disconnected=call.disconnected)
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
