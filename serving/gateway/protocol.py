"""Pydantic models for the OpenAI-compatible API (requests, responses, errors).

Requests follow OpenAI's ranges (temperature in [0, 2], top_p in (0, 1], ...);
integers are bounded (``max_tokens`` and ``top_k`` to int32, ``seed`` to
[-2**63, 2**64), which the engine takes modulo 2**32). ``null`` means absent
for every field (OpenAI's rule). Strings must be valid Unicode: one holding a
lone UTF-16 surrogate (JSON ``"\\ud800"``) is refused. Unknown fields (``user``,
``metadata``, ...) are ignored; fields that would change the output but are not
implemented here (logprobs, echo, best_of > 1, tools, penalties, n > 1,
and the vLLM/OpenAI extensions listed in
``unsupported_fields.py``) fail validation with a message naming the field, so
a client never silently gets something other than what it asked for.
Validation errors become HTTP 400 (see ``errors.py``): an error that names its
field in ``ctx["field"]`` has that field appended to its location.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serving.gateway.structured_request import StructuredOutputFields
from serving.gateway.unsupported_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    STREAM_OPTION_FIELDS,
    Unsupported,
    first_unsupported,
)

MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1
"""Upper bound of ``max_tokens``, ``max_completion_tokens`` and ``top_k``."""
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(s: str) -> str:
    """`s` unchanged.

    Raises:
      ValueError: `s` holds a lone UTF-16 surrogate (JSON allows ``"\\ud800"``,
        but no tokenizer or UTF-8 encoder can take it).
    """
    if not s.isascii() and (m := _SURROGATE.search(s)):
        raise ValueError(
            f"the text holds a lone UTF-16 surrogate (U+{ord(m.group()):04X} at character "
            f"{m.start()}), which is not valid Unicode.")
    return s


Text = Annotated[str, AfterValidator(valid_unicode)]
"""A request string: valid Unicode (no lone surrogates)."""

_SCHEMA_META = ("title", "description", "default", "examples", "deprecated")


def _nullable_optionals(schema: dict[str, Any], cls: type) -> None:
    """JSON schema hook: optional properties also accept ``null`` (null means absent)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _allows_null(prop):
            continue
        meta = {k: prop.pop(k) for k in _SCHEMA_META if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


def _allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(_allows_null(p) for p in prop.get("anyOf", ()))


class _Request(BaseModel):
    """A request object: unknown fields ignored, ``null`` treated as absent, and
    the fields of ``unsupported_fields`` refused unless neutral."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_nullable_optionals)
    unsupported_fields: ClassVar[Mapping[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_absent_and_unsupported_refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        name = first_unsupported(data, cls.unsupported_fields)
        if name is not None:
            raise PydanticCustomError("unsupported_parameter", cls.unsupported_fields[name].refusal(name),
                                      {"field": name})
        return data


# --------------------------------------------------------------- requests


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final usage-only chunk."""

    unsupported_fields = STREAM_OPTION_FIELDS
    include_usage: bool = False


class _SamplingRequest(_Request, StructuredOutputFields):
    """Fields shared by completions and chat completions (the structured-output
    ones in ``structured_request.py``)."""

    model: Text
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    # Newer name of max_tokens; takes precedence over it.
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # vLLM extension; 0 or -1 disable, and so does a value >= the vocabulary size.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    n: int | None = 1
    stop: Annotated[list[Text] | None, WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"}]})] = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extension
    # xlaserve extension: "batch" work is admitted only when no interactive
    # request waits, and is preempted first.
    priority: Literal["interactive", "batch"] = "interactive"
    # vLLM extension: requests share prefix-cache pages only with the same salt,
    # within the caller's tenant (or tenant group; see cache_scope.py).
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)

    @field_validator("n")
    @classmethod
    def _only_n_1(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"Only n=1 is supported (got n={v}); send separate requests.")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("'stop' must be a string or a list of strings.")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' accepts at most {MAX_STOP_STRINGS} strings (got {len(v)}).")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info) -> float | None:
        if v:
            raise ValueError(f"'{info.field_name}' is not supported by this server; omit it or use 0.")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("'logit_bias' is not supported by this server.")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options_without_stream",
                "'stream_options' is only allowed when 'stream' is true.", {"field": "stream_options"})
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens``, None when neither is set."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list ([] when none)."""
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is normalized to either a string or a list of token ids; a
    one-element list of either is unwrapped, several prompts are rejected.
    ``max_completion_tokens`` or ``max_tokens`` default (in the serving layer)
    to 16, as in OpenAI's API.
    """

    unsupported_fields = COMPLETION_FIELDS
    prompt: Annotated[str | list[int], WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]}},
    ]})]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, str):
            return valid_unicode(v)
        if isinstance(v, list):
            if not v:
                raise ValueError("'prompt' must not be an empty list.")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return v
            if all(isinstance(p, (str, list)) for p in v):
                if len(v) > 1:
                    raise ValueError(
                        f"Only a single prompt per request is supported (got {len(v)} prompts)."
                    )
                return cls._one_prompt(v[0])
        raise ValueError("'prompt' must be a string or a list of token ids.")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("'logprobs' is not supported by this server.")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("'echo' is not supported by this server.")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"'best_of' > 1 is not supported by this server (got {v}).")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("'suffix' is not supported by this server.")
        return v


_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ChatMessage(_Request):
    """One chat message; text content only (a list of text parts is joined with "\\n")."""

    role: Annotated[str, WithJsonSchema({"type": "string", "enum": [*_CHAT_ROLES]})]
    content: Annotated[Text | None, WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
        {"type": "null"}]})] = None
    tool_calls: list[Any] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v in ("tool", "function"):
            raise ValueError(f"Role '{v}' is not supported (tools are not supported by this server).")
        if v not in _CHAT_ROLES:
            raise ValueError(f"Unknown role {v!r}; expected one of system, developer, user, assistant.")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        f"Only text content parts are supported (part {i} has type {kind!r})."
                    )
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("'content' must be a string or a list of text parts.")

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("'tool_calls' is not supported by this server.")
        return v

    def to_template(self) -> dict:
        """The ``{"role", "content"}`` dict the tokenizer's chat template takes."""
        return {"role": _CHAT_ROLES[self.role], "content": self.content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (newer name) takes precedence over ``max_tokens``;
    when neither is given the serving layer uses what the messages leave of the
    context window and of the KV cache.
    """

    unsupported_fields = CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("'logprobs' is not supported by this server.")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("'top_logprobs' is not supported by this server.")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list | None, info) -> list | None:
        if v:
            raise ValueError(f"'{info.field_name}' is not supported by this server.")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v: Any, info) -> Any:
        if v is not None and v != "none":
            raise ValueError(f"'{info.field_name}' is not supported by this server.")
        return v


# -------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts: ``total_tokens = prompt_tokens + completion_tokens``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        """Usage from token counts (total computed)."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionChoice(BaseModel):
    """One ``/v1/completions`` choice (``text`` is the delta in streaming chunks)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Non-streaming ``/v1/completions`` body; streaming chunks share this shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    """The assistant message of a non-streaming chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One non-streaming chat choice."""

    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """Non-streaming ``/v1/chat/completions`` body."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    """A streaming delta; unset (None) fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streaming chat chunk."""

    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """A ``chat.completion.chunk`` SSE payload (``choices == []`` on the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models`` (``max_model_len`` in tokens, as vLLM reports it)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xlaserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models`` body."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(BaseModel):
    """``GET /health`` body: ``{"status": "ok"}`` (200) or, with 503, the models not ready."""

    status: Literal["ok", "unavailable"]
    not_ready: list[str] | None = None


class ErrorDetail(BaseModel):
    """The ``error`` object of an error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
