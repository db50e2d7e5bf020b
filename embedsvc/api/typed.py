"""What the Cohere, Voyage and Jina embedding fields share: an input role (a query, a
document) mapped to the model's prompts, and vectors out as float, int8, uint8 or packed bits.

int8/uint8 codes need the model's calibration (``EngineClient.codes``). It is computed at the
first request that asks for them, not at startup: most deployments never ask, and for them
startup stays as it was; with the cache warm it is read from disk (bench/RESULTS.md has both
times).
"""

from __future__ import annotations

import base64

import numpy as np

from ..errors import InvalidRequest
from ..work import ModelInfo

# The prompt names each role goes by in sentence-transformers models, most usual first.
_ROLE_PROMPTS = {
    "query": ("query", "search_query", "retrieval.query"),
    "document": ("document", "passage", "search_document", "corpus", "retrieval.passage"),
    "classification": ("classification",),
    "clustering": ("clustering", "separation"),
    "similarity": ("text-matching", "similarity", "sts"),
}


def role_prefix(prompts: dict[str, str], sent: str, role: str) -> str:
    """The prompt to put before texts of ``role``: a prompt named as the client's own value
    (``sent``) first, else the role's usual names; none when the model has no such prompt
    (a symmetric model, or one that prompts queries only, embeds documents as they are)."""
    for name in (sent, *_ROLE_PROMPTS[role]):
        if name in prompts:
            return prompts[name]
    return ""


def with_role(info: ModelInfo, texts: list[str], sent: str | None, roles: dict[str, str],
              param: str) -> list[str]:
    """``texts`` with the prompt of the role the client's ``param`` value names."""
    if sent is None:
        return texts
    if sent not in roles:
        known = ", ".join(sorted(roles))
        raise InvalidRequest(f"'{param}' {sent!r} is not one of {known}", param=param,
                             code=f"invalid_{param}")
    prefix = role_prefix(info.prompts, sent, roles[sent])
    return [prefix + t for t in texts] if prefix else texts


def base64_rows(rows: np.ndarray) -> list[str]:
    """Each row's little-endian bytes, base64-encoded (float32 rows: OpenAI's base64)."""
    little = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
    return [base64.b64encode(r.tobytes()).decode() for r in little]
