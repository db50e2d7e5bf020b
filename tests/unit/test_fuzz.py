"""Property-based fuzzing of every POST route: no 5xx, every error in the contract's shape."""

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedsvc.model.fake import FakeEncoder

from .conftest import build_app

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(
    allow_nan=False, allow_infinity=False) | st.text(max_size=40)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.text(max_size=10), inner, max_size=5), max_leaves=20)
texts = st.text(min_size=0, max_size=60)
token_ids = st.lists(st.integers(-5, 1100), max_size=20)

FIELDS = {
    "/v1/embeddings": {
        "input": texts | st.lists(texts, max_size=6) | token_ids | st.lists(token_ids, max_size=4),
        "model": st.text(max_size=20) | scalars,
        "encoding_format": st.sampled_from(["float", "base64", "hex", ""]) | scalars,
        "dimensions": st.integers(-3, 12) | scalars,
        "user": scalars,
    },
    "/embed": {
        "inputs": texts | st.lists(texts, max_size=6) | token_ids | st.lists(token_ids, max_size=4)
        | scalars,
        "normalize": st.booleans() | scalars,
        "truncate": st.booleans() | scalars,
        "truncation_direction": st.sampled_from(["right", "left", "Left", "up"]) | scalars,
        "prompt_name": st.none() | st.text(max_size=8),
        "dimensions": st.integers(-3, 12) | scalars,
    },
    "/tokenize": {"inputs": texts | st.lists(texts, max_size=6) | scalars},
    "/embed_all": {
        "inputs": texts | st.lists(texts, max_size=6) | token_ids | st.lists(token_ids, max_size=4),
        "truncate": st.booleans() | scalars,
        "truncation_direction": st.sampled_from(["right", "left", "Left", "up"]) | scalars,
        "prompt_name": st.none() | st.text(max_size=8),
    },
    "/decode": {
        "ids": token_ids | st.lists(token_ids, max_size=4) | scalars,
        "skip_special_tokens": st.booleans() | scalars,
    },
}


def bodies(route: str):
    fields = FIELDS[route]
    shaped = st.fixed_dictionaries({}, optional={k: v | json_values for k, v in fields.items()})
    return st.one_of(shaped.map(orjson.dumps), json_values.map(orjson.dumps),
                     st.binary(max_size=200))


@pytest.fixture(scope="module")
def app():
    from prometheus_client import CollectorRegistry

    fake = FakeEncoder(max_input_tokens=16)
    application = build_app(fake, CollectorRegistry(), max_inputs_per_request=8, max_queue=64)
    yield application
    application.extensions["embedsvc"].drain(timeout=1)


@pytest.mark.parametrize("route", sorted(FIELDS))
def test_fuzzed_bodies_never_get_a_5xx(app, route):
    client = app.test_client()

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(body=bodies(route))
    def check(body: bytes) -> None:
        resp = client.post(route, data=body, content_type="application/json")
        assert resp.status_code in (200, 400, 413), (body, resp.status_code, resp.data[:300])
        if resp.status_code != 200:
            err = resp.get_json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["message"]

    check()
    resp = client.post("/embed", json={"inputs": "alive after fuzzing"})
    assert resp.status_code == 200
