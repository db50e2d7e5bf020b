"""Rerankers, classifiers and sparse encoders through the real batcher: rows equal
sentence-transformers' own (CrossEncoder.predict, SparseEncoder.encode) within 1e-5."""

import threading
import time

import numpy as np
import pytest

from embedsvc.batching.batcher import Batcher, BatchLimits
from embedsvc.model.kinds import Detected, KindMismatch, detect, load_model, resolve
from embedsvc.model.scorer import CrossEncoderScorer
from embedsvc.model.sparse import SparseEmbedder, active
from embedsvc.settings import Settings, SettingsError
from embedsvc.work import Pair

QUERY = "How many people live in Berlin?"
DOCS = [
    "Berlin had a population of 3,520,031 registered inhabitants in an area of 891.82 km².",
    "Berlin is well known for its museums.",
    "The stock market fell sharply on Monday.",
    "short",
    "Ein Satz auf Deutsch, mit Umlauten: äöü.",
    "a long document " * 120,  # over the 128-token limit: truncated, longest first
]
PAIRS = [(QUERY, d) for d in DOCS] + [("a long query " * 100, "a short document")]
TEXTS = ["I loved this film.", "It was fine, I guess.", "Terrible. " * 80, "ok"]
TOL = 1e-5


def later(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


class Recorder:
    """The encoder's ``encode`` as the batcher calls it, recording each batch's sequences."""

    def __init__(self, encode):
        self._encode = encode
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, batch):
        assert self.gate.wait(30), "the test never opened the gate"
        self.batches.append(list(batch))
        return self._encode(batch)


@pytest.fixture(scope="module")
def encoders(kind_dirs):
    out = {}
    for kind, path in kind_dirs.items():
        enc = load_model(str(path))
        enc.place("cpu", "float32")
        out[kind] = enc
    return out


@pytest.fixture(scope="module")
def references(kind_dirs):
    from sentence_transformers import CrossEncoder, SparseEncoder

    return {
        "reranker": CrossEncoder(str(kind_dirs["reranker"]), device="cpu"),
        "classifier": CrossEncoder(str(kind_dirs["classifier"]), device="cpu"),
        "sparse": SparseEncoder(str(kind_dirs["sparse"]), device="cpu"),
    }


@pytest.fixture
def batched():
    """Start a real batcher around an encoder; every one is shut down in teardown."""
    started = []

    def start(encoder, **limits):
        recorder = Recorder(encoder.encode)
        batcher = Batcher(recorder, BatchLimits.from_settings(Settings(**limits)))
        batcher.start()
        started.append(batcher)
        return batcher, recorder

    yield start
    for batcher in started:
        assert batcher.shutdown(5).clean


def identity():
    import torch

    return torch.nn.Identity()


# -- what each kind is ------------------------------------------------------------------------


def test_tiny_models_are_detected_as_their_kind(kind_dirs, encoders):
    for kind, path in kind_dirs.items():
        assert detect(str(path)).kind == kind
        assert encoders[kind].info.kind == kind
    assert detect("").kind == "embedding"
    assert encoders["classifier"].info.labels == ("negative", "neutral", "positive")
    assert encoders["classifier"].info.dimension == 3
    assert encoders["reranker"].info.dimension == 1
    assert encoders["sparse"].info.dimension == encoders["sparse"].info.vocab_size == 30522
    assert isinstance(encoders["reranker"], CrossEncoderScorer)
    assert isinstance(encoders["sparse"], SparseEmbedder)


def test_the_bundled_model_directory_is_an_embedding_model():
    from embedsvc.model.encoder import bundled_model_path

    assert detect(bundled_model_path()).kind == "embedding"


def files(**content):
    return lambda name: content.get(name.split(".")[0])


