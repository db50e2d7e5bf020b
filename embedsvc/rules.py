"""The rules every input obeys, in one place below HTTP.

The engine applies them to every request, whoever sends it (an HTTP route, ``embedsvc
embed`` or a library caller), so all three refuse the same inputs with the same message.

>>> try:
...     check_inputs(["hello", ""], max_inputs=8, max_chars=100)
... except InvalidRequest as exc:
...     print(exc.code, exc.message)
empty_input input 1 is an empty string; every input needs at least one character or id
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .errors import InvalidRequest, PayloadTooLarge

Inputs = Sequence[str] | Sequence[Sequence[int]]


class InputRefused(InvalidRequest):
    """A rule refused input ``index``: the message is ``input <index> <detail>``, so that a
    caller that knows more about where the input came from (a file's line) can say so."""

    def __init__(self, index: int, detail: str, code: str) -> None:
        super().__init__(f"input {index} {detail}", param="input", code=code)
        self.index = index
        self.detail = detail


def check_inputs(inputs: Inputs, *, max_inputs: int, max_chars: int) -> None:
    """Count, type and size of one request's inputs (texts or token-id lists)."""
    check_count(len(inputs), max_inputs)
    texts = isinstance(inputs[0], str)
    if texts and all(inputs) and set(map(type, inputs)) == {str}:  # the usual case, in C
        check_chars(inputs, max_chars)  # type: ignore[arg-type]
        return
    kind = "string" if texts else "token list"
    for i, item in enumerate(inputs):
        if isinstance(item, str) is not texts:
            raise InputRefused(
                i, f"is not a {kind} like input 0; send all texts or all token lists",
                "invalid_input")
        if not item:
            raise InputRefused(
                i, f"is an empty {kind}; every input needs at least one character or id",
                "empty_input")
    if texts:
        check_chars(inputs, max_chars)  # type: ignore[arg-type]


def check_count(count: int, limit: int, *, setting: str = "MAX_INPUTS_PER_REQUEST",
                fix: str = "send at most that many at once", param: str = "input") -> None:
    if count == 0:
        raise InvalidRequest(f"'{param}' must not be empty", param=param, code="empty_input")
    if count > limit:
        raise InvalidRequest(
            f"the request has {count} inputs, more than {setting} ({limit}); {fix}",
            param=param, code="too_many_inputs",
        )


def check_chars(texts: Sequence[str], limit: int) -> None:
    if max(map(len, texts), default=0) <= limit:
        return
    for i, text in enumerate(texts):
        if len(text) > limit:
            raise too_long(i, len(text), limit)


def too_long(i: int, chars: int | None, limit: int) -> InputRefused:
    """Input ``i`` holds ``chars`` characters (None: more than counted), past MAX_INPUT_CHARS."""
    count = f"{chars} characters, more" if chars is not None else "more characters"
    return InputRefused(i, f"has {count} than MAX_INPUT_CHARS ({limit}); split it",
                        "input_too_long")


def check_decoded(texts: Iterable[str], *, max_chars: int, max_total: int) -> list[str]:
    """Texts decoded from token ids, checked as they come: each within MAX_INPUT_CHARS, and
    all together within MAX_BODY_BYTES characters, the most a body of text could carry (an
    id can stand for 128 characters, so ids alone would let a body inflate many times)."""
    out: list[str] = []
    total = 0
    for i, text in enumerate(texts):
        if len(text) > max_chars:
            raise too_long(i, None, max_chars)
        total += len(text)
        if total > max_total:
            raise InvalidRequest(
                f"the token ids of inputs 0 to {i} decode to {total} characters, more than "
                f"a request may carry (MAX_BODY_BYTES, {max_total}); send fewer ids at once",
                param="input", code="input_too_long")
        out.append(text)
    return out


def check_token_ids(i: int, ids: Sequence[Any], vocab_size: int) -> list[int]:
    # min and max run in C; the loop only looks for the culprit of a refusal
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return ids if isinstance(ids, list) else list(ids)
    token = next(t for t in ids if not 0 <= t < vocab_size)
    raise InputRefused(
        i, f"holds token id {token}, outside this model's vocabulary "
        f"(0 to {vocab_size - 1}); send text, or ids from this model's tokenizer",
        "invalid_token_id")


def check_decode_ids(total: int, limit: int) -> None:
    """/decode's ids all together within MAX_QUEUE_TOKENS: decoding costs the host CPU in
    proportion to them (8.4M ids, a 16 MB body, took about 9 CPU-seconds), and a request over
    the budget of work in progress would otherwise run alone, for seconds."""
    if total > limit:
        raise PayloadTooLarge(
            f"the request has {total} token ids, more than the server decodes at once "
            f"(MAX_QUEUE_TOKENS, {limit}); split it into smaller requests",
            param="ids", code="too_many_ids")


def check_dimensions(dimensions: int | None, model_dimension: int,
                     param: str = "dimensions") -> None:
    """``dimensions`` within the model's, refused by the name the request gave it."""
    if dimensions is not None and not 1 <= dimensions <= model_dimension:
        raise InvalidRequest(
            f"'{param}' must be between 1 and {model_dimension} for this model, "
            f"not {dimensions}",
            param=param, code="invalid_dimensions",
        )


def fit(i: int, ids: list[int], room: int, *, special: int, truncate: bool, direction: str,
        exact: bool = True) -> list[int]:
    """``ids`` cut to ``room`` tokens from the right or the left, or a 400 if not truncating.

    ``exact`` is False when ``ids`` are only a text's first tokens (the engine tokenizes one
    past the room), so that the message does not claim a count it never made.
    """
    if len(ids) <= room:
        return ids
    if not truncate:
        raise too_many_tokens(i, len(ids) + special if exact else None, room + special)
    return ids[:room] if direction == "right" else ids[len(ids) - room:]


def too_many_tokens(i: int, tokens: int | None, limit: int, *, at_least: bool = False
                    ) -> InputRefused:
    """400 for input ``i`` of ``tokens`` tokens (at least that many; more than the limit
    when uncounted) over the model's ``limit``."""
    count = "more tokens" if tokens is None else \
        f"{'at least ' if at_least else ''}{tokens} tokens, more"
    return InputRefused(i, f"has {count} than this model's limit of {limit}; shorten it or "
                        "ask for truncation", "input_too_long")


def prompted(prompts: dict[str, str], name: str | None, inputs: list[Any]) -> list[Any]:
    """Texts with the named prompt put before each; token ids cannot take one."""
    if name is None:
        return inputs
    prefix = prompt(prompts, name)
    if inputs and not isinstance(inputs[0], str):
        raise InvalidRequest("'prompt_name' applies to text inputs; with token ids, put the "
                             "prompt's ids first", param="prompt_name", code="invalid_prompt_name")
    return [prefix + t for t in inputs]


def prompt(prompts: dict[str, str], name: str) -> str:
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest(
            f"'prompt_name' {name!r} is not one of this model's prompts ({known})",
            param="prompt_name", code="invalid_prompt_name",
        )
    return prompts[name]


def check_query(query: str, max_chars: int) -> None:
    """A rerank query must hold some text, and no more than MAX_INPUT_CHARS of it."""
    if not query:
        raise InvalidRequest("'query' must not be empty", param="query", code="empty_input")
    if len(query) > max_chars:
        raise InvalidRequest(
            f"'query' has {len(query)} characters, more than MAX_INPUT_CHARS ({max_chars}); "
            "shorten it", param="query", code="input_too_long")


def check_listed(items: Sequence[Any], param: str) -> None:
    """A list the request is about (texts to rank, sentences to compare) must hold some."""
    if not items:
        raise InvalidRequest(f"'{param}' must not be empty", param=param.partition(".")[0],
                             code="empty_input")


def check_sequences(inputs: Sequence[str | tuple[str, str]], *, max_inputs: int,
                    max_chars: int) -> None:
    """Count, emptiness and size of a cross-encoder request's texts and pairs."""
    check_count(len(inputs), max_inputs)
    for i, item in enumerate(inputs):
        texts = (item,) if isinstance(item, str) else item
        if not all(texts):
            raise InputRefused(
                i, "holds an empty text; every text needs at least one character",
                "empty_input")
        chars = sum(map(len, texts))
        if chars > max_chars:
            raise too_long(i, chars, max_chars)


def check_embed_all_count(count: int, cap: int) -> None:
    """/embed_all answers a vector per token, hundreds of times its body: a small cap."""
    check_count(count, cap, setting="/embed_all's cap",
                fix="send fewer at once, or use /embed for one vector per input")
