"""The request bodies (validated by pydantic) and response shapes; the source of /openapi.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    field_validator,
)

from .shapes import Shape, listed_fields


class Request(BaseModel):
    # strict: "1" is no integer and 1 is no string; unknown fields are ignored, as OpenAI does.
    # defer_build: each model's validator is built by its route's first request, not at
    # import; building all of them took a start about 0.05 CPU-seconds (tests/unit/test_start.py)
    model_config = ConfigDict(extra="ignore", strict=True, defer_build=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        listed_fields(cls)  # a list field no Shape can check fails here, at import


# The list fields: checked by a Shape (bounded by the body, see shapes.py), published in
# /openapi.json as the type they stand for.
_IDS_OR_TEXTS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
InputsField = Annotated[Any, PlainValidator(
    Shape(_IDS_OR_TEXTS, text=True, items=(str, int, list), inner=int),
    json_schema_input_type=StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]])]
MediaInputsField = Annotated[Any, PlainValidator(
    Shape(_IDS_OR_TEXTS + ", or a list of texts and images (image-text models: "
          '{"text": ...}, {"image": ...}, {"type": "image_url", "image_url": {"url": ...}})',
          text=True, items=(str, int, list), inner=int, media=True),
    json_schema_input_type=StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    | list[StrictStr | dict[str, Any]])]
TextsField = Annotated[Any, PlainValidator(
    Shape("a string or a list of strings", text=True, items=(str,)),
    json_schema_input_type=StrictStr | list[StrictStr])]
TextList = Annotated[Any, PlainValidator(Shape("a list of strings", items=(str,)),
                                         json_schema_input_type=list[StrictStr])]
IdsField = Annotated[Any, PlainValidator(
    Shape("a list of token ids or a list of lists of token ids", items=(int, list), inner=int,
          totalled=True),
    json_schema_input_type=list[StrictInt] | list[list[StrictInt]])]
PredictInputs = Annotated[Any, PlainValidator(
    Shape("a text, [text] or [text, text] (one pair), or a list of those", text=True,
          items=(str, list), inner=str, counted=(list,)),
    json_schema_input_type=StrictStr | list[StrictStr] | list[list[StrictStr]])]
Sentences = Annotated[Any, PlainValidator(
    Shape("a list of strings", items=(str,), name="inputs.sentences"),
    json_schema_input_type=list[StrictStr])]


class EmbeddingsRequest(Request):
    """POST /v1/embeddings, as the OpenAI API defines it."""

    input: InputsField = Field(
        description="Text, texts, token ids of one text, or token ids of several texts. Token "
        "ids are ids of the OpenAI tokenizer of 'model' (cl100k_base for text-embedding-* and "
        "unknown names, o200k_base where tiktoken maps the name to it), decoded to text; with "
        "the server setting TOKEN_IDS=model, ids of the served model without special tokens."
    )
    model: StrictStr | None = Field(
        None, description="With several models (MODELS), the one to use, by name or alias "
        "(404 for any other); with one, any name. It picks the OpenAI tokenizer of token-id "
        "input. The "
        "response names the served model."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'base64': the little-endian float32 bytes of each vector."
    )
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components, then L2-normalise again."
    )
    user: StrictStr | None = Field(None, description="Accepted and ignored.")


class _Truncation(Request):
    """The truncation fields TEI's routes share."""

    truncate: StrictBool | None = Field(
        None, description="Truncate over-long inputs; null: the server's AUTO_TRUNCATE."
    )
    truncation_direction: Literal["right", "left"] = Field(
        "right", description="Which end of an over-long input is cut."
    )

    @field_validator("truncation_direction", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        # TEI spells the directions "Right" and "Left".
        return value.lower() if isinstance(value, str) else value


_TEI_INPUTS = (
    "Text, texts, token ids of one text, or token ids of several texts. Token ids are the "
    "served model's own (see /tokenize); the model's special tokens are added unless the ids "
    "already carry them."
)
TeiInputs = InputsField


class EmbedAllRequest(_Truncation):
    """POST /embed_all, as text-embeddings-inference defines it: per-token vectors."""

    inputs: TeiInputs = Field(description=_TEI_INPUTS)
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each input (texts only)."
    )


