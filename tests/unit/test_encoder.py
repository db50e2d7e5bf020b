"""encoder.py: the fake encoder's exact answers and the helpers around the real one."""

import os

import numpy as np

from embedsvc.model.device import resolve_dtype
from embedsvc.model.encoder import model_name
from embedsvc.model.fake import FakeEncoder


def test_fake_rows_do_not_depend_on_the_batch():
    enc = FakeEncoder(dimension=4)
    a, b = enc.wrap(enc.tokenize(["a b c"])[0]), enc.wrap(enc.tokenize(["d"])[0])
    together = enc.encode([a, b])
    np.testing.assert_allclose(together[1], enc.encode([b])[0], rtol=1e-6)
    assert enc.batches[0] == [a, b]


def test_fake_pieces_have_offsets_and_special_tokens():
    pieces = FakeEncoder(max_input_tokens=4).pieces(["ab cd ef"])[0]
    assert [(p.text, p.start, p.stop) for p in pieces[1:-1]] == [("ab", 0, 2), ("cd", 3, 5)]
    assert pieces[0].special and pieces[-1].special


def test_model_name_never_shows_a_local_path(tmp_path):
    assert model_name("") == "all-MiniLM-L6-v2"
    assert model_name("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"
    local = tmp_path / "models" / "mine"
    local.mkdir(parents=True)
    assert model_name(str(local)) == "mine"
    assert model_name(str(local) + os.sep) == "mine"


def test_dtype_auto_is_half_on_cuda_only():
    assert resolve_dtype("auto", "cuda:0") == "float16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
