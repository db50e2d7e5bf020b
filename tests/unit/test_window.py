"""token_window equals full tokenization then cutting, on real tokenizers (property tests)."""

import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from embedsvc.model.encoder import bundled_model_path
from embedsvc.model.fake import FakeEncoder
from embedsvc.model.window import TokenCounts, _counts, pair_shares, token_window, window_tokens

# Pieces that stress a cut: whitespace runs, many-token characters, accents (composed and
# combining), CJK (one word per character), punctuation (one word per mark), added tokens.
FRAGMENTS = [" ", "  ", "\t", "\n", " " * 40, "a", "hello", "world", "tokenization", "x" * 120,
             "!", "!!!", "...", "é", "e\u0301", "😀", "👩‍👩‍👧", "中", "文字", "한국어", "[MASK]",
             "[SEP]", "<s>", "don't", "42", "\u00a0", "\u200b"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=400).map("".join)
PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def bert() -> Tokenizer:
    tok = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


@functools.cache
def byte_level() -> Tokenizer:
    """A GPT-2-style byte-level BPE (whitespace runs and lookahead in its word split)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "[MASK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(FRAGMENTS * 20 + ["hello world " * 50, "中文字 한국어 😀"], trainer)
    return tok


@functools.cache
def metaspace() -> Tokenizer:
    """A SentencePiece-style unigram model (words start with a space marker)."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<s>", "[MASK]"],
                                      unk_token="<s>")
    tok.train_from_iterator(FRAGMENTS * 20 + ["hello world " * 50], trainer)
    return tok


def margin(tok: Tokenizer) -> int:
    return max(len(t.content) for t in tok.get_added_tokens_decoder().values())