class EmbedRequest(EmbedAllRequest):
    """POST /embed, as text-embeddings-inference defines it."""

    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components (then normalise, if asked)."
    )


class DecodeRequest(Request):
    """POST /decode, as text-embeddings-inference defines it: token ids back to text."""

    ids: IdsField = Field(
        description="Token ids of the served model: one list, or a list of lists."
    )
    skip_special_tokens: StrictBool = Field(True, description="Leave out [CLS], [SEP] etc.")


class TokenizeRequest(Request):
    """POST /tokenize, as text-embeddings-inference defines it."""

    inputs: TextsField = Field(description="Text or texts.")
    add_special_tokens: StrictBool = Field(
        True, description="With the special tokens the model's template puts around each "
        "text ([CLS] and [SEP] for a BERT model); false: the text's own tokens only.")
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each text (as /embed "
        "puts it); the offsets count in the prompted text.")


# -- rerankers, classifiers, sparse encoders, similarity (tei.py, cohere.py) ---------------------


class RerankRequest(_Truncation):
    """POST /rerank, as text-embeddings-inference defines it (a reranker model).

    A body with ``documents`` instead of ``texts`` is read as a CohereRerankRequest and
    answered in that shape."""

    query: StrictStr = Field(description="The query every text is scored against.")
    texts: TextList = Field(description="The texts to rank.")
    raw_scores: StrictBool = Field(
        False, description="Raw logits instead of the model's activation (sigmoid)."
    )
    return_text: StrictBool = Field(False, description="Put each text in its result.")


class DocumentText(Request):
    text: StrictStr


Documents = Annotated[Any, PlainValidator(
    Shape("a list of strings or {\"text\": ...} objects", items=(str, dict), mixed=True),
    json_schema_input_type=list[StrictStr | DocumentText])]


class CohereRerankRequest(Request):
    """POST /v1/rerank, /v2/rerank: the Cohere and Jina rerank shape (a reranker model).

    ``model``, ``rank_fields``, ``max_chunks_per_doc`` and ``max_tokens_per_doc`` are
    accepted and ignored: documents are truncated to the model's own limit."""

    query: StrictStr = Field(description="The query every document is scored against.")
    documents: Documents = Field(
        description="The documents to rank: strings or {\"text\": ...} objects."
    )
    top_n: int | None = Field(
        None, ge=1, strict=True, description="Return only the best N; null: all."
    )
    return_documents: StrictBool = Field(
        False, description="Put each document, as {\"text\": ...}, in its result."
    )
    model: StrictStr | None = Field(
        None, description="With one model, any name (the response names the served model); "
        "with several (MODELS), the one to use, by name or alias: 404 for any other."
    )


class PredictRequest(_Truncation):
    """POST /predict, as text-embeddings-inference defines it (a classifier or reranker)."""

    inputs: PredictInputs = Field(
        description="A text; [text] or [text, text] (one pair); or a list of those."
    )
    raw_scores: StrictBool = Field(
        False, description="Raw logits instead of softmax (sigmoid for one label)."
    )


class EmbedSparseRequest(_Truncation):
    """POST /embed_sparse, as text-embeddings-inference defines it (a sparse model)."""

    inputs: TextsField = Field(description="Text or texts.")
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each input."
    )


class SimilarityInputs(Request):
    source_sentence: StrictStr = Field(description="The text the others are compared with.")
    sentences: Sentences = Field(description="The texts compared with it.")


class SimilarityParameters(_Truncation):
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each text."
    )