@pytest.mark.parametrize(("found", "expected"), [
    (files(config_sentence_transformers={"model_type": "SentenceTransformer"}), "embedding"),
    (files(config_sentence_transformers={"model_type": "SparseEncoder"}), "sparse"),
    (files(config_sentence_transformers={"model_type": "CrossEncoder"},
           config={"id2label": {"0": "LABEL_0"}}), "reranker"),
    (files(config_sentence_transformers={"model_type": "CrossEncoder"},
           config={"id2label": {"0": "a", "1": "b"}}), "classifier"),
    # saves older than sentence-transformers v5 have no model_type
    (files(modules=[{"type": "sentence_transformers.models.Transformer"},
                    {"type": "sentence_transformers.models.Pooling"}]), "embedding"),
    (files(modules=[{"type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
                    {"type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]),
     "sparse"),
    # CrossEncoders before v4 saved a bare transformers classifier
    (files(config={"architectures": ["BertForSequenceClassification"], "num_labels": 1}),
     "reranker"),
    (files(config={"architectures": ["XLMRobertaForSequenceClassification"],
                   "id2label": {"0": "neg", "1": "neu", "2": "pos"}}), "classifier"),
    (files(config={"architectures": ["BertForMaskedLM"]}), "sparse"),
    (files(config={"architectures": ["BertModel"]}), "embedding"),
    (files(), "embedding"),
])
def test_detection_reads_what_each_library_writes(found, expected):
    assert detect("some/model", read=found).kind == expected


def test_kind_setting_overrides_detection(kind_dirs):
    reranker = str(kind_dirs["reranker"])
    assert resolve("auto", reranker).kind == "reranker"
    assert resolve("classifier", reranker) == Detected("classifier", "the KIND setting")
    assert Settings(kind="Classifier").kind == "classifier"
    assert Settings.from_env({"EMBEDSVC_KIND": "sparse"}).kind == "sparse"
    with pytest.raises(SettingsError, match="KIND"):
        Settings(kind="colbert")


def test_a_one_label_model_served_as_classifier(kind_dirs, references):
    enc = load_model(str(kind_dirs["reranker"]), "classifier")
    enc.place("cpu", "float32")
    assert enc.info.kind == "classifier" and enc.info.labels == ("score",)
    scores = enc.activate(enc.encode(enc.tokenize_sequences(PAIRS[:2], "right")), raw=False)
    np.testing.assert_allclose(scores[:, 0], references["reranker"].predict(PAIRS[:2]), atol=TOL)


@pytest.mark.parametrize(("model", "kind", "head"), [
    ("", "reranker", "a classification"), ("", "classifier", "a classification"),
    ("", "sparse", "a masked-language-model"), ("sparse", "reranker", "a classification"),
    ("reranker", "sparse", "a masked-language-model")])
def test_a_kind_whose_head_the_model_lacks_is_refused_before_it_loads(kind_dirs, model, kind,
                                                                     head, monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError(f"{model or 'the bundled model'} loaded as {kind}")

    monkeypatch.setattr(CrossEncoderScorer, "load", loaded)
    monkeypatch.setattr(SparseEmbedder, "load", loaded)
    path = str(kind_dirs[model]) if model else ""
    with pytest.raises(KindMismatch, match=f"KIND={kind} needs a model with {head} head"):
        load_model(path, kind)


def test_any_model_may_be_served_as_embeddings(kind_dirs):
    for kind in ("reranker", "sparse"):  # its transformer, pooled: no weights made up
        assert resolve("embedding", str(kind_dirs[kind])).kind == "embedding"


def test_a_classifier_cannot_be_served_as_reranker(kind_dirs):
    with pytest.raises(ValueError, match="KIND=classifier"):
        load_model(str(kind_dirs["classifier"]), "reranker")


def test_loading_a_model_as_the_wrong_kind_says_which_setting_to_change(kind_dirs, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')  # no weights to load
    with pytest.raises(RuntimeError, match="as a sparse model .*set KIND"):
        load_model(str(tmp_path), "sparse")


def test_a_directory_that_holds_no_model_is_refused_before_loading(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model\n")
    with pytest.raises(RuntimeError, match="holds no config.json or modules.json"):
        load_model(str(tmp_path), "sparse")


# -- tokenization -----------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_pairs_tokenize_as_cross_encoder_does(encoders, references, side):
    enc, ref = encoders["reranker"], references["reranker"]
    ref.tokenizer.truncation_side = side
    try:
        want = ref.preprocess(PAIRS)
    finally:
        ref.tokenizer.truncation_side = "right"
    got = enc.tokenize_sequences(PAIRS, side)
    assert all(isinstance(p, Pair) for p in got)
    mask = want["attention_mask"].numpy()
    for row, pair in enumerate(got):
        n = int(mask[row].sum())
        assert list(pair) == want["input_ids"][row, :n].tolist()
        types = [0] * pair.second + [1] * (len(pair) - pair.second)
        assert types == want["token_type_ids"][row, :n].tolist()
    assert max(len(p) for p in got) == enc.info.max_input_tokens == 128


def test_untruncated_pairs_keep_every_token(encoders):
    enc = encoders["reranker"]
    whole = enc.tokenize_sequences(PAIRS, None)
    assert len(whole[5]) > enc.info.max_input_tokens
    cut = enc.tokenize_sequences(PAIRS[:5], "right")
    assert [len(p) for p in whole[:5]] == [len(p) for p in cut]


# -- rows through the batcher equal sentence-transformers' -------------------------------------


def test_reranker_scores_equal_cross_encoder_predict(encoders, references, batched):
    enc, ref = encoders["reranker"], references["reranker"]
    batcher, _ = batched(enc)
    for pairs in ([PAIRS[0]], PAIRS):
        rows = batcher.submit(enc.tokenize_sequences(pairs, "right"), later()).result()
        assert rows.shape == (len(pairs), 1)
        np.testing.assert_allclose(enc.activate(rows, raw=False)[:, 0], ref.predict(pairs),
                                   atol=TOL)
        np.testing.assert_allclose(enc.activate(rows, raw=True)[:, 0],
                                   ref.predict(pairs, activation_fn=identity()), atol=TOL)


def test_classifier_scores_equal_cross_encoder_predict(encoders, references, batched):
    enc, ref = encoders["classifier"], references["classifier"]
    batcher, _ = batched(enc)
    for pairs in ([PAIRS[1]], PAIRS):
        rows = batcher.submit(enc.tokenize_sequences(pairs, "right"), later()).result()
        assert rows.shape == (len(pairs), 3)
        np.testing.assert_allclose(enc.activate(rows, raw=False),
                                   ref.predict(pairs, apply_softmax=True), atol=TOL)
        np.testing.assert_allclose(enc.activate(rows, raw=True),
                                   ref.predict(pairs, activation_fn=identity()), atol=TOL)
        assert np.allclose(enc.activate(rows, raw=False).sum(axis=1), 1.0)


def test_classifier_scores_single_texts_as_cross_encoder_does(encoders, references, batched):
    enc, ref = encoders["classifier"], references["classifier"]
    batcher, _ = batched(enc)
    rows = batcher.submit(enc.tokenize_sequences(TEXTS, "right"), later()).result()
    want = np.stack([ref.predict(text, apply_softmax=True) for text in TEXTS])
    np.testing.assert_allclose(enc.activate(rows, raw=False), want, atol=TOL)
    raw = np.stack([ref.predict(text, activation_fn=identity()) for text in TEXTS])
    np.testing.assert_allclose(enc.activate(rows, raw=True), raw, atol=TOL)


def sparse_ids(enc, texts):
    """Wrapped ids, truncated to the model's limit as the engine does for any single text."""
    limit = enc.info.max_input_tokens - enc.special_tokens
    return [enc.wrap(ids[:limit]) for ids in enc.tokenize(texts)]


def reference_sparse(ref, texts):
    coo = ref.encode(texts, convert_to_sparse_tensor=True).coalesce()
    indices, values = coo.indices().numpy(), coo.values().numpy()
    return [(indices[1][indices[0] == i], values[indices[0] == i]) for i in range(len(texts))]


def assert_sparse_equal(got, want):
    assert len(got) == len(want)
    for (gi, gv), (wi, wv) in zip(got, want, strict=True):
        # a value within float noise of 0 may be active on one side only
        both = np.intersect1d(gi, wi)
        only = np.setxor1d(gi, wi)
        assert len(both) > 0
        dense_g = dict(zip(gi.tolist(), gv.tolist(), strict=True))
        dense_w = dict(zip(wi.tolist(), wv.tolist(), strict=True))
        for i in only.tolist():
            assert abs(dense_g.get(i, 0.0) - dense_w.get(i, 0.0)) <= TOL
        np.testing.assert_allclose([dense_g[i] for i in both], [dense_w[i] for i in both],
                                   atol=TOL)


def test_sparse_vectors_equal_sparse_encoder_encode(encoders, references, batched):
    enc, ref = encoders["sparse"], references["sparse"]
    batcher, _ = batched(enc)
    for texts in ([TEXTS[0]], TEXTS + DOCS):
        rows = batcher.submit(sparse_ids(enc, texts), later()).result()
        assert rows.shape == (len(texts), enc.info.dimension)
        got = active(rows)
        assert all(0 < len(i) < enc.info.dimension // 4 for i, _ in got)  # sparse, not empty
        assert_sparse_equal(got, reference_sparse(ref, texts))


def test_sparse_max_active_dims_keeps_the_largest(encoders, references):
    enc, ref = encoders["sparse"], references["sparse"]
    rows = enc.encode(sparse_ids(enc, TEXTS))
    got = active(rows, max_active_dims=7)
    assert [len(i) for i, _ in got] == [7] * len(TEXTS)
    want = ref.encode(TEXTS, max_active_dims=7, convert_to_sparse_tensor=True).coalesce()
    assert len(want.values()) == 7 * len(TEXTS)
    assert_sparse_equal(got, reference_sparse_from(want, len(TEXTS)))


def reference_sparse_from(coo, n):
    indices, values = coo.indices().numpy(), coo.values().numpy()
    return [(indices[1][indices[0] == i], values[indices[0] == i]) for i in range(n)]


# -- concurrency: no crosstalk, order kept ----------------------------------------------------


def concurrent(batcher, recorder, requests):
    """Submit every request from its own thread while the device is held, then release it."""
    results: list = [None] * len(requests)
    errors: list = []
    submitted = threading.Barrier(len(requests) + 1)

    def client(i):
        try:
            job = batcher.submit(requests[i], later())
            submitted.wait(30)
            results[i] = job.result()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            submitted.abort()

    recorder.gate.clear()  # the first batch waits until every request is queued
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    submitted.wait(30)
    recorder.gate.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def request_mix(n_requests, pool, seed):
    rng = np.random.default_rng(seed)
    return [[int(i) for i in rng.choice(len(pool), size=rng.integers(1, 6))]
            for _ in range(n_requests)]


def test_concurrent_rerank_requests_get_their_own_scores_in_order(encoders, references, batched):
    enc, ref = encoders["reranker"], references["reranker"]
    want = ref.predict(PAIRS, activation_fn=identity())
    batcher, recorder = batched(enc, max_batch_size=16, max_batch_tokens=4096)
    picks = request_mix(32, PAIRS, seed=1)
    requests = [enc.tokenize_sequences([PAIRS[i] for i in pick], "right") for pick in picks]
    results = concurrent(batcher, recorder, requests)
    for pick, rows in zip(picks, results, strict=True):
        np.testing.assert_allclose(rows[:, 0], want[pick], atol=TOL)
    assert max(len(b) for b in recorder.batches) > 5  # requests shared batches
    assert all(len(b) * max(map(len, b)) <= 4096 for b in recorder.batches)


def test_concurrent_classifier_requests_mix_pairs_and_texts(encoders, references, batched):
    enc, ref = encoders["classifier"], references["classifier"]
    inputs = PAIRS + TEXTS
    want = np.concatenate([ref.predict(PAIRS, activation_fn=identity()),
                           np.stack([ref.predict(t, activation_fn=identity()) for t in TEXTS])])
    batcher, recorder = batched(enc, max_batch_size=16)
    picks = request_mix(32, inputs, seed=2)
    requests = [enc.tokenize_sequences([inputs[i] for i in pick], "right") for pick in picks]
    results = concurrent(batcher, recorder, requests)
    for pick, rows in zip(picks, results, strict=True):
        np.testing.assert_allclose(rows, want[pick], atol=TOL)
    assert any(len({p.second == len(p) for p in b}) == 2 for b in recorder.batches)


def test_concurrent_sparse_requests_get_their_own_vectors(encoders, references, batched):
    enc, ref = encoders["sparse"], references["sparse"]
    inputs = TEXTS + DOCS
    want = reference_sparse(ref, inputs)
    batcher, recorder = batched(enc, max_batch_size=8)
    picks = request_mix(32, inputs, seed=3)
    tokens = sparse_ids(enc, inputs)
    results = concurrent(batcher, recorder, [[tokens[i] for i in pick] for pick in picks])
    for pick, rows in zip(picks, results, strict=True):
        assert_sparse_equal(active(rows), [want[i] for i in pick])
    assert max(len(b) for b in recorder.batches) > 5


def test_a_hub_id_with_no_model_files_says_why_offline_and_online(monkeypatch):
    from huggingface_hub import constants

    from embedsvc.model.kinds import _not_a_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "not in the hub cache" in _not_a_model("no-such-org/no-such-model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert "holds no config.json or modules.json" in _not_a_model("no-such-org/no-such-model")
