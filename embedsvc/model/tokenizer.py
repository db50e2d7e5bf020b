"""The model's fast tokenizer as the request threads use it (no torch needed)."""

from __future__ import annotations

from typing import Any


def plain_tokenizer(hf_tokenizer: Any, truncate_at: int | None = None,
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


def template_ids(tok: Any) -> tuple[list[int], list[int]]:
    """The ids the model's template puts before and after a single text."""
    probe = "hello"
    bare = tok.encode(probe, add_special_tokens=False).ids
    full = tok.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise RuntimeError("cannot find where the tokenizer's template places the text")
