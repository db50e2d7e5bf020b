"""The request bodies (validated by pydantic) and response shapes; the source of /openapi.json."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator


class Request(BaseModel):
    # strict: "1" is no integer and 1 is no string; unknown fields are ignored, as OpenAI does.
    model_config = ConfigDict(extra="ignore", strict=True)


class EmbeddingsRequest(Request):
    """POST /v1/embeddings, as the OpenAI API defines it."""

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="Text, texts, token ids of one text, or token ids of several texts. Token "
        "ids are ids of the OpenAI tokenizer of 'model' (cl100k_base for text-embedding-* and "
        "unknown names, o200k_base where tiktoken maps the name to it), decoded to text; with "
        "the server setting TOKEN_IDS=model, ids of the served model without special tokens."
    )
    model: StrictStr | None = Field(
        None, description="Any name; it picks the OpenAI tokenizer of token-id input. The "
        "response names the served model."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'base64': the little-endian float32 bytes of each vector."
    )
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components, then L2-normalise again."
    )
    user: StrictStr | None = Field(None, description="Accepted and ignored.")


_TEI_INPUTS = (
    "Text, texts, token ids of one text, or token ids of several texts. Token ids are the "
    "served model's own (see /tokenize); the model's special tokens are added unless the ids "
    "already carry them."
)
TeiInputs = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class EmbedAllRequest(Request):
    """POST /embed_all, as text-embeddings-inference defines it: per-token vectors."""

    inputs: TeiInputs = Field(description=_TEI_INPUTS)
    truncate: StrictBool | None = Field(
        None, description="Truncate over-long inputs; null: the server's AUTO_TRUNCATE."
    )
    truncation_direction: Literal["right", "left"] = Field(
        "right", description="Which end of an over-long input is cut."
    )
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each input (texts only)."
    )

    @field_validator("truncation_direction", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        # TEI spells the directions "Right" and "Left".
        return value.lower() if isinstance(value, str) else value


class EmbedRequest(EmbedAllRequest):
    """POST /embed, as text-embeddings-inference defines it."""

    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components (then normalise, if asked)."
    )


class DecodeRequest(Request):
    """POST /decode, as text-embeddings-inference defines it: token ids back to text."""

    ids: list[StrictInt] | list[list[StrictInt]] = Field(
        description="Token ids of the served model: one list, or a list of lists."
    )
    skip_special_tokens: StrictBool = Field(True, description="Leave out [CLS], [SEP] etc.")


class TokenizeRequest(Request):
    """POST /tokenize, as text-embeddings-inference defines it."""

    inputs: StrictStr | list[StrictStr] = Field(description="Text or texts.")


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
TOKEN_VECTORS: dict[str, Any] = {
    "type": "array", "description": "Per input, one raw vector per token, special tokens "
    "included", "items": {"type": "array", "items": VECTOR},
}
TEXTS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
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
        "kind": {"type": ["string", "null"]},
        "dimension": {"type": ["integer", "null"]},
        "max_input_length": {"type": ["integer", "null"]},
        "max_concurrent_requests": {"type": "integer"},
        "max_batch_tokens": {"type": "integer"},
        "max_batch_requests": {"type": "integer"},
        "max_client_batch_size": {"type": "integer"},
        "auto_truncate": {"type": "boolean"},
        "tokenization_workers": {"type": "integer"},
        "version": {"type": "string"},
        "pid": {"type": "integer"},
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
