"""Request models of tool calling: ``tools``, ``tool_choice`` and the tool calls
an assistant message carries back (OpenAI's chat completions shapes).

``tools`` is a list of ``{"type": "function", "function": {"name",
"description", "parameters", "strict"}}``; ``parameters`` is a JSON schema of
an object (absent: no parameters). ``tool_choice`` is "none", "auto"
(default when tools are given), "required", or ``{"type": "function",
"function": {"name": ...}}`` naming one of the tools. The legacy
``functions`` / ``function_call`` fields are refused with a pointer to these.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOOLS = 128
"""The most tools one request may declare (OpenAI's limit)."""

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDefinition(BaseModel):
    """A callable function: name (``[A-Za-z0-9_.-]``, at most 64), description,
    and the JSON schema of its arguments object."""

    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"a function name must match [A-Za-z0-9_.-]{{1,64}}; got {v!r}.")
        return v

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (an empty object's when none was given)."""
        return self.parameters if self.parameters else {"type": "object", "properties": {}}

    def to_template(self) -> dict[str, Any]:
        """What chat templates receive (transformers' shape), None fields left out."""
        d: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            d["description"] = self.description
        d["parameters"] = self.schema()
        return d


class ToolDefinition(BaseModel):
    """One entry of ``tools``: only ``"type": "function"`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.to_template()}


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not isinstance(v.get("name"), str):
            raise ValueError("'tool_choice.function' needs a 'name'.")
        return v

    @property
    def name(self) -> str:
        return self.function["name"]


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(BaseModel):
    """A past call's function: name and arguments (JSON text of an object, as
    OpenAI returns them; an object is accepted too)."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"

    def arguments_object(self, where: str) -> dict[str, Any]:
        """The arguments as a dict (what chat templates expect).

        Raises:
          ValueError: arguments that are not a JSON object (naming `where`).
        """
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object (as text).")
        return value


class ToolCallIn(BaseModel):
    """One entry of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn
