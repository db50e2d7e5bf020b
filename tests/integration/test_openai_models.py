"""``GET /v1/models`` and ``/v1/models/{model}`` through the official ``openai`` client, which
many OpenAI-compatible tools call first (issue 41, point 4): the served model is listed and
retrieved by its name; any other name is OpenAI's 404."""

from __future__ import annotations

import openai
import pytest

from .. import loopback


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_client_lists_and_retrieves_the_served_model(served, client):
    name = loopback.get(served.url + "/info", timeout=10).json()["model_id"]
    listed = client.models.list()
    assert [m.id for m in listed.data] == [name]
    assert listed.data[0].object == "model" and listed.data[0].owned_by == "embedsvc"
    got = client.models.retrieve(name)
    assert (got.id, got.object, got.created) == (name, "model", listed.data[0].created)


@pytest.mark.parametrize("other", ["text-embedding-3-small", "org/some-model"])
def test_another_model_is_openais_404(client, other):
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(other)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert other in error["message"]
