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


class EmbedRequest(Request):
    """POST /embed, as text-embeddings-inference defines it."""

    inputs: StrictStr | list[StrictStr] = Field(description="Text or texts.")
    normalize: StrictBool = Field(True, description="L2-normalise each vector.")
    truncate: StrictBool | None = Field(
        None, description="Truncate over-long inputs; null: the server's AUTO_TRUNCATE."
    )
    truncation_direction: Literal["right", "left"] = Field(
        "right", description="Which end of an over-long input is cut."
    )
    prompt_name: StrictStr | None = Field(
        None, description="Name of a prompt of the model, put before each input."
    )
    dimensions: StrictInt | None = Field(
        None, description="Keep the first N components (then normalise, if asked)."
    )

    @field_validator("truncation_direction", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        # TEI spells the directions "Right" and "Left".
        return value.lower() if isinstance(value, str) else value


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
