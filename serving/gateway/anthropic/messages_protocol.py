"""Request models of Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``) and their translation into a chat completion.

A Messages request is a chat completion in other words:

* ``system`` (a string or a list of text blocks) is the system message;
* each message's ``content`` is a string or a list of blocks:

  - ``text``; ``image`` (``source`` ``base64`` with its ``media_type``, or ``url``)
    in user messages: a chat ``image_url`` part (a data URL, or the URL, held to the
    gateway's image rules);
  - ``tool_use`` (``id``, ``name``, ``input`` object) in assistant messages: the
    message's ``tool_calls``;
  - ``tool_result`` (``tool_use_id``, ``content`` a string or text blocks,
    ``is_error``) in user messages: a ``tool`` message answering that call, which
    must come earlier; the user message's other blocks follow it as a user message;
  - ``thinking`` / ``redacted_thinking`` in assistant messages: earlier thinking
    (``reasoning_content``; redacted thinking is dropped);

* ``max_tokens`` (required) is ``max_tokens``, ``stop_sequences`` is ``stop`` (at
  most 4), ``temperature`` (0..1), ``top_p``, ``top_k`` as in chat;
* ``tools`` (``name``, ``description``, ``input_schema``) are function tools;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` (with ``name``) / ``none`` is chat's
  "auto" / "required" / the named function / "none", and
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
* ``thinking`` (``enabled`` with ``budget_tokens`` >= 1024 and below ``max_tokens``,
  or ``disabled``) decides whether a model served with a reasoning parser returns
  its thinking as ``thinking`` blocks (the budget is not enforced: the model thinks
  as its template makes it);
* ``metadata.user_id`` goes into the request's trace.

Refused with a 400 naming the field: server tools (``web_search_…``, ``bash_…``, any
``type`` but ``custom``), ``document`` / ``search_result`` / other block types, an
image in a tool result or an assistant message, a final assistant message
(prefill: this server does not continue a partial turn), and more than 4 stop
sequences. ``cache_control``, ``service_tier``, ``container`` and ``mcp_servers`` are
not read.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from serving.gateway.http.errors import OpenAIError
from serving.gateway.schema.protocol import INT32_MAX, MAX_STOP_STRINGS, ChatCompletionRequest, Text, _Request
from serving.gateway.tools.tool_protocol import MAX_TOOLS

MAX_MESSAGES = 4096
"""The most messages one request may carry."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: not read


class TextBlock(_Block):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: Text


class Base64Source(_Block):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class UrlSource(_Block):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Block):
    """``{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}``."""

    type: Literal["image"]
    source: Annotated[Union[Base64Source, UrlSource], Field(discriminator="type")]

    def url(self) -> str:
        """The image as chat's ``image_url`` takes it (a data URL for base64 data)."""
        s = self.source
        return f"data:{s.media_type};base64,{s.data}" if isinstance(s, Base64Source) else s.url


class ToolUseBlock(_Block):
    """An assistant's earlier call: ``{"type": "tool_use", "id", "name", "input": {...}}``."""

    type: Literal["tool_use"]
    id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(min_length=1, max_length=64)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A call's result: ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``;
    ``content`` a string or a list of text blocks (joined with newlines)."""

    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1, max_length=256)
    content: Text | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] = ""
    is_error: bool = False

    def text(self, where: str) -> str:
        """The result as one string.

        Raises:
          OpenAIError: 400 for an image in the result (a tool message holds text only).
        """
        if isinstance(self.content, str):
            return self.content
        for j, b in enumerate(self.content):
            if isinstance(b, ImageBlock):
                raise OpenAIError(f"{where}.content[{j}]: images in a tool_result are not supported; "
                                  "send the image in a user message's content instead.",
                                  param=f"{where}.content[{j}]")
        return "\n".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    """Earlier thinking: ``{"type": "thinking", "thinking", "signature"}`` (the signature is not checked)."""

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class MessageParam(_Block):
    """One input message: ``role`` user or assistant, ``content`` a string or blocks."""

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> "MessageParam":
        if isinstance(self.content, str):
            return self
        for j, b in enumerate(self.content):
            bad = ((self.role == "user" and isinstance(b, (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)))
                   or (self.role == "assistant" and isinstance(b, (ToolResultBlock, ImageBlock))))
            if bad:
                raise PydanticCustomError(
                    "block_not_of_role", f"A {self.role} message cannot hold a {b.type!r} block "
                    f"(content[{j}]).", {"field": "content"})
        return self


class ToolParam(_Block):
    """A client tool: ``{"name", "description", "input_schema"}`` (``type`` absent or "custom")."""

    type: str | None = None
    name: Text
    description: Text | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_tool", f"Tools of type {data.get('type')!r} (server tools) are not supported; "
                "only client tools ({'name', 'description', 'input_schema'}).", {"field": "type"})
        return data

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not _TOOL_NAME.match(v):
            raise ValueError(f"a tool name must match ^[a-zA-Z0-9_-]{{1,64}}$; got {v!r}.")
        return v

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError("'input_schema' must be a JSON schema with \"type\": \"object\".")
        return v


class ToolChoiceParam(_Block):
    """``{"type": "auto" | "any" | "tool" | "none", "name" (tool), "disable_parallel_tool_use"}``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoiceParam":
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice_name", "'tool_choice' of type 'tool' needs a 'name' "
                                      "(and only it takes one).", {"field": "name"})
        return self

    def to_chat(self) -> Any:
        """Chat's ``tool_choice``."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingParam(_Block):
    """``{"type": "enabled", "budget_tokens": N}`` or ``{"type": "disabled"}``."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024, le=INT32_MAX)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "ThinkingParam":
        if self.type == "enabled" and self.budget_tokens is None:
            raise PydanticCustomError("budget_missing", "'thinking' of type 'enabled' needs 'budget_tokens' "
                                      "(at least 1024).", {"field": "budget_tokens"})
        return self


