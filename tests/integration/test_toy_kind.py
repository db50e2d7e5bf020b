"""A kind of work added by one class and one table line (work_kinds.py), in tests only
(toy_kind_serve.py), is served end to end: checked and tokenized by the HTTP side, computed
and finished by the model side, its answer across the engine process's socket under
``--workers 2``, the same answer in one process."""

import numpy as np
import pytest

from embedsvc.model.fake import FakeEncoder

from .. import loopback
from .servers import running

TOY_EMBEDSVC = ["python", "-m", "tests.integration.toy_kind_serve", "serve", "--port", "0"]
TEXTS = ["one", "two words", "and three more words here"]


def expected() -> list[list[float]]:
    """What the toy kind computes: each input's wrapped token count, and the first component
    of the fake encoder's raw row for it."""
    enc = FakeEncoder(dimension=384, max_input_tokens=256, record=False)
    ids = [enc.wrap(t) for t in enc.tokenize(TEXTS)]
    rows = enc.encode(ids)
    return [[float(len(i)), float(rows[k][0])] for k, i in enumerate(ids)]


@pytest.mark.parametrize("launch", [[], ["--workers", "2"]], ids=["one process", "workers 2"])
def test_a_kind_added_by_one_class_and_one_table_line_is_served(tmp_path, launch):
    with running([*TOY_EMBEDSVC, *launch], tmp_path / "server.log") as server:
        resp = loopback.post(server.url + "/toy/lengths", json={"texts": TEXTS})
        assert resp.status_code == 200, resp.text
        assert int(resp.headers["x-compute-tokens"]) == sum(int(r[0]) for r in expected())
        got = resp.json()["rows"]
        # the kinds that were there still answer beside it
        assert loopback.post(server.url + "/embed", json={"inputs": TEXTS}).status_code == 200
    np.testing.assert_allclose(got, expected(), rtol=1e-6)
