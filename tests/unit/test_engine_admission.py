"""The engine admits before it tokenizes, tokenizes within the deadline, and cuts texts to
what the model can use before tokenizing them."""

import time

import pytest

from embedsvc.encoder import FakeEncoder
from embedsvc.errors import DeadlineExceeded

from .conftest import make_app


class Spy(FakeEncoder):
    """Records, at each tokenize or pieces call, what was admitted and what was asked."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple] = []
        self.engine = None
        self.pause_s = 0.0
        self.error: Exception | None = None

    def _seen(self, kind, n, limit=None, direction=None):
        self.calls.append((kind, n, self.engine.batcher.admitted, limit, direction))
        time.sleep(self.pause_s)
        if self.error is not None:
            raise self.error

    def tokenize(self, texts, limit=None, direction="right"):
        if self.engine is not None:
            self._seen("tokenize", len(texts), limit, direction)
        return super().tokenize(texts, limit, direction)

    def pieces(self, texts):
        self._seen("pieces", len(texts))
        return super().pieces(texts)


@pytest.fixture
def spy(registry):
    enc = Spy(max_input_tokens=16)  # room: 14 tokens
    app = make_app(enc, registry)
    enc.engine = app.extensions["embedsvc"].ready()
    return enc


def test_inputs_are_admitted_before_they_are_tokenized_and_cut_before_it(spy):
    spy.engine.embed(["a b", "c", "d e f"], direction="left")
    assert spy.calls == [("tokenize", 3, 3, 14, "left")]
    spy.calls.clear()
    spy.engine.embed(["a b"], truncate=False)  # one past the room tells "too long"
    assert spy.calls == [("tokenize", 1, 1, 15, "right")]
    assert spy.engine.batcher.admitted == 0


def test_truncation_keeps_exactly_the_tokens_full_tokenization_would(spy):
    text = " ".join(f"w{i}" for i in range(100))
    for direction, kept in (("right", range(14)), ("left", range(86, 100))):
        out = spy.engine.embed([text], direction=direction, normalize=False)
        want = spy.vector(spy.wrap(spy.tokenize([" ".join(f"w{i}" for i in kept)])[0]))
        assert (out.vectors[0] == want).all() and out.tokens == 16


def test_an_error_while_tokenizing_gives_the_admission_back(spy):
    spy.error = RuntimeError("tokenizer broke")
    with pytest.raises(RuntimeError):
        spy.engine.embed(["a", "b"])
    assert (spy.engine.batcher.admitted, spy.engine.batcher.admission.used_tokens) == (0, 0)


def test_tokenizing_stops_at_the_deadline_with_504(spy):
    spy.pause_s = 0.05  # per chunk of 256 inputs
    with pytest.raises(DeadlineExceeded):
        spy.engine.embed(["word"] * 600, deadline=time.monotonic() + 0.08)
    assert [c[1] for c in spy.calls] == [256, 256]  # the third chunk never started
    assert spy.engine.batcher.admitted == 0


def test_tokenize_route_runs_under_the_same_admission(spy):
    rows = spy.engine.pieces(["a b", "c"])
    assert spy.calls == [("pieces", 2, 2, None, None)]
    assert [p.text for p in rows[0]] == ["[CLS]", "a", "b", "[SEP]"]
    assert spy.engine.batcher.admitted == 0