class Metadata(_Block):
    user_id: Text | None = Field(None, max_length=256)


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: the prompt's fields of a Messages request."""

    model: Text
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    _origin: dict[int, tuple[int, int]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _tools_consistent(self) -> "CountTokensRequest":
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("duplicate_tool", "'tools' holds two tools with the same name.",
                                      {"field": "tools"})
        c = self.tool_choice
        if c is not None and c.type in ("any", "tool") and not names:
            raise PydanticCustomError("tool_choice_without_tools", f"'tool_choice' of type {c.type!r} needs "
                                      "'tools' to choose from.", {"field": "tool_choice"})
        if c is not None and c.type == "tool" and c.name not in names:
            raise PydanticCustomError("unknown_tool", f"'tool_choice' names {c.name!r}, which is not among "
                                      "'tools'.", {"field": "tool_choice"})
        if self.messages[-1].role == "assistant":
            raise PydanticCustomError(
                "assistant_prefill", "The last message is an assistant message: this server does not "
                "continue a partial assistant turn (prefill); end with a user message.", {"field": "messages"})
        return self

    @property
    def shows_thinking(self) -> bool:
        """Whether the response returns the model's thinking as ``thinking`` blocks."""
        return self.thinking is not None and self.thinking.type == "enabled"

    def system_text(self) -> str | None:
        """``system`` as one string (text blocks joined with newlines), None when absent."""
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n".join(b.text for b in self.system) or None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat messages (JSON dicts), the system message first.

        Raises:
          OpenAIError: 400 for a ``tool_result`` whose ``tool_use_id`` no earlier
            ``tool_use`` has, or an image in a tool result.
        """
        system = self.system_text()
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        names: dict[str, str] = {}
        self._origin = {}
        for i, m in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            if m.role == "assistant":
                out.append(self._assistant(blocks, names))
                continue
            parts: list[dict[str, Any]] = []
            start = 0
            for j, b in enumerate(blocks):
                if isinstance(b, ToolResultBlock):
                    if parts:
                        self._origin[len(out)] = (i, start)
                        out.append(_user(parts))
                        parts = []
                    where = f"messages[{i}].content[{j}]"
                    if b.tool_use_id not in names:
                        raise OpenAIError(f"{where}: no earlier tool_use has id {b.tool_use_id!r}.",
                                          param=f"{where}.tool_use_id")
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "name": names[b.tool_use_id],
                                "content": b.text(where)})
                    continue
                if not parts:
                    start = j
                parts.append({"type": "text", "text": b.text} if isinstance(b, TextBlock)
                             else {"type": "image_url", "image_url": {"url": b.url()}})
            if parts:
                self._origin[len(out)] = (i, start)
                out.append(_user(parts))
        return out

    @staticmethod
    def _assistant(blocks: list, names: dict[str, str]) -> dict[str, Any]:
        text = [b.text for b in blocks if isinstance(b, TextBlock)]
        thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        calls = []
        for b in blocks:
            if isinstance(b, ToolUseBlock):
                names[b.id] = b.name
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input)}})
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        return msg

    def anthropic_param(self, param: str | None) -> str | None:
        """A chat error's ``param`` in this request's terms: ``messages[k].content[j]`` of
        chat message k (from :meth:`chat_messages`) is the block it came from."""
        m = re.fullmatch(r"messages\[(\d+)\]\.content\[(\d+)\](.*)", param or "")
        if m is None or int(m.group(1)) not in self._origin:
            return param
        i, start = self._origin[int(m.group(1))]
        return f"messages[{i}].content[{start + int(m.group(2))}]{m.group(3)}"

    def chat_body(self) -> dict[str, Any]:
        """The chat completion's fields this request sets (messages, tools, tool_choice)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in (("name", t.name), ("description", t.description),
                                  ("parameters", t.input_schema)) if v is not None}} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.to_chat()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return body

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request means.

        Raises:
          pydantic.ValidationError: what chat refuses of the translation.
          OpenAIError: see :meth:`chat_messages`.
        """
        return ChatCompletionRequest.model_validate(self.chat_body())


def _user(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A user chat message from text and image parts (text alone as a string)."""
    if all(p["type"] == "text" for p in parts):
        return {"role": "user", "content": "\n".join(p["text"] for p in parts)}
    return {"role": "user", "content": parts}


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (see the module docstring)."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _few_stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"this server takes at most {MAX_STOP_STRINGS} stop sequences (got {len(v)}).")
        if v is not None and any(s == "" for s in v):
            raise ValueError("a stop sequence must not be empty.")
        return v

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> "MessagesRequest":
        t = self.thinking
        if t is not None and t.type == "enabled" and t.budget_tokens >= self.max_tokens:
            raise PydanticCustomError("budget_above_max_tokens", f"'thinking.budget_tokens' "
                                      f"({t.budget_tokens}) must be less than 'max_tokens' ({self.max_tokens}).",
                                      {"field": "thinking"})
        return self

    def chat_request(self) -> ChatCompletionRequest:
        body = self.chat_body()
        body.update({"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                     "top_k": self.top_k, "stop": self.stop_sequences, "stream": self.stream})
        return ChatCompletionRequest.model_validate(body)
