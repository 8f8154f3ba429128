"""``POST /v1/embeddings``: the request and response models (OpenAI's shape).

``input`` takes OpenAI's four forms: a string, a list of strings, a list of token ids, or a list
of lists of token ids; it is normalized to a list of inputs (:attr:`EmbeddingRequest.inputs`),
each a string or a list of token ids, at most :data:`MAX_INPUTS`. An empty string, an empty list
or a non-integer token is refused here (400 naming the item); whether the ids lie inside the
vocabulary and the inputs fit the model is the handler's check (``gateway/openai/embeddings.py``).
``encoding_format`` "float" returns lists of numbers, "base64" the little-endian float32 bytes in
base64 (what the official ``openai`` client asks for and decodes). ``dimensions`` (>= 1) asks for
a Matryoshka truncation, re-normalized; the handler refuses it for a model that is not Matryoshka.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, WithJsonSchema, field_validator

from serving.gateway.schema.protocol import _Request, valid_unicode

MAX_INPUTS = 2048
"""The most inputs one request may carry (OpenAI's limit)."""

__all__ = ["EmbeddingData", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage", "MAX_INPUTS"]


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``."""

    unsupported_fields = {}
    model: str
    input: Annotated[list[str | list[int]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": {"anyOf": [
            {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]}},
    ]})]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=1 << 20)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("'input' must not be an empty string.")
            return [valid_unicode(v)]
        if not isinstance(v, list) or not v:
            raise ValueError("'input' must be a non-empty string, a list of strings, a list of token ids, "
                             "or a list of lists of token ids.")
        if _is_ids(v):
            return [v]
        if len(v) > MAX_INPUTS:
            raise ValueError(f"'input' may hold at most {MAX_INPUTS} inputs (got {len(v)}).")
        for i, item in enumerate(v):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"'input' item {i} is an empty string.")
                valid_unicode(item)
            elif not _is_ids(item) or not item:
                raise ValueError(f"'input' item {i} must be a non-empty string or a non-empty list of token ids.")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        return list(self.input)


class EmbeddingData(BaseModel):
    """One input's vector: floats, or base64 of its little-endian float32 bytes."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Input tokens (an embedding has no completion)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The response: one :class:`EmbeddingData` per input, in input order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
