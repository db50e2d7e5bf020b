"""engine.py: the request path of a loaded model, without HTTP."""

import threading

import numpy as np
import pytest

from embedsvc.batcher import Batcher, BatchLimits
from embedsvc.encoder import FakeEncoder
from embedsvc.engine import Engine, l2_normalize
from embedsvc.errors import InvalidRequest
from embedsvc.metrics import Metrics
from embedsvc.settings import Settings


@pytest.fixture
def engine(registry):
    settings = Settings(max_inputs_per_request=8, max_queue=64, max_input_chars=50)
    encoder = FakeEncoder(dimension=6, max_input_tokens=8)
    batcher = Batcher(encoder.encode, BatchLimits.from_settings(settings),
                      metrics=Metrics(registry))
    batcher.start()
    yield Engine(settings, encoder, batcher)
    batcher.shutdown(timeout=1)


def test_embed_returns_normalised_rows_in_order_and_counts_tokens(engine):
    texts = ["one", "two words", "three more words"]
    out = engine.embed(texts)
    expected = np.stack([engine.encoder.expected(t) for t in texts])
    np.testing.assert_allclose(out.vectors, expected, rtol=1e-6)
    assert out.tokens == sum(len(t.split()) + 2 for t in texts)
    assert out.total_s >= out.tokenize_s >= 0


def test_embed_applies_dimensions_then_normalises_or_not(engine):
    raw = engine.embed(["hello world"], normalize=False).vectors
    cut = engine.embed(["hello world"], dimensions=3).vectors
    np.testing.assert_allclose(cut, l2_normalize(raw[:, :3]), rtol=1e-6)
    assert engine.embed(["hello world"], dimensions=3, normalize=False).vectors.shape == (1, 3)


@pytest.mark.parametrize(("inputs", "options", "code"), [
    ([""], {}, "empty_input"),
    (["x"] * 9, {}, "too_many_inputs"),
    (["x" * 51], {}, "input_too_long"),
    ([[5000]], {}, "invalid_token_id"),
    (["a b c d e f g h"], {"truncate": False}, "input_too_long"),
    (["hi"], {"dimensions": 7}, "invalid_dimensions"),
])
def test_the_library_refuses_what_http_refuses(engine, inputs, options, code):
    with pytest.raises(InvalidRequest) as info:
        engine.embed(inputs, **options)
    assert info.value.code == code
    assert engine.batcher.admitted == 0


def test_token_ids_and_their_text_give_the_same_row(engine):
    ids = engine.encoder.tokenize(["hello world"])[0]
    np.testing.assert_allclose(engine.embed([ids]).vectors, engine.embed(["hello world"]).vectors)


def test_truncation_keeps_the_right_end_when_asked(engine):
    words = [f"w{i}" for i in range(12)]
    left = engine.prepare([" ".join(words)], direction="left")[0]
    assert left == engine.encoder.wrap(engine.encoder.tokenize([" ".join(words[-6:])])[0])


def test_concurrent_callers_each_get_their_own_rows(engine):
    results: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        results[i] = engine.embed([f"caller {i}", f"second {i}"]).vectors

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i, rows in results.items():
        np.testing.assert_allclose(rows[1], engine.encoder.expected(f"second {i}"), rtol=1e-6)
    assert len(results) == 16


def test_pieces_obey_the_same_rules(engine):
    assert [p.special for p in engine.pieces(["a b"])[0]] == [True, False, False, True]
    with pytest.raises(InvalidRequest):
        engine.pieces([""])
