"""The rerank and score routes' request and response models.

``POST /v1/rerank`` (Jina / Cohere form): ``query``, ``documents`` (strings, or objects with a
``text``), ``top_n`` (the best n; absent or 0: all), ``return_documents`` (add each result's
``document: {"text": ...}``; default false) -> ``results`` sorted by ``relevance_score``
descending, each with the document's ``index``; ``usage`` counts every framed pair's tokens.

``POST /v1/score`` (vLLM's form): ``text_1`` (a string, or a list of one string or of as many
strings as ``text_2``) against ``text_2`` (a string or a list) -> ``data``: one
``{"index", "object": "score", "score"}`` per pair, in ``text_2``'s order.

Empty texts, more than :data:`MAX_DOCUMENTS` documents and mismatched lists are refused here
(400 naming the field); the handler checks lengths against the model.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from serving.gateway.schema.protocol import _Request, valid_unicode

MAX_DOCUMENTS = 1024
"""The most documents (or ``text_2`` items) one request may carry."""

__all__ = ["MAX_DOCUMENTS", "RerankDocument", "RerankRequest", "RerankResponse", "RerankResult", "RerankUsage",
           "ScoreData", "ScoreRequest", "ScoreResponse"]

Text = Annotated[str, StringConstraints(min_length=1)]


class RerankDocument(BaseModel):
    """A document given as an object (Jina / Cohere): its ``text``."""

    model_config = ConfigDict(extra="ignore")
    text: Text


def _text(v: Any) -> Any:
    if isinstance(v, str):
        valid_unicode(v)
    return v


class RerankRequest(_Request):
    """``POST /v1/rerank``."""

    model: str
    query: Text
    documents: list[Text | RerankDocument] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = False
    user: str | None = None

    @field_validator("query")
    @classmethod
    def _query(cls, v: str) -> str:
        return _text(v)

    @field_validator("documents")
    @classmethod
    def _documents(cls, v: list) -> list:
        for d in v:
            _text(d if isinstance(d, str) else d.text)
        return v

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Request):
    """``POST /v1/score``."""

    model: str
    text_1: Text | list[Text] = Field(json_schema_extra={"minItems": 1, "maxItems": MAX_DOCUMENTS})
    text_2: Text | list[Text] = Field(json_schema_extra={"minItems": 1, "maxItems": MAX_DOCUMENTS})
    user: str | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, v: Any, info) -> Any:
        items = [v] if isinstance(v, str) else v
        if not items:
            raise ValueError(f"'{info.field_name}' must not be an empty list.")
        if len(items) > MAX_DOCUMENTS:
            raise ValueError(f"'{info.field_name}' may hold at most {MAX_DOCUMENTS} texts (got {len(items)}).")
        for t in items:
            _text(t)
        return v

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) per pair.

        Raises:
          ValueError: ``text_1`` a list of neither one text nor as many as ``text_2``.
        """
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"'text_1' holds {len(first)} texts and 'text_2' {len(second)}: give one text_1, "
                             f"or as many as text_2.")
        return list(zip(first, second))


class RerankUsage(BaseModel):
    """Tokens of every framed pair (no completion)."""

    prompt_tokens: int
    total_tokens: int


class RerankResult(BaseModel):
    """One document's score; ``document`` only with ``return_documents``."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    """``POST /v1/rerank``'s body."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreData(BaseModel):
    """One pair's score."""

    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    """``POST /v1/score``'s body."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: RerankUsage
