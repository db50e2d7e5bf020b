"""A pair of long texts costs what the model's window holds, on every pair route (issue 41,
point 7): one pair with two 20,000-character sides grew the server by gigabytes, since the
tokenizer's truncation of two long texts builds overflow pieces that grow with the product of
their lengths. The server's peak RSS may grow by 200 MiB at most per request, and the scores
are those of the tokenizer's own truncation (CrossEncoder.predict).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .. import loopback
from .conftest import kind_server
from .test_kinds import TOL

MiB = 1 << 20
SIDE = 20_000
# Many short tokens a character: the worst case for the overflow pieces.
A = ("how many people live in berlin ? " * 700)[:SIDE]
B = ("berlin had 3 , 520 , 031 registered inhabitants ! " * 500)[:SIDE]
# What the reference reads: both texts are far over the model's 128 tokens, so the
# truncation keeps the first tokens of each, half the budget apiece and the odd one to the
# longer text; prefixes that are still over the limit, and longer in the same order, keep the
# same tokens at a small cost (checked below).
PREFIX = 2_000
ROUTES = {
    "/rerank": ({"query": A, "texts": [B]}, lambda body: body[0]["score"]),
    "/v1/rerank": ({"query": A, "documents": [B]},
                   lambda body: body["results"][0]["relevance_score"]),
    "/v2/rerank": ({"query": A, "documents": [B]},
                   lambda body: body["results"][0]["relevance_score"]),
    "/predict": ({"inputs": [[B, A]]}, lambda body: body[0][0]["score"]),
}


@pytest.fixture(scope="module")
def reranker(kind_dirs, shared):
    server = kind_server(shared, kind_dirs, "reranker")
    with shared.use("reranker", exclusive=True):  # its peak RSS is this test's alone
        yield server


@pytest.fixture(scope="module")
def ref(kind_dirs):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(kind_dirs["reranker"]), device="cpu")


def memory(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) * 1024


def test_the_reference_reads_what_the_whole_texts_would_give(ref):
    tok = ref.tokenizer
    whole = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in (A, B)]
    cut = [len(tok(t[:PREFIX], add_special_tokens=False)["input_ids"]) for t in (A, B)]
    assert min(cut) > 128 and whole[0] != whole[1]
    assert (whole[0] > whole[1]) == (cut[0] > cut[1])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_two_long_sides_cost_the_window_and_score_as_truncated(route, reranker, ref):
    body, score_of = ROUTES[route]
    pid = reranker.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from now
    before = memory(pid, "VmRSS")
    resp = loopback.post(reranker.url + route, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    grown = memory(pid, "VmHWM") - before
    assert grown < 200 * MiB, f"{route}: peak RSS grew by {grown / MiB:.0f} MiB"
    first, second = (A, B) if route != "/predict" else (B, A)
    want = ref.predict([(first[:PREFIX], second[:PREFIX])])[0]
    assert abs(score_of(resp.json()) - want) <= TOL
