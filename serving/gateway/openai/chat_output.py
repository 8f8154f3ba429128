"""One chat choice's generated text, split into reasoning, content and tool calls.

The text arrives in deltas (:class:`~serving.output.output_processor.TextGeneration`).
A reasoning parser (``reasoning.py``), when the model thinks, takes the
``<think>`` part first; a tool-call parser (``serving.gateway.tools.tool_parsers``), when the
request has ``tools``, takes its calls out of the rest; what is left is the
``content``. :meth:`ChatChoiceOutput.feed` returns each delta's
:class:`DeltaMessage` (streamed) and :meth:`ChatChoiceOutput.message` the whole
message (not streamed): both come from the same parsers over the same text,
so the streamed deltas reassemble to the message.

Reasoning tokens are counted from the generated token ids (the ids between
the think-start and think-end tokens), not from the text, so they are right
also when the template opened ``<think>`` in the prompt.

A forced tool call (``tool_choice`` "required" or a named function) is
generated under a JSON schema (``tool_choice.py``) and parsed by its own
parser, which has the same interface.
"""

from __future__ import annotations

from typing import Protocol

from serving.gateway.schema.response_models import (
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from serving.output.output_processor import TextGeneration


class _ToolParser(Protocol):
    calls: list  # ToolCall(id, name, arguments)
    abandoned: list  # indexes of calls streamed, then given back as content

    def feed(self, text: str) -> tuple[str, list]: ...

    def finish(self) -> tuple[str, list]: ...


class _ReasoningParser(Protocol):
    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


class ReasoningTokens(Protocol):
    """Counts a choice's reasoning tokens from its generated ids."""

    def __call__(self, token_ids: list[int]) -> int: ...


class ChatChoiceOutput:
    """Reasoning, content and tool calls of one chat choice.

    Args:
      output: the choice's output pipeline (its ``token_ids`` count reasoning).
      reasoning: a reasoning parser, or None (the model does not think).
      tools: a tool-call parser, or None (no tools, or ``tool_choice: "none"``).
      count_reasoning: counts reasoning tokens in the generated ids (None: 0).
    """

    def __init__(self, output: TextGeneration, reasoning: _ReasoningParser | None = None,
                 tools: _ToolParser | None = None, count_reasoning: ReasoningTokens | None = None) -> None:
        self.output = output
        self.reasoning = reasoning
        self.tools = tools
        self.count_reasoning = count_reasoning
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self._finished = False

    @property
    def tool_calls(self) -> list:
        """The complete calls (``ToolCall``: id, name, arguments), in order."""
        return [] if self.tools is None else list(self.tools.calls)

    @property
    def abandoned_calls(self) -> list[int]:
        """Tool-call indexes whose deltas were sent but whose text turned out not to be
        a call (malformed or unfinished); it came back as content."""
        return [] if self.tools is None else list(self.tools.abandoned)

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens inside the thinking (markers excluded)."""
        if self.count_reasoning is None:
            return 0
        return self.count_reasoning(self.output.token_ids)

    def _delta(self, reasoning: str, content: str, calls: list) -> DeltaMessage | None:
        if reasoning:
            self.reasoning_parts.append(reasoning)
        if content:
            self.content_parts.append(content)
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(
            reasoning_content=reasoning or None, content=content or None,
            tool_calls=[DeltaToolCall(
                index=c.index, id=c.id, type="function" if c.id is not None else None,
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)

    def _split(self, reasoning_out: tuple[str, str], final: bool) -> tuple[str, str, list]:
        reasoning, text = reasoning_out
        if self.tools is None:
            return reasoning, text, []
        content, calls = self.tools.feed(text) if text else ("", [])
        if final:
            more, late = self.tools.finish()
            content, calls = content + more, calls + late
        return reasoning, content, calls

    def feed(self, text: str) -> DeltaMessage | None:
        """The delta message for the next piece of generated text (None: nothing to send yet)."""
        split = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._delta(*self._split(split, final=False))

    def finish(self) -> DeltaMessage | None:
        """What the parsers held back, once the text ended (idempotent)."""
        if self._finished:
            return None
        self._finished = True
        split = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._delta(*self._split(split, final=True))

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the choice stopped after calling tools."""
        if engine_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self) -> ChatMessageOut:
        """The whole assistant message (after :meth:`finish`)."""
        calls = self.tool_calls
        content = "".join(self.content_parts)
        return ChatMessageOut(
            content=content if content or not calls else None,
            reasoning_content="".join(self.reasoning_parts) or None,
            tool_calls=[ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                        for c in calls] or None)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"ChatChoiceOutput({self.output.request_id}, tools={self.tools!r})"