class SimilarityRequest(Request):
    """POST /similarity, TEI's sentence-similarity task (an embedding model)."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


# -- Voyage's and Jina's fields on /v1/embeddings; Cohere's and Ollama's embed APIs ----------

_DTYPE_DOC = ("int8: each value in steps of one scale fixed per model (calibrated once, "
              "offline), -127..127, 0 for 0.0: compare int8 codes by dot product; uint8 = "
              "int8 + 128 (subtract 128 before a dot product); binary/ubinary: one bit per "
              "dimension (set for a value > 0), packed eight to a byte, binary = ubinary - "
              "128.")
QuantizedType = Literal["float", "int8", "uint8", "binary", "ubinary"]
CohereType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class TypedEmbeddingsRequest(EmbeddingsRequest):
    """POST /v1/embeddings with the fields Voyage's, Jina's, Infinity's and vLLM's clients
    add to OpenAI's (images: image-text models only)."""

    input: MediaInputsField = Field(
        None, description="Text, texts, token ids of one text, or token ids of several texts "
        "(see EmbeddingsRequest); for an image-text model also images, as Jina's "
        '{"image": ...} items or content parts {"type": "image_url", "image_url": {"url": '
        "...}}, each a base64 data URI (or an http(s) URL of a host IMAGE_URL_HOSTS lists). "
        "Required unless 'messages' is given.", json_schema_extra={"main": True}
    )
    modality: Literal["text", "image"] | None = Field(
        None, description="Infinity: 'image' reads every string of 'input' as an image."
    )
    messages: list[Any] | None = Field(
        None, description="vLLM: instead of 'input', one input a message, its content a "
        "string or one content part (text or image_url)."
    )

    input_type: StrictStr | None = Field(
        None, description="Voyage: 'query' or 'document', mapped to the model's prompts where "
        "it has them."
    )
    task: StrictStr | None = Field(
        None, description="Jina: retrieval.query, retrieval.passage, text-matching, "
        "classification or separation, mapped to the model's prompts where it has them."
    )
    output_dimension: StrictInt | None = Field(None, description="Voyage: as 'dimensions'.")
    output_dtype: QuantizedType | None = Field(None, description="Voyage. " + _DTYPE_DOC)
    embedding_type: Literal["float", "base64", "int8", "uint8", "binary", "ubinary"] | None = (
        Field(None, description="Jina: as output_dtype; 'base64' as encoding_format.")
    )
    truncation: StrictBool | None = Field(
        None, description="Voyage: false refuses over-long inputs; null: AUTO_TRUNCATE."
    )
    normalized: StrictBool | None = Field(
        None, description="Jina: false gives the model's raw vectors (float only)."
    )


class CohereEmbedRequest(Request):
    """POST /v1/embed, /v2/embed: Cohere's embed API: texts, and for an image-text model
    images (``images``, or ``inputs`` of content parts)."""

    texts: list[StrictStr] | None = Field(
        None, description="The texts to embed (or 'images', or 'inputs').",
        json_schema_extra={"main": True})
    model: StrictStr | None = Field(
        None, description="With one model, any name (the response names the served model); "
        "with several (MODELS), the one to use, by name or alias: 404 for any other."
    )
    input_type: StrictStr | None = Field(
        None, description="search_query, search_document, classification or clustering, "
        "mapped to the model's prompts where it has them."
    )
    embedding_types: list[CohereType] | None = Field(
        None, description="The types to answer (v2 default: float). base64: the little-endian "
        "float32 bytes. " + _DTYPE_DOC
    )
    truncate: Literal["NONE", "START", "END"] | None = Field(
        None, description="END (default) cuts the end of an over-long text, START its start; "
        "NONE refuses it."
    )
    output_dimension: StrictInt | None = Field(
        None, description="Keep the first N components, then L2-normalise again."
    )
    images: list[StrictStr] | None = Field(
        None, description="Images as base64 data URIs (image-text models; input_type "
        "'image')."
    )
    inputs: list[Any] | None = Field(
        None, description="Inputs as {\"content\": [part]}: one text or image_url part each "
        "(image-text models embed each part alone; several parts in one input are refused)."
    )
    max_tokens: StrictInt | None = Field(
        None, description="Refused: inputs are cut to the model's limit (see 'truncate')."
    )