def full(tok: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tok.encode(text, add_special_tokens=False)
    return enc.ids, enc.offsets


def check(tok: Tokenizer, text: str, limit: int, direction: str) -> None:
    ids, offsets = full(tok, text)
    if direction == "right":
        want = ids[:limit], offsets[:limit]
    else:
        want = ids[max(0, len(ids) - limit):], offsets[max(0, len(ids) - limit):]
    got = token_window(tok, [text], limit, direction, margin(tok))[0]
    assert got == (list(want[0]), list(want[1]))


@pytest.mark.parametrize("tokenizer", [bert, byte_level, metaspace])
@pytest.mark.parametrize("direction", ["right", "left"])
@PROPERTY
@given(text=texts, limit=st.integers(1, 80))
def test_a_window_equals_full_tokenization_then_cut(tokenizer, direction, text, limit):
    check(tokenizer(), text, limit, direction)


@pytest.mark.parametrize("direction", ["right", "left"])
@PROPERTY
@given(text=texts, limit=st.integers(0, 80))
def test_the_fake_encoder_cuts_the_same_way(direction, text, limit):
    fake = FakeEncoder()
    words = fake.tokenize([text])[0]
    want = words[:limit] if direction == "right" else words[max(0, len(words) - limit):]
    want = want if limit else []
    assert fake.tokenize([text], limit, direction)[0] == want


def test_a_maximal_input_is_cut_from_a_small_window():
    """200,000 '!' (one token each) cost a few windows, not 200,000 tokens."""
    seen: list[int] = []

    class Counting:
        def encode_batch(self, parts, add_special_tokens):
            seen.extend(len(p) for p in parts)
            return bert().encode_batch(parts, add_special_tokens=add_special_tokens)

    text = "!" * 200_000
    for direction in ("right", "left"):
        ids, _ = token_window(Counting(), [text], 254, direction, margin(bert()))[0]
        assert ids == full(bert(), "!" * 254)[0]
    assert max(seen) < 5_000, seen


def test_no_limit_and_short_texts_are_tokenized_whole():
    tok = bert()
    for text in ["hello world", "a", "😀 中 é"]:
        assert token_window(tok, [text], None)[0] == tuple(map(list, full(tok, text)))
        assert token_window(tok, [text], 500, "left", 6)[0] == tuple(map(list, full(tok, text)))


@functools.cache
def truncating(limit: int, direction: str) -> Tokenizer:
    tok = Tokenizer.from_str(bert().to_str())
    tok.enable_truncation(limit, direction=direction)  # longest_first, as CrossEncoder's
    return tok


def shares_of(query: str, document: str, limit: int, direction: str) -> tuple[list, list]:
    """What scorer.py keeps of (query, document) from their windows, ``limit`` tokens of each
    read, for a truncation to ``limit`` tokens with the pair's special tokens."""
    tok = bert()
    q, d = window_tokens(tok, [query, document], limit, direction, margin(tok))
    ids_q, ids_d = q.ids, d.ids
    budget = limit - truncating(limit, direction).num_special_tokens_to_add(True)
    counts = TokenCounts(tok, limit, margin(tok))
    n_q, n_d = pair_shares((q.known, q.cut), (d.known, d.cut), budget,
                           lambda: counts.longer(query, document))
    if direction == "right":
        return ids_q[:n_q], ids_d[:n_d]
    return ids_q[len(ids_q) - n_q:], ids_d[len(ids_d) - n_d:]


@pytest.mark.parametrize("direction", ["right", "left"])
@PROPERTY
@given(query=texts, document=texts, limit=st.integers(4, 64))
def test_pairs_keep_of_their_windows_what_truncation_keeps_of_the_whole(direction, query,
                                                                       document, limit):
    """What a reranker reads of (query, document) is the same from their windows (scorer.py):
    each side's share of the limit, which text is longer included."""
    whole = truncating(limit, direction).encode(query, document)
    sides = zip(whole.ids, whole.type_ids, whole.special_tokens_mask, strict=True)
    kept: tuple[list, list] = ([], [])
    for token, segment, special in sides:
        if not special:
            kept[segment].append(token)
    assert shares_of(query, document, limit, direction) == kept


def never_asked() -> bool:
    raise AssertionError("the lengths of two whole texts say which is longer")


@pytest.mark.parametrize("budget", [5, 6, 7])
def test_longest_first_is_the_tokenizers_own(budget):
    """``pair_shares`` of whole texts against the tokenizer's truncation, every small case."""
    tok = truncating(budget + 3, "right")
    for na in range(12):
        for nb in range(12):
            whole = tok.encode("a " * na, "b " * nb)
            want = (whole.tokens.count("a"), whole.tokens.count("b"))
            assert pair_shares((na, False), (nb, False), budget, never_asked) == want


@pytest.mark.parametrize("tokenizer", [bert, byte_level, metaspace])
@PROPERTY
@given(text=texts, limit=st.integers(1, 16))
def test_a_text_counted_in_pieces_has_the_tokens_of_the_whole(tokenizer, text, limit):
    tok = tokenizer()
    *_, (count, ended) = _counts(tok, text, limit, margin(tok))
    assert ended and count == len(full(tok, text)[0])


@pytest.mark.parametrize("direction", ["right", "left"])
def test_two_long_sides_are_read_in_pieces_of_the_window(direction):
    """Two 200,000-token texts that differ by one token: which is longer (and so gets the odd
    token of the budget) is settled from pieces of a few thousand characters, never from a
    whole text."""
    seen: list[int] = []

    class Counting:
        def encode(self, part, add_special_tokens):
            seen.append(len(part))
            return bert().encode(part, add_special_tokens=add_special_tokens)

        def encode_batch(self, parts, add_special_tokens):
            seen.extend(len(p) for p in parts)
            return bert().encode_batch(parts, add_special_tokens=add_special_tokens)

    pair = ("!" * 200_000, "!" * 199_999)
    sides = window_tokens(Counting(), list(pair), 128, direction)
    counts = TokenCounts(Counting(), 128)
    shares = pair_shares(*((side.known, side.cut) for side in sides), 125,
                         lambda: counts.longer(*pair))
    assert max(seen) < 20_000, max(seen)
    assert shares == (63, 62)
