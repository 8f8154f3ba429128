"""Pydantic models of the OpenAI-compatible API's requests (responses: ``response_models.py``).

Requests follow OpenAI's ranges (temperature in [0, 2], top_p in (0, 1],
penalties in [-2, 2], ``logit_bias`` values in [-100, 100], ``logprobs`` and
``top_logprobs`` in [0, 20], ...); integers are bounded (``max_tokens`` and
``top_k`` to int32, ``seed`` to int64 as vLLM checks it; the engine takes it
modulo 2**32). ``null`` means absent for every field (OpenAI's rule). Strings
must be valid Unicode: one holding a lone UTF-16 surrogate (JSON
``"\\ud800"``) is refused. Unknown fields (``user``, ``metadata``, ...) are
ignored; fields that would change the output but are not implemented here
(``suffix``, tools, non-text response formats, and the vLLM/OpenAI extensions
listed in ``unsupported_fields.py``) fail validation with a message naming the
field, so a client never silently gets something other than what it asked for.
Checks that need the model (token ids inside the vocabulary, the context
window) are the serving layer's (``sampling_params.py``, ``openai_serving.py``).
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
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from serving.contract.engine_client import MAX_LOGIT_BIAS, MAX_LOGPROBS
from serving.gateway.schema.structured_request import StructuredOutputFields
from serving.gateway.schema.unsupported_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    STREAM_OPTION_FIELDS,
    Unsupported,
    first_unsupported,
)
from serving.gateway.tools.tool_protocol import MAX_TOOLS, NamedToolChoice, ToolCallIn, ToolChoice, ToolDefinition

MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1
"""Upper bound of ``max_tokens``, ``max_completion_tokens``, ``min_tokens`` and ``top_k``."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Bounds of ``seed`` (vLLM's)."""
MAX_N = 128
"""The most choices (``n``, ``best_of``) per prompt."""
MAX_PROMPTS = 1024
"""The most prompts one ``/v1/completions`` request may carry."""
MAX_ENGINE_REQUESTS = 1024
"""The most completions one request may ask for: prompts times ``max(n, best_of)``."""
MAX_STOP_TOKEN_IDS = 1024
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
    # 0 only on /v1/completions with echo (the prompt scored, nothing generated).
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    # Newer name of max_tokens; takes precedence over it.
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # vLLM extension; 0 or -1 disable, and so does a value >= the vocabulary size.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    # vLLM extension: drop tokens below min_p times the most likely one's probability.
    min_p: float | None = Field(None, ge=0, le=1)
    # Choices per prompt; choice j is seeded seed + j.
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Annotated[list[Text] | None, WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"}]})] = None
    # vLLM extension: token ids that end generation, besides the model's EOS.
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # vLLM extension (CTRL's penalty): > 1 discourages tokens of the prompt and the output.
    repetition_penalty: float | None = Field(None, gt=0)
    # {token id as a decimal string: bias added to its logit}.
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema({
        "type": "object", "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})] = None
    # vLLM extension: stop tokens (EOS too) cannot end the output before this many tokens.
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    # vLLM extension: logprob tokens spelled "token_id:ID" rather than as text.
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False  # vLLM extension
    # xlaserve extension: speculative decoding's drafts per step for this request (0: none,
    # e.g. for seeded sampling exactly as without speculation); null: the server's K.
    num_speculative_tokens: int | None = Field(None, ge=0, le=15)
    # xlaserve extension: "batch" work is admitted only when no interactive
    # request waits, and is preempted first.
    priority: Literal["interactive", "batch"] = "interactive"
    # OpenAI's: "auto" (= "default"), "default", "flex" (cheaper, shed under load),
    # "priority" (runs ahead); see serving/gateway/services/service_tiers.py.
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    # vLLM extension: requests share prefix-cache pages only with the same salt,
    # within the caller's tenant (or tenant group; see cache_scope.py).
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)

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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens (got {len(v)}).")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"'logit_bias' keys are token ids as decimal strings; got {key!r}.")
            if not -100 <= bias <= 100:
                raise ValueError(f"'logit_bias' values must be in [-100, 100]; token {key} has {bias}.")
        return v

    @model_validator(mode="after")
    def _token_counts(self) -> "_SamplingRequest":
        max_tokens = self.requested_max_tokens
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens == 0 and not self._allows_zero_max_tokens():
            raise PydanticCustomError(
                "max_tokens_zero",
                f"'{name}' must be at least 1" + (
                    " (0 is allowed only with 'echo': the prompt alone, scored)."
                    if isinstance(self, CompletionRequest) else "."), {"field": name})
        if self.min_tokens and max_tokens is not None and self.min_tokens > max_tokens:
            raise PydanticCustomError(
                "min_tokens_above_max_tokens",
                f"'min_tokens' ({self.min_tokens}) must not exceed '{name}' ({max_tokens}).",
                {"field": "min_tokens"})
        return self

    def _allows_zero_max_tokens(self) -> bool:
        return False

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

    ``prompt`` is a string, a list of token ids, or a list of several of
    either (OpenAI's forms); it is normalized to a list of prompts
    (:attr:`prompts`), each a string or a list of token ids. Choices come
    prompt-major: prompt i's choice j has index ``i * n + j``.
    ``max_completion_tokens`` or ``max_tokens`` default (in the serving layer)
    to 16, as in OpenAI's API; 0 is allowed with ``echo`` (the prompt scored,
    nothing generated). ``best_of`` (>= ``n``, not with ``stream``) generates
    that many completions per prompt and returns the ``n`` with the highest
    cumulative log probability.
    """

    unsupported_fields = COMPLETION_FIELDS
    prompt: Annotated[list[str | list[int]], WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"anyOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]}},
    ]})]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [valid_unicode(v)]
        if isinstance(v, list):
            if not v:
                raise ValueError("'prompt' must not be an empty list.")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return [v]
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"'prompt' may hold at most {MAX_PROMPTS} prompts (got {len(v)}).")
            for i, p in enumerate(v):
                if isinstance(p, str):
                    valid_unicode(p)
                    continue
                if (not isinstance(p, list) or not p
                        or not all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
                    raise ValueError(f"'prompt' item {i} must be a string or a non-empty list of "
                                     f"token ids.")
            return v
        raise ValueError("'prompt' must be a string, a list of token ids, or a list of either.")

    @model_validator(mode="after")
    def _choices(self) -> "CompletionRequest":
        best_of = self.n if self.best_of is None else self.best_of
        if best_of < self.n:
            raise PydanticCustomError(
                "best_of_below_n", f"'best_of' ({best_of}) must be at least 'n' ({self.n}).",
                {"field": "best_of"})
        if best_of > self.n and self.stream:
            raise PydanticCustomError(
                "best_of_with_stream", "'best_of' above 'n' cannot be used with 'stream' (as in OpenAI's API).",
                {"field": "best_of"})
        total = len(self.prompt) * max(best_of, self.n)
        if total > MAX_ENGINE_REQUESTS:
            raise PydanticCustomError(
                "too_many_choices",
                f"{len(self.prompt)} prompt(s) times {max(best_of, self.n)} choices is {total} "
                f"completions; at most {MAX_ENGINE_REQUESTS} per request.",
                {"field": "best_of" if best_of > self.n else "n"})
        return self

    def _allows_zero_max_tokens(self) -> bool:
        return self.echo

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (at least one)."""
        return list(self.prompt)

    @property
    def choices_per_prompt(self) -> int:
        """Completions generated per prompt: ``best_of`` when given, else ``n``."""
        return max(self.best_of or 1, self.n)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("'suffix' is not supported by this server.")
        return v


_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
               "tool": "tool"}


class ChatMessage(_Request):
    """One chat message: text content, or a list of text parts (joined with "\\n") and
    ``image_url`` parts (``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``;
    kept in :attr:`image_urls`, in order; the served model decides whether it takes images).

    An assistant message may carry the ``tool_calls`` it made (and its
    ``reasoning_content``); a ``tool`` message carries a call's result, with
    the ``tool_call_id`` it answers (and optionally the function's ``name``).
    """

    role: Annotated[str, WithJsonSchema({"type": "string", "enum": [*_CHAT_ROLES]})]
    content: Annotated[Text | None, WithJsonSchema({"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [
            {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
            {"type": "object", "required": ["type", "image_url"],
             "properties": {"type": {"const": "image_url"}, "image_url": {
                 "type": "object", "required": ["url"],
                 "properties": {"url": {"type": "string"}, "detail": {"type": "string"}}}}}]}},
        {"type": "null"}]})] = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Text | None = Field(None, max_length=256)
    name: Text | None = Field(None, max_length=256)
    reasoning_content: Text | None = None
    _image_parts: list[tuple[int, str]] = PrivateAttr(default_factory=list)
    _part_order: list[str | None] = PrivateAttr(default_factory=list)

    @property
    def image_urls(self) -> list[tuple[int, str]]:
        """(content part index, URL) of each ``image_url`` part, in order."""
        return self._image_parts

    @model_validator(mode="wrap")
    @classmethod
    def _image_parts_apart(cls, data: Any, handler) -> "ChatMessage":
        """Takes the ``image_url`` parts out of a content list before the text parts are
        validated and joined; keeps their URLs and the order of text and image parts."""
        images: list[tuple[int, str]] = []
        order: list[str | None] = []
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            texts = []
            for i, part in enumerate(data["content"]):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    ref = part.get("image_url")
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    if not isinstance(url, str):
                        raise PydanticCustomError(
                            "image_url_missing", "Content part {index} of type 'image_url' needs "
                            "'image_url': {{'url': ...}}.", {"index": i})
                    images.append((i, url))
                    order.append(None)
                else:
                    texts.append(part)
                    order.append(part.get("text") if isinstance(part, dict) else None)
            if images:
                if data.get("role") not in ("user", None):
                    raise PydanticCustomError("image_not_user", "Only user messages may hold images.", {})
                data = {**data, "content": texts}
        m = handler(data)
        m._image_parts = images
        m._part_order = order
        return m

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v == "function":
            raise ValueError("Role 'function' (the legacy function-calling API) is not supported; "
                             "send 'tool' messages.")
        if v not in _CHAT_ROLES:
            raise ValueError(f"Unknown role {v!r}; expected one of system, developer, user, assistant, tool.")
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
                        f"Only text and image_url content parts are supported (a part has type {kind!r})."
                    )
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("'content' must be a string or a list of text parts.")

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_not_assistant",
                                      "Only assistant messages may carry 'tool_calls'.", {"field": "tool_calls"})
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("tool_call_id_missing",
                                      "A 'tool' message needs the 'tool_call_id' it answers.",
                                      {"field": "tool_call_id"})
        return self

    def to_template(self, index: int = 0) -> dict:
        """The dict the chat template takes: ``{"role", "content"}``, plus ``tool_calls``
        (arguments as objects, as templates expect), ``tool_call_id``, ``name`` and
        ``reasoning_content`` when set.

        Raises:
          ValueError: a tool call whose arguments are not a JSON object.
        """
        d: dict[str, Any] = {"role": _CHAT_ROLES[self.role], "content": self.content or ""}
        if self._image_parts:  # the parts in order, images as the templates' {"type": "image"}
            d["content"] = [{"type": "image"} if t is None else {"type": "text", "text": t}
                            for t in self._part_order]
        if self.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": c.function.arguments_object(f"messages[{index}].tool_calls[{k}]")}}
                for k, c in enumerate(self.tool_calls)]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (newer name) takes precedence over ``max_tokens``;
    when neither is given the serving layer uses what the messages leave of the
    context window and of the KV cache. ``logprobs: true`` returns each generated
    token's log probability, with its ``top_logprobs`` most likely alternatives.
    """

    unsupported_fields = CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "top_logprobs_without_logprobs", "'top_logprobs' needs 'logprobs': true.",
                {"field": "top_logprobs"})
        return self

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any, info) -> Any:
        if v is not None and v != "none" and v != []:
            raise ValueError(f"'{info.field_name}' (the legacy function-calling API) is not supported; "
                             f"send 'tools' and 'tool_choice'.")
        return v

    @model_validator(mode="after")
    def _tool_choice_matches_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError(
                "duplicate_tool", "'tools' holds two functions with the same name.", {"field": "tools"})
        if choice is None or choice == "none":
            return self
        if not names and choice != "auto":
            raise PydanticCustomError(
                "tool_choice_without_tools", "'tool_choice' needs 'tools' to choose from.",
                {"field": "tool_choice"})
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise PydanticCustomError(
                "unknown_tool", f"'tool_choice' names {choice.name!r}, which is not among 'tools'.",
                {"field": "tool_choice"})
        if choice != "auto" and self.structured_output is not None:
            raise PydanticCustomError(
                "tool_choice_with_structured_output",
                "A forced 'tool_choice' constrains the output itself; it cannot be combined with "
                f"'{self.structured_output_field}'.", {"field": "tool_choice"})
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """"none" without tools; else the request's, "auto" by default."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"