class OllamaEmbedRequest(Request):
    """POST /api/embed: Ollama's embedding API."""

    model: StrictStr = Field("", description="With one model, any name; with several "
                             "(MODELS), the one to use (404 for any other).")
    input: StrictStr | list[StrictStr] = Field(description="Text or texts.")
    truncate: StrictBool | None = Field(
        None, description="false refuses over-long inputs; null: AUTO_TRUNCATE."
    )
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components, then L2-normalise again."
    )
    options: dict[str, Any] | None = Field(
        None, description="Accepted and ignored: the model runs with the server's settings."
    )
    keep_alive: StrictStr | float | None = Field(
        None, description="Accepted and ignored: the model stays loaded."
    )


class OllamaEmbeddingsRequest(Request):
    """POST /api/embeddings: Ollama's legacy embedding API (one prompt, raw vector)."""

    model: StrictStr = Field("", description="With one model, any name; with several "
                             "(MODELS), the one to use (404 for any other).")
    prompt: StrictStr = Field(description="The text to embed.")
    options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    keep_alive: StrictStr | float | None = Field(None, description="Accepted and ignored.")


class OllamaShowRequest(Request):
    """POST /api/show: the served model, by the name /api/tags lists."""

    model: StrictStr | None = Field(None, description="The name /api/tags lists.")
    name: StrictStr | None = Field(None, description="Older clients' spelling of 'model'.")
    verbose: StrictBool | None = Field(None, description="Accepted and ignored.")


# -- response shapes, as JSON schema ----------------------------------------------------------

