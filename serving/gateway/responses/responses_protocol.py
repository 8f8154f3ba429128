"""Request model of OpenAI's Responses API (``POST /v1/responses``) and its
translation into a chat completion.

A Responses request is a chat completion in other words: ``instructions`` is
the system message, ``input`` a string (one user message) or a list of items,
``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` is
``response_format``, and ``tools`` are function tools written flat
(``{"type": "function", "name", "description", "parameters", "strict"}``).
Input items:

* messages: ``{"role": "user" | "system" | "developer" | "assistant",
  "content": str | [parts]}`` (``"type": "message"`` optional); text parts
  only (``input_text``, ``output_text``, ``text``, ``refusal``),
* ``{"type": "function_call", "call_id", "name", "arguments"}``: the model's
  earlier call (consecutive calls become one assistant message's
  ``tool_calls``),
* ``{"type": "function_call_output", "call_id", "output"}``: the tool's result
  (a ``tool`` message),
* ``{"type": "reasoning", ...}``: earlier thinking, accepted and not sent to
  the model (chat templates drop it too).

Images, files, built-in tools (web search, file search, computer use, MCP),
``background``, ``conversation``, prompt templates and logprobs are refused
with a 400 naming the field (``unsupported_fields.RESPONSES_FIELDS``), so a
client never silently gets less than it asked for. ``reasoning`` (effort,
summary) is accepted and ignored: a model thinks as its template makes it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serving.gateway.http.errors import OpenAIError
from serving.gateway.schema.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    Text,
    _nullable_optionals,
    _Request,
)
from serving.gateway.schema.unsupported_fields import RESPONSES_FIELDS
from serving.gateway.tools.tool_protocol import MAX_TOOLS

MAX_INPUT_ITEMS = 4096
"""The most input items one request may carry."""
MAX_METADATA_KEYS = 16
"""OpenAI's limit on ``metadata`` (keys at most 64 characters, values 512)."""

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": [*_TEXT_PARTS, "input_image"]}, "text": {"type": "string"},
        "refusal": {"type": "string"}, "image_url": {"type": "string"}, "detail": {"type": "string"}}}}]}
"""The schema of ``content`` and ``output``: a string or a list of text parts (and, in a user
message's content, ``input_image`` parts: ``image_url`` a data URL or an allowed URL)."""


def _parts_text(v: Any) -> Any:
    """A list of text parts as one string (parts joined by newlines, as chat does)."""
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("must be a string or a list of text parts.")
    texts = []
    for i, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = "refusal" if kind == "refusal" else "text"
        if kind not in _TEXT_PARTS or not isinstance(part.get(key), str):
            raise ValueError(f"only text content parts ({', '.join(_TEXT_PARTS)}, with their "
                             f"'{key}') are supported; part {i} has type {kind!r}.")
        texts.append(part[key])
    return "\n".join(texts)


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ()}


