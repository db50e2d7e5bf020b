"""shapes.py through the request models: list fields checked by shape, counted first, the
first wrong item named by position, in a message that says what the route takes."""

import time

import pytest
from pydantic import Field

from embedsvc.api.bodies import parse
from embedsvc.api.routes import ROUTES
from embedsvc.api.schemas import (
    CohereRerankRequest,
    DecodeRequest,
    EmbeddingsRequest,
    EmbedRequest,
    PredictRequest,
    Request,
    RerankRequest,
    SimilarityRequest,
    TokenizeRequest,
)
from embedsvc.api.shapes import _SLICE, _first_not
from embedsvc.api.web import Call
from embedsvc.errors import InvalidRequest
from embedsvc.model.fake import FakeEncoder
from embedsvc.service import Service
from embedsvc.settings import Settings

from ..lists import MB, invalid_lists, list_fields

LIMIT = {"max_inputs": 4}


def refused(model, body):
    with pytest.raises(InvalidRequest) as info:
        model.model_validate(body, context=LIMIT)
    return info.value


@pytest.mark.parametrize(("model", "body", "param", "says"), [
    (EmbedRequest, {"inputs": [1, 2, 1.5]}, "inputs", "item 2 is a number (1.5)"),
    (EmbedRequest, {"inputs": [[1], [2, True]]}, "inputs", "item 1, position 1, is true or false"),
    (EmbedRequest, {"inputs": ["a", [5]]}, "inputs", "item 1 is a list"),
    (EmbedRequest, {"inputs": {"a": 1}}, "inputs", "not an object"),
    (EmbeddingsRequest, {"input": ["a", None]}, "input", "item 1 is null"),
    (TokenizeRequest, {"inputs": [[1, 2]]}, "inputs", "item 0 is a list"),
    (DecodeRequest, {"ids": ["a"]}, "ids", "item 0 is a string"),
    (RerankRequest, {"query": "q", "texts": "a"}, "texts", "not a string"),
    (CohereRerankRequest, {"query": "q", "documents": ["a", {"txt": "b"}]}, "documents",
     "item 1 is an object"),
    (PredictRequest, {"inputs": [["a", "b"], ["c", 3]]}, "inputs",
     "item 1, position 1, is an integer (3)"),
    (SimilarityRequest, {"inputs": {"source_sentence": "a", "sentences": ["b", 2]}}, "inputs",
     "item 1 is an integer (2)"),
])
def test_the_first_wrong_item_is_named_by_position(model, body, param, says):
    err = refused(model, body)
    assert err.param == param and err.code == f"invalid_{param}"
    assert says in err.message, err.message


@pytest.mark.parametrize(("model", "body"), [
    (PredictRequest, {"inputs": [["a", 1]]}),
    (SimilarityRequest, {"inputs": {"source_sentence": "a", "sentences": [1]}}),
    (TokenizeRequest, {"inputs": [1]}),
    (RerankRequest, {"query": "q", "texts": [1]}),
])
def test_routes_that_take_no_token_ids_do_not_ask_for_them(model, body):
    assert "token ids" not in refused(model, body).message


def test_the_count_is_checked_before_any_item():
    err = refused(EmbedRequest, {"inputs": ["a"] * 5 + [1.5]})
    assert err.code == "too_many_inputs" and "MAX_INPUTS_PER_REQUEST (4)" in err.message
    err = refused(CohereRerankRequest, {"query": "q", "documents": ["a"] * 5 + [None]})
    assert err.code == "too_many_inputs" and err.param == "documents"
    # one input's token ids are not a count of inputs
    assert EmbedRequest.model_validate({"inputs": [1] * 10}, context=LIMIT).inputs == [1] * 10


def test_decode_ids_are_totalled_before_any_item_is_checked():
    context = {**LIMIT, "max_ids": 10}
    with pytest.raises(InvalidRequest) as caught:  # the 1.5 is never looked at
        DecodeRequest.model_validate({"ids": [[1] * 6, [1] * 4 + [1.5]]}, context=context)
    assert caught.value.status == 413 and caught.value.code == "too_many_ids"
    assert "11 token ids" in caught.value.message and "MAX_QUEUE_TOKENS, 10" in caught.value.message
    assert DecodeRequest.model_validate({"ids": [[1] * 6, [2] * 4]}, context=context).ids == [
        [1] * 6, [2] * 4]


def test_valid_shapes_pass_as_sent_and_documents_become_texts():
    for inputs in ("a", ["a", "b"], [1, 2], [[1], [2, 3]], []):
        assert EmbedRequest.model_validate({"inputs": inputs}, context=LIMIT).inputs == inputs
    req = CohereRerankRequest.model_validate(
        {"query": "q", "documents": ["a", {"text": "b", "title": "x"}]}, context=LIMIT)
    assert req.documents == ["a", "b"]
    assert PredictRequest.model_validate({"inputs": ["a", "b"]}).inputs == ["a", "b"]


@pytest.mark.parametrize("where", [1, _SLICE - 1, _SLICE, _SLICE + 1, 3 * _SLICE + 7 - 1])
def test_the_first_wrong_item_is_found_in_any_slice(where):
    ids = [1] * (3 * _SLICE + 8)
    ids[where] = 1.5
    ids[-1] = "late"  # a later wrong item is not the one named
    message = refused(EmbedRequest, {"inputs": ids}).message
    assert f"item {where} is a number (1.5)" in message, message
    assert _first_not([1] * (2 * _SLICE), int) is None


# every request model a route parses: the table's, and Cohere's shape that /rerank also reads
MODELS = sorted({r.request for r in ROUTES if r.request} | {CohereRerankRequest},
                key=lambda m: m.__name__)
LIST_FIELDS = [(m, path) for m in MODELS for path in list_fields(m)]


def test_every_family_has_list_fields_here():
    names = {m.__name__ for m, _ in LIST_FIELDS}
    assert {"CohereEmbedRequest", "OllamaEmbedRequest", "TypedEmbeddingsRequest",
            "EmbedRequest", "SimilarityRequest", "CohereRerankRequest"} <= names, names


@pytest.mark.parametrize(("model", "path"), LIST_FIELDS,
                         ids=[f"{m.__name__}.{'.'.join(p)}" for m, p in LIST_FIELDS])
def test_every_list_field_is_checked_by_its_shape_before_pydantic(model, path):
    """Through the one request path: a long list with one wrong item at its end is refused
    by its shape (counted first, the wrong item named), never item by item by pydantic,
    whose error per item froze the process (issue 41: Cohere's texts, embedding_types,
    Ollama's input)."""
    service = Service(Settings(), encoder=FakeEncoder())
    for label, body in invalid_lists(model, path, size=MB // 4):  # under the lane's size
        with pytest.raises(InvalidRequest) as caught:
            parse(model, Call(service, body, time.monotonic()))
        err = caught.value
        assert err.status == 400 and err.param == path[0], (label, err.param)
        # the shape's words ("must be ...; item N is"), or the count, never pydantic's
        assert " must be " in err.message or err.code == "too_many_inputs", (label, err.message)


def test_a_list_field_without_a_shape_fails_the_models_definition():
    with pytest.raises(TypeError, match="Bad.pairs: a list of .* has no shape"):
        class Bad(Request):
            pairs: list[tuple[str, str]] = Field(description="pairs")
    with pytest.raises(TypeError, match="Worse.texts: give it a Shape"):
        class Worse(Request):
            texts: dict[str, list[str]] = Field(description="texts by name")
