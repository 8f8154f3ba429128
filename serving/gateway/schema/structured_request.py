"""A request's structured-output fields, parsed into one ``StructuredOutput``.

Accepted on both ``/v1/completions`` and ``/v1/chat/completions``:

* OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}``. With
  ``strict`` true, a schema keyword that llguidance cannot enforce is a 400;
  otherwise such keywords are ignored (the rest is still enforced; the schema
  gets ``"x-guidance": {"lenient": true}`` unless it sets that itself). A
  ``json_schema`` without ``schema`` means any JSON object.
* vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, object or
  JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or
  GBNF) or ``json_object: true``; its other options are refused.
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and
  ``guided_grammar``, aliases of the above.

More than one constraint in a request is a 400 naming the second field. The
constraint is compiled against the model's tokenizer before the request is
submitted (:func:`check_structured_output`, in a worker thread), so an
invalid schema, regex or grammar is a 400 naming its field, never an engine error.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serving.contract.engine_client import StructuredOutput
from serving.contract.tokenizer_protocol import TextTokenizer
from serving.core.structured_output import StructuredOutputError, validate
from serving.gateway.http.errors import OpenAIError


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when 'type' is 'json_schema'.")
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs`` (the options that change nothing else are refused)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(value: Any, field: str, lenient: bool = False) -> str:
    """A schema (object, bool or JSON text) as JSON text; `lenient` marks it for llguidance."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise PydanticCustomError("invalid_schema", f"Invalid '{field}': not valid JSON ({e}).",
                                      {"field": field}) from None
    if not isinstance(value, (dict, bool)):
        raise PydanticCustomError("invalid_schema", f"Invalid '{field}': a JSON schema must be an "
                                  f"object or a boolean.", {"field": field})
    if lenient and isinstance(value, dict):
        guidance = value.get("x-guidance")
        if not isinstance(guidance, dict) or "lenient" not in guidance:
            value = {**value, "x-guidance": {**(guidance if isinstance(guidance, dict) else {}),
                                             "lenient": True}}
    return json.dumps(value)


def _choice(value: list[str], field: str) -> StructuredOutput:
    if not value:
        raise PydanticCustomError("invalid_choice", f"Invalid '{field}': it must list at least one "
                                  f"string.", {"field": field})
    return StructuredOutput("choice", json.dumps(value))


def _unicode(v: Any, field: str) -> Any:
    """`v` unchanged; a string (or list of strings) holding a lone UTF-16 surrogate is refused."""
    for text in (v if isinstance(v, list) else [v]):
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise PydanticCustomError("invalid_unicode", f"Invalid '{field}': the text holds a lone "
                                          f"UTF-16 surrogate, which is not valid Unicode.",
                                          {"field": field}) from None
    return v


class StructuredOutputFields(BaseModel):
    """The structured-output fields of a sampling request (a mixin of the request models).

    After validation, :attr:`structured_output` is the constraint (None: free
    text) and :attr:`structured_output_field` the field it came from.
    """

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structured: tuple[str, StructuredOutput] | None = PrivateAttr(None)

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _choice_list(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, list) or not all(isinstance(c, str) for c in v)):
            raise ValueError("'guided_choice' must be a list of strings.")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputFields":
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif rf is not None and rf.type == "json_schema":
            js = rf.json_schema
            field = "response_format.json_schema.schema"
            found.append((field, StructuredOutput("json_object") if js.schema_ is None else
                          StructuredOutput("json_schema", _schema_text(js.schema_, field, not js.strict))))
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar)) if v is not None]
            if so.json_object:
                given.append(("json_object", True))
            for key, v in given:
                field = f"structured_outputs.{key}"
                found.append((field, self._constraint(key, v, field)))
        for key in ("json", "regex", "choice", "grammar"):
            v = getattr(self, f"guided_{key}")
            if v is not None:
                found.append((f"guided_{key}", self._constraint(key, v, f"guided_{key}")))
        if len(found) > 1:
            raise PydanticCustomError(
                "multiple_constraints",
                f"Only one structured output constraint per request: got '{found[0][0]}' and "
                f"'{found[1][0]}'.", {"field": found[1][0]})
        self._structured = found[0] if found else None
        return self

    @staticmethod
    def _constraint(key: str, value: Any, field: str) -> StructuredOutput:
        _unicode(value, field)
        if key == "json":
            return StructuredOutput("json_schema", _schema_text(value, field))
        if key == "json_object":
            return StructuredOutput("json_object")
        if key == "choice":
            return _choice(value, field)
        return StructuredOutput(key, value)  # regex, grammar

    @property
    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint, or None."""
        return None if self._structured is None else self._structured[1]

    @property
    def structured_output_field(self) -> str | None:
        """The request field the constraint came from (for error messages)."""
        return None if self._structured is None else self._structured[0]


def check_structured_output(so: StructuredOutput, field: str, tok: TextTokenizer) -> None:
    """Compiles `so` against the model's tokenizer (blocking: run it in a worker thread;
    the first call per tokenizer also builds llguidance's view of it, about 2 s for
    Gemma). The compiled grammar is cached for the engine of the same process.

    Raises:
      OpenAIError: 400 naming `field` when the schema, regex or grammar does not compile.
    """
    try:
        validate(so, tok)
    except StructuredOutputError as e:
        raise OpenAIError(f"Invalid '{field}': {e}", param=field) from None