class InputItem(BaseModel):
    """One input item: a message (``type`` "message" or absent), a
    ``function_call``, a ``function_call_output`` or a ``reasoning`` item; each
    type needs its own fields (``_ITEM_FIELDS``)."""

    model_config = ConfigDict(extra="ignore")
    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Annotated[Text | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    call_id: Text | None = Field(None, min_length=1, max_length=256)
    name: Text | None = Field(None, min_length=1, max_length=64)
    arguments: Text | None = None
    output: Annotated[Text | None, WithJsonSchema(_CONTENT_SCHEMA)] = None

    _text_parts = field_validator("content", "output", mode="before")(lambda v: _parts_text(v))
    _images: list[tuple[int, str]] = PrivateAttr(default_factory=list)
    _part_order: list[str | None] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _image_parts_apart(cls, data: Any, handler) -> "InputItem":
        """Takes a message's ``input_image`` parts (``{"type": "input_image", "image_url":
        "data:image/...;base64,..."}``) out of its content before the text parts are joined;
        keeps their URLs and the order of text and image parts."""
        images: list[tuple[int, str]] = []
        order: list[str | None] = []
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            texts = []
            for i, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    url = part.get("image_url")
                    if not isinstance(url, str):
                        raise PydanticCustomError("image_url_missing", "Content part {index} of type "
                                                  "'input_image' needs an 'image_url' string.", {"index": i})
                    images.append((i, url))
                    order.append(None)
                else:
                    texts.append(part)
                    key = "refusal" if isinstance(part, dict) and part.get("type") == "refusal" else "text"
                    order.append(part.get(key) if isinstance(part, dict) else None)
            if images:
                data = {**data, "content": texts}
        item = handler(data)
        item._images = images
        item._part_order = order
        return item

    def chat_content(self) -> Any:
        """The message's content as chat takes it: its text, or (with images) its parts in
        order, images as ``image_url`` parts."""
        if not self._images:
            return self.content
        urls = iter(url for _, url in self._images)
        return [{"type": "image_url", "image_url": {"url": next(urls)}} if t is None
                else {"type": "text", "text": t} for t in self._part_order]

    @model_validator(mode="before")
    @classmethod
    def _reasoning_as_is(cls, data: Any) -> Any:
        # A reasoning item is not sent to the model: its content (reasoning_text, summary) is not read.
        if isinstance(data, dict) and data.get("type") == "reasoning":
            return {"type": "reasoning"}
        return data

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "InputItem":
        if self.type not in _ITEM_TYPES:
            raise PydanticCustomError(
                "unsupported_item", f"Input items of type {self.type!r} are not supported; this server "
                "takes messages, 'function_call', 'function_call_output' and 'reasoning' items.",
                {"field": "type"})
        for name in _ITEM_FIELDS[self.type]:
            if getattr(self, name) is None:
                raise PydanticCustomError("missing_field", f"A {self.type!r} item needs '{name}'.",
                                          {"field": name})
        return self

class FunctionTool(BaseModel):
    """A function tool, written flat as the Responses API does."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: Text | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function_only(self) -> "FunctionTool":
        if self.type != "function":
            raise PydanticCustomError(
                "unsupported_tool", f"Tools of type {self.type!r} are not supported; only 'function' "
                "tools (the client runs them).", {"field": "type"})
        if not self.name:
            raise PydanticCustomError("missing_name", "A function tool needs a 'name'.", {"field": "name"})
        return self

    def to_chat(self) -> dict[str, Any]:
        fn = {k: v for k, v in (("name", self.name), ("description", self.description),
                                ("parameters", self.parameters), ("strict", self.strict)) if v is not None}
        return {"type": "function", "function": fn}


class NamedFunctionChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "name": ...}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Text


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields inline."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        """The chat completion's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        js = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
              "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in js.items() if v is not None}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


def _input_schema(schema: dict[str, Any], cls: type) -> None:
    """JSON schema hook: ``input`` is a non-empty string or the list of items."""
    _nullable_optionals(schema, cls)
    items = schema["properties"]["input"]
    schema["properties"]["input"] = {"anyOf": [{"type": "string", "minLength": 1}, items]}


class ResponseRequest(_Request):
    """``POST /v1/responses``.

    ``store`` (default true) keeps the response for ``GET /v1/responses/{id}``
    and for ``previous_response_id``, which continues that response's
    conversation (its input and output come before this ``input``; its
    ``instructions`` do not carry over, as in OpenAI's API). ``priority``,
    ``seed``, ``top_k`` and ``cache_salt`` are the extensions chat completions
    have.
    """

    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda schema, cls: _input_schema(schema, cls))
    _image_items: dict[int, int] = PrivateAttr(default_factory=dict)  # chat message index -> input index
    unsupported_fields = RESPONSES_FIELDS
    model: Text
    # A string is one user message (the schema says so: _input_schema).
    input: list[InputItem] = Field(min_length=1, max_length=MAX_INPUT_ITEMS)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = Field(None, min_length=1, max_length=128)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[Text, Field(max_length=512)]] | None = Field(
        None, max_length=MAX_METADATA_KEYS)
    priority: Literal["interactive", "batch"] = "interactive"
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _forced_call_without_text_format(self) -> "ResponseRequest":
        fmt = self.text.format if self.text is not None else None
        if self.tool_choice not in (None, "none", "auto") and fmt is not None and fmt.type != "text":
            raise PydanticCustomError(
                "tool_choice_with_text_format",
                "A forced 'tool_choice' constrains the output itself; it cannot be combined with "
                f"a {fmt.type!r} 'text.format'.", {"field": "tool_choice"})
        return self

    @field_validator("input", mode="before")
    @classmethod
    def _text_input(cls, v: Any) -> Any:
        if v == "":
            raise ValueError("'input' is empty.")
        return [{"role": "user", "content": v}] if isinstance(v, str) else v

    def tool_choice_json(self) -> Any:
        """``tool_choice`` as the response echoes it ("auto" by default)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        return choice if isinstance(choice, str) else choice.model_dump()

    def text_json(self) -> dict[str, Any]:
        """``text`` as the response echoes it."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}

    def input_messages(self, history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """``input`` as chat messages (JSON dicts), instructions not included.

        Consecutive ``function_call`` items become one assistant message's
        ``tool_calls`` (joined to the assistant message just before them, if
        any); a ``function_call_output`` becomes a ``tool`` message named after
        its call, which must come earlier (in `input` or in `history`, the earlier
        turns' messages).

        Raises:
          OpenAIError: 400 for a ``function_call_output`` whose call is not known.
        """
        messages: list[dict[str, Any]] = []
        names = {c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or ()}
        for i, item in enumerate(self.input):
            if item.type == "message":
                if item._images:  # an image's 400 names input[i].content[j] (responses_api.py)
                    self._image_items[len(messages)] = i
                messages.append({"role": item.role, "content": item.chat_content()})
            elif item.type == "function_call":
                names[item.call_id] = item.name
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                if item.call_id not in names:
                    raise OpenAIError(
                        f"No function call with call_id {item.call_id!r} for this output: send the "
                        "'function_call' item before it, or continue its response with "
                        "'previous_response_id'.", param=f"input[{i}].call_id")
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output,
                                 "name": names[item.call_id]})
        return messages

    def input_param(self, param: str | None) -> str | None:
        """A chat error's ``param`` in this request's terms: ``messages[k].content[j]`` of a
        message with images (from :meth:`chat_request`) is ``input[i].content[j]``."""
        import re

        m = re.fullmatch(r"messages\[(\d+)\](\..*)?", param or "")
        if m is None or int(m.group(1)) not in self._image_items:
            return param
        return f"input[{self._image_items[int(m.group(1))]}]{m.group(2) or ''}"

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion this request means, after `history` (the earlier
        turns' messages, from ``previous_response_id``).

        Raises:
          pydantic.ValidationError: the messages or tools are invalid as a chat
            completion (e.g. a tool call whose arguments are not JSON).
          OpenAIError: 400 when there is nothing to answer (only reasoning items).
        """
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else [])
        messages += history
        offset = len(messages)
        messages += self.input_messages(history)
        self._image_items = {offset + k: i for k, i in self._image_items.items()}
        if not messages:
            raise OpenAIError("'input' holds no message to answer.", param="input")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream,
            "priority": self.priority, "service_tier": self.service_tier, "cache_salt": self.cache_salt,
        }
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
        if self.tool_choice is not None:
            c = self.tool_choice
            body["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.to_chat()
        return ChatCompletionRequest.model_validate(body)
