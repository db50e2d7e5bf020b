"""How requests name the models of one service (catalog.py, ``Service.choose``), over fake
encoders in one process: every route that takes a name takes the spellings the catalog
treats as one, and one model listed answers to the name it was given."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from embedsvc.api.wsgi import create_app
from embedsvc.metrics import Metrics
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service, serve_models
from embedsvc.settings import Settings


@pytest.fixture
def served(tmp_path) -> Iterator:
    """A started app around the models a ``models.toml`` text lists (each a fake encoder)."""
    started: list[Service] = []

    def serve(table: str):
        path = tmp_path / "models.toml"
        path.write_text(table)
        service = serve_models(Settings(models_file=str(path)), lambda own, i: Service(
            own, encoder=FakeEncoder(dimension=4 + i, max_input_tokens=16),
            metrics=Metrics(None)))
        for one in service.models:
            one.start(background=False)
        started.append(service)
        return create_app(service.settings, service=service).test_client()

    yield serve
    for service in started:
        service.drain(1)


TWO = ('[[models]]\nname = "emb"\nsource = "/m/emb"\naliases = ["nomic:latest"]\n\n'
       '[[models]]\nname = "other:latest"\nsource = "/m/other"\naliases = ["vision"]\n')


def test_a_name_or_alias_written_with_latest_is_found_without_it(served):
    """The catalog takes "x" and "x:latest" for one name (and refuses two models named so);
    a request naming "nomic" for the alias "nomic:latest" got 404."""
    client = served(TWO)
    for asked, dimension in (("nomic", 4), ("nomic:latest", 4), ("other", 5),
                             ("other:latest", 5), ("vision:latest", 5)):
        answer = client.post("/v1/embeddings", json={"model": asked, "input": "a"})
        assert answer.status_code == 200, (asked, answer.get_json())
        assert len(answer.get_json()["data"][0]["embedding"]) == dimension, asked
    assert client.get("/v1/models/nomic").status_code == 200
    assert client.post("/v1/embeddings", json={"model": "nope", "input": "a"}
                       ).status_code == 404


def test_ollamas_show_takes_the_aliases_its_embed_takes(served):
    client = served(TWO)
    for asked in ("vision", "vision:latest", "nomic"):
        assert client.post("/api/embed", json={"model": asked, "input": "a"}).status_code == 200
        shown = client.post("/api/show", json={"model": asked})
        assert shown.status_code == 200, (asked, shown.get_json())
    assert client.post("/api/show", json={"model": "nope"}).status_code == 404


def test_ollamas_tags_list_the_models_that_answer_when_one_does_not(served):
    """/v1/models leaves out a model whose engine cannot answer now; /api/tags refused the
    whole list with 503, and LangChain's client checks its model there."""
    client = served(TWO)
    service = client.application.extensions["embedsvc"]
    service.others[0].drain(1)  # its engine gone, as one being replaced is
    listed = client.get("/api/tags")
    assert listed.status_code == 200, listed.get_json()
    assert [m["name"] for m in listed.get_json()["models"]] == ["emb:latest"]


def test_one_model_listed_answers_to_the_name_it_was_given(served):
    """As its engine process names it under --workers N: one process named it after its
    source's directory, and a request for the given name got 404."""
    client = served('[[models]]\nname = "text-embedding-3-small"\nsource = "/m/emb"\n')
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == \
        ["text-embedding-3-small"]
    assert client.get("/v1/models/text-embedding-3-small").status_code == 200