OBJECT: dict[str, Any] = {"type": "object"}
VECTOR: dict[str, Any] = {"type": "array", "items": {"type": "number"}}
VECTORS: dict[str, Any] = {"type": "array", "items": VECTOR}
EMBEDDINGS_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "description": "Position in 'input'."},
                    "embedding": {
                        "oneOf": [VECTOR, {"type": "string", "contentEncoding": "base64"}]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "properties": {
                "prompt_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            },
        },
    },
}
OPENAI_MODEL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "description": "The served model's name."},
        "object": {"const": "model"},
        "created": {"type": "integer", "description": "Unix time this process first listed it."},
        "owned_by": {"const": "embedsvc"},
        "kind": {"type": "string", "description": "embedding, reranker, classifier, sparse "
                 "or image-text."},
        "dimensions": {"type": "integer", "description": "The width of its vectors or rows."},
        "modalities": {"type": "array", "items": {"enum": ["text", "image"]},
                       "description": "What it embeds: text, and image for an image-text "
                       "model."},
    },
}
OPENAI_MODELS: dict[str, Any] = {
    "type": "object",
    "properties": {"object": {"const": "list"},
                   "data": {"type": "array", "items": OPENAI_MODEL}},
}
PIECE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "text": {"type": "string"},
        "special": {"type": "boolean"},
        "start": {"type": ["integer", "null"], "description": "Character offset."},
        "stop": {"type": ["integer", "null"]},
    },
}
TOKENS: dict[str, Any] = {"type": "array", "items": {"type": "array", "items": PIECE}}
RANKS: dict[str, Any] = {
    "type": "array",
    "description": "Best first.",
    "items": {
        "type": "object",
        "required": ["index", "score"],
        "properties": {
            "index": {"type": "integer", "description": "Position in 'texts'."},
            "score": {"type": "number"},
            "text": {"type": "string", "description": "Only with return_text."},
        },
    },
}
COHERE_RERANK_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "results": {
            "type": "array",
            "description": "Best first, at most top_n.",
            "items": {
                "type": "object",
                "required": ["index", "relevance_score"],
                "properties": {
                    "index": {"type": "integer", "description": "Position in 'documents'."},
                    "relevance_score": {"type": "number"},
                    "document": {"type": "object", "properties": {"text": {"type": "string"}},
                                 "description": "Only with return_documents."},
                },
            },
        },
        "model": {"type": "string"},
        "usage": EMBEDDINGS_RESPONSE["properties"]["usage"],
    },
}
_PREDICTIONS: dict[str, Any] = {
    "type": "array",
    "description": "Every label, best first.",
    "items": {"type": "object", "properties": {"label": {"type": "string"},
                                               "score": {"type": "number"}}},
}
PREDICTIONS: dict[str, Any] = {
    "oneOf": [_PREDICTIONS, {"type": "array", "items": _PREDICTIONS}],
    "description": "One list for one input, a list of lists for a list of inputs.",
}
SPARSE_VECTORS: dict[str, Any] = {
    "type": "array",
    "items": {"type": "array", "items": {
        "type": "object",
        "properties": {"index": {"type": "integer"}, "value": {"type": "number"}},
    }},
    "description": "The non-zero entries of each input's vector, indices ascending.",
}
TOKEN_VECTORS: dict[str, Any] = {
    "type": "array", "description": "Per input, one raw vector per token, special tokens "
    "included", "items": {"type": "array", "items": VECTOR},
}
TEXTS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
MAIN_ROUTE: dict[str, Any] = {
    "description": "The answer of the served kind's main route: /embed's, /rerank's, "
    "/predict's or /embed_sparse's.",
    "anyOf": [VECTORS, RANKS, PREDICTIONS, SPARSE_VECTORS],
}
HEALTH: dict[str, Any] = {"type": "object", "properties": {"status": {"const": "ok"}}}
INFO: dict[str, Any] = {
    "type": "object",
    "description": "TEI's /info fields (model_id, model_sha, model_dtype, served_model_name, "
    "model_type, max_concurrent_requests, max_input_length, max_batch_tokens, "
    "max_batch_requests, max_client_batch_size, auto_truncate, tokenization_workers, "
    "version, sha, docker_label) beside embedsvc's own.",
    "properties": {
        "model_id": {"type": ["string", "null"]},
        "model_sha": {"type": ["string", "null"]},
        "model_dtype": {"type": ["string", "null"]},
        "served_model_name": {"type": ["string", "null"]},
        "model_type": {"type": ["object", "null"],
                       "examples": [{"embedding": {"pooling": "mean"}}]},
        "kind": {"type": ["string", "null"],
                 "description": "embedding, reranker, classifier or sparse"},
        "labels": {"type": ["array", "null"], "items": {"type": "string"},
                   "description": "A cross-encoder's output labels, in output order."},
        "dimension": {"type": ["integer", "null"]},
        "modalities": {"type": ["array", "null"], "items": {"enum": ["text", "image"]},
                       "description": "What the model embeds: text, and image for an "
                       "image-text model."},
        "max_images_per_request": {"type": ["integer", "null"],
                                   "description": "MAX_IMAGES_PER_REQUEST (image-text models)."},
        "max_input_length": {"type": ["integer", "null"]},
        "device": {"type": ["string", "null"]},
        "dtype": {"type": ["string", "null"], "description": "what the model computes in: "
                  "float32, float16, bfloat16, or int8 (QUANTIZE=int8)"},
        "backend": {"enum": ["torch", "onnx", None],
                    "description": "PyTorch or ONNX Runtime (BACKEND, README: CPU backend)"},
        "parameters": {"type": ["integer", "null"], "description": "The model's weights."},
        "max_concurrent_requests": {"type": "integer"},
        "max_batch_tokens": {"type": "integer"},
        "max_batch_requests": {"type": "integer"},
        "max_batch_size": {"type": "integer", "description": "MAX_BATCH_SIZE"},
        "max_wait_ms": {"type": "number", "description": "MAX_WAIT_MS"},
        "max_queue": {"type": "integer", "description": "Inputs admitted at once (MAX_QUEUE)."},
        "max_client_batch_size": {"type": "integer"},
        "auto_truncate": {"type": "boolean"},
        "tokenization_workers": {"type": "integer"},
        "version": {"type": "string"},
        "sha": {"type": "null", "description": "TEI's build sha; none here."},
        "docker_label": {"type": "null", "description": "TEI's image label; none here."},
        "pid": {"type": "integer"},
        "engine_pid": {"type": ["integer", "null"],
                       "description": "The process that holds the model: this one, or the "
                       "engine process that several HTTP processes share (WORKERS)."},
        "front_pids": {"type": "array", "items": {"type": "integer"},
                       "description": "The HTTP processes in front of the model."},
        "state": {"type": "string"},
    },
}
ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "description": "What was wrong and how to fix it."},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_INTS: dict[str, Any] = {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}
_BY_TYPE: dict[str, Any] = {
    "type": "object",
    "description": "One list per type asked for, each one entry per text.",
    "properties": {"float": VECTORS, "int8": _INTS, "uint8": _INTS, "binary": _INTS,
                   "ubinary": _INTS, "base64": TEXTS},
}
_COHERE_META: dict[str, Any] = {"type": "object", "properties": {
    "api_version": OBJECT, "billed_units": {"type": "object", "properties": {
        "input_tokens": {"type": "integer"}}}}}
