"""engine_client.py: the request path of a loaded model, without HTTP."""

import threading
import time

import numpy as np
import pytest

from embedsvc.engine_client import EngineClient
from embedsvc.errors import DeadlineExceeded, InvalidRequest, Overloaded
from embedsvc.metrics import Metrics
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import local_client
from embedsvc.settings import Settings
from embedsvc.work_kinds import l2_normalize

from .conftest import make_app


@pytest.fixture
def engine(registry):
    settings = Settings(max_inputs_per_request=8, max_queue=64, max_input_chars=50)
    encoder = FakeEncoder(dimension=6, max_input_tokens=8)
    engine = local_client(settings, encoder, Metrics(registry))
    yield engine
    engine.shutdown(timeout=1)


def batcher_of(engine):
    return engine.port.runner.batcher


def test_embed_returns_normalised_rows_in_order_and_counts_tokens(engine):
    texts = ["one", "two words", "three more words"]
    out = engine.embed(texts)
    expected = np.stack([engine.text.expected(t) for t in texts])
    np.testing.assert_allclose(out.vectors, expected, rtol=1e-6)
    assert out.tokens == sum(len(t.split()) + 2 for t in texts)
    assert out.total_s >= out.tokenize_s >= 0


def test_embed_applies_dimensions_then_normalises_or_not(engine):
    raw = engine.embed(["hello world"], normalize=False).vectors
    cut = engine.embed(["hello world"], dimensions=3).vectors
    np.testing.assert_allclose(cut, l2_normalize(raw[:, :3]), rtol=1e-6)
    assert engine.embed(["hello world"], dimensions=3, normalize=False).vectors.shape == (1, 3)


def test_a_one_input_answer_is_its_row_normalised_with_the_batch_and_only_where_whole(engine):
    """The batcher normalises a one-input request's row with its batch (``Batcher.unit``):
    the answer is exactly the raw row normalised; with ``dimensions`` the cut row is
    normalised in the request's thread, and ``normalize: false`` keeps the raw row."""
    assert batcher_of(engine).unit is l2_normalize
    raw = engine.embed(["hello world"], normalize=False).vectors
    np.testing.assert_array_equal(engine.embed(["hello world"]).vectors, l2_normalize(raw))
    np.testing.assert_array_equal(engine.embed(["hello world"], dimensions=3).vectors,
                                  l2_normalize(raw[:, :3]))
    assert not np.allclose(np.linalg.norm(raw), 1.0)


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
    assert batcher_of(engine).admitted == 0


def test_token_ids_and_their_text_give_the_same_row(engine):
    ids = engine.text.tokenize(["hello world"])[0]
    np.testing.assert_allclose(engine.embed([ids]).vectors, engine.embed(["hello world"]).vectors)


def test_truncation_keeps_the_right_end_when_asked(engine):
    words = [f"w{i}" for i in range(12)]
    left = engine.tokens([" ".join(words)], direction="left")[0]
    assert left == engine.text.wrap(engine.text.tokenize([" ".join(words[-6:])])[0])


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
        np.testing.assert_allclose(rows[1], engine.text.expected(f"second {i}"), rtol=1e-6)
    assert len(results) == 16


def test_pieces_obey_the_same_rules(engine):
    assert [p.special for p in engine.pieces(["a b"])[0]] == [True, False, False, True]
    with pytest.raises(InvalidRequest):
        engine.pieces([""])


# -- admission before tokenizing, tokenizing within the deadline, texts cut first --------


class Spy(FakeEncoder):
    """Records, at each tokenize or pieces call, what was admitted and what was asked."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple] = []
        self.engine = None
        self.pause_s = 0.0
        self.error: Exception | None = None

    def _seen(self, kind, n, limit=None, direction=None):
        self.calls.append((kind, n, batcher_of(self.engine).admitted, limit, direction))
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
    assert batcher_of(spy.engine).admitted == 0


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
    assert (batcher_of(spy.engine).admitted, batcher_of(spy.engine).admission.used_tokens) == (0, 0)


def test_tokenizing_stops_at_the_deadline_with_504(spy):
    spy.pause_s = 0.05  # per chunk of 256 inputs
    with pytest.raises(DeadlineExceeded):
        spy.engine.embed(["word"] * 600, deadline=time.monotonic() + 0.08)
    assert [c[1] for c in spy.calls] == [256, 256]  # the third chunk never started
    assert batcher_of(spy.engine).admitted == 0


def test_tokenize_route_runs_under_the_hosts_admission(spy):
    """Admitted, as every route is, but on the host's budget: /tokenize never reaches the
    device, so the device's admission does not count it (issue 26, finding 11)."""
    held = []
    pieces = spy.pieces
    spy.pieces = lambda texts: (held.append(spy.engine.host.used_inputs), pieces(texts))[1]
    rows = spy.engine.pieces(["a b", "c"])
    assert spy.calls == [("pieces", 2, 0, None, None)] and held == [2]
    assert [p.text for p in rows[0]] == ["[CLS]", "a", "b", "[SEP]"]
    assert batcher_of(spy.engine).admitted == 0 == spy.engine.host.used_inputs


def test_tokenize_and_decode_are_admitted_on_their_own_cost_not_the_devices(engine):
    """/tokenize and /decode never reach the device: its rate refuses only what does, and
    their budget is their own."""
    admission = batcher_of(engine).admission
    admission.observe(tokens=1, inputs=1, seconds=100.0)  # a very slow device
    # 1,000 s of this client's own work ahead of its next request
    held = batcher_of(engine).admit(1, 10, time.monotonic() + 5, flow="client")
    try:
        with pytest.raises(Overloaded):
            engine.embed(["hello"], flow="client")
        assert [p.text for p in engine.pieces(["a b"])[0] if not p.special] == ["a", "b"]
        assert engine.decode([[5, 6]]) == ["w5 w6"]
        hogged = engine.host.admit(1, 1 << 30, time.monotonic() + 5)  # the host's budget full
        try:
            assert engine.embed(["hello"], deadline=time.monotonic() + 2000,
                                flow="client").vectors.shape[0] == 1
        finally:
            engine.host.cancel(hogged)
    finally:
        admission.cancel(held)
    assert batcher_of(engine).admitted == 0 == engine.host.used_inputs


def test_embed_all_takes_at_most_its_cap(engine):
    from embedsvc.work_kinds import EMBED_ALL_MAX_INPUTS

    assert EMBED_ALL_MAX_INPUTS == 32
    small = EngineClient(Settings(max_inputs_per_request=64), engine.text, engine.port)
    with pytest.raises(InvalidRequest) as info:
        small.embed_all(["x"] * 33)
    assert info.value.code == "too_many_inputs" and "(32)" in info.value.message
    assert len(small.embed_all(["x"] * 32)[0]) == 32


def test_embed_all_gives_the_device_back_after_each_input_at_the_models_limit(engine):
    """Its slices hold at most one input at the model's limit (8 tokens here), so another
    client waits for that much compute between two of them, not for a batch."""
    runs = []
    encode_tokens = engine.text.encode_tokens

    def recorded(batch):
        runs.append([len(ids) for ids in batch])
        return encode_tokens(batch)

    engine.text.encode_tokens = recorded
    rows, tokens = engine.embed_all(["a b", "a b", "a b c d e f", "a", "a"])
    assert [len(r) for r in rows] == [4, 4, 8, 3, 3] and tokens == 22
    assert runs == [[4, 4], [8], [3, 3]]  # in order; no run over 8 padded tokens