COHERE_EMBED_V2_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "embeddings": _BY_TYPE, "texts": TEXTS,
                   "meta": _COHERE_META, "response_type": {"const": "embeddings_by_type"}},
}
COHERE_EMBED_V1_RESPONSE: dict[str, Any] = {
    "type": "object",
    "description": "embeddings_floats (a list of vectors) unless embedding_types is given.",
    "properties": {"id": {"type": "string"}, "embeddings": {"oneOf": [VECTORS, _BY_TYPE]},
                   "texts": TEXTS, "meta": _COHERE_META,
                   "response_type": {"enum": ["embeddings_floats", "embeddings_by_type"]}},
}
OLLAMA_EMBED_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "embeddings": VECTORS,
        "total_duration": {"type": "integer", "description": "Nanoseconds."},
        "load_duration": {"type": "integer", "description": "Nanoseconds (0: loaded)."},
        "prompt_eval_count": {"type": "integer", "description": "Tokens computed."},
    },
}
OLLAMA_EMBEDDING_RESPONSE: dict[str, Any] = {
    "type": "object", "properties": {"embedding": VECTOR}}
OLLAMA_MODEL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "model": {"type": "string"},
        "modified_at": {"type": "string", "format": "date-time"},
        "size": {"type": "integer"}, "digest": {"type": "string"},
        "details": OBJECT,
    },
}
OLLAMA_TAGS: dict[str, Any] = {
    "type": "object", "properties": {"models": {"type": "array", "items": OLLAMA_MODEL}}}
OLLAMA_PS: dict[str, Any] = {
    "type": "object", "properties": {"models": {"type": "array", "items": {
        **OLLAMA_MODEL, "properties": {
            **OLLAMA_MODEL["properties"], "expires_at": {"type": "string"},
            "size_vram": {"type": "integer"}, "context_length": {"type": "integer"}}}}}}
OLLAMA_SHOW: dict[str, Any] = {
    "type": "object",
    "properties": {"details": OBJECT, "model_info": OBJECT, "capabilities": TEXTS,
                   "modified_at": {"type": "string"}, "modelfile": {"type": "string"},
                   "parameters": {"type": "string"}, "template": {"type": "string"},
                   "license": {"type": "string"}},
}
OLLAMA_VERSION: dict[str, Any] = {"type": "object", "properties": {"version": {"type": "string"}}}
OLLAMA_ERROR: dict[str, Any] = {
    "type": "object", "description": "Ollama's error shape", "required": ["error"],
    "properties": {"error": {"type": "string"}}}


def prepare_validation() -> None:
    """pydantic's one-off work before the first validator it builds, done now: its lookup of
    plugins, which reads every installed distribution's entry points (13 ms of CPU in a venv
    of 180 distributions), so that the first request does not pay for it."""
    TypeAdapter(int)
