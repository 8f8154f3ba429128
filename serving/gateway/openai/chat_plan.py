"""What a chat request's tools and the model's reasoning mean for one request.

:func:`chat_plan` decides, from the request and the served model:

- the tools handed to the chat template (``tools``, also with
  ``tool_choice: "none"``, as OpenAI's API shows the model its tools then too);
- the structured output: the request's own, or the forced call's JSON schema
  (``tool_choice.py``) for "required" or a named function;
- each choice's output parsers (``chat_output.py``): the model's tool-call
  parser for "auto" (``--tool-call-parser``, else the one picked for the
  model, see ``serving.gateway.tools.tool_parsers``), the forced call's parser, or none; the
  reasoning parser when the model thinks (``--reasoning-parser``).

Reasoning and structured output: when the model thinks, the constraint (a
``response_format`` or a forced call) applies only after the thinking ends:
the engine arms it once the think-end token is generated
(``StructuredOutput.after_token_id``). It is not deferred when the template
closed a thinking block at the very end of the prompt (Qwen3 with thinking
off renders ``<think>\\n\\n</think>``): that model will not think.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from serving.contract.engine_client import StructuredOutput
from serving.gateway.http.errors import OpenAIError
from serving.gateway.openai.chat_output import ChatChoiceOutput
from serving.gateway.openai.served_model import ServedModel
from serving.gateway.schema.protocol import ChatCompletionRequest
from serving.gateway.tools.reasoning import ReasoningParser, count_reasoning_tokens, prompt_opens_reasoning
from serving.gateway.tools.tool_choice import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from serving.gateway.tools.tool_parsers import tool_parser
from serving.gateway.tools.tool_protocol import NamedToolChoice
from serving.output.output_processor import TextGeneration

THINK_START, THINK_END = "<think>", "</think>"

_CLOSED_TAIL = 8
"""A think-end id among the prompt's last this many ids, after its last think-start:
the template closed the thinking (the model will not think)."""


@functools.lru_cache(maxsize=64)
def _marker_ids(tokenizer) -> tuple[int, int] | None:
    encode = getattr(tokenizer, "encode_markup", None)
    if encode is None:
        return None
    start, end = encode(THINK_START), encode(THINK_END)
    if len(start) != 1 or len(end) != 1:
        return None
    return start[0], end[0]


def reasoning_marker_ids(served: ServedModel) -> tuple[int, int]:
    """The (think-start, think-end) token ids of a model that thinks.

    Raises:
      OpenAIError: 500 when the tokenizer has no single tokens for them.
    """
    ids = _marker_ids(served.tokenizer)
    if ids is None:
        raise OpenAIError(f"Model {served.name!r} is served with a reasoning parser, but its tokenizer "
                          f"has no single {THINK_START}/{THINK_END} tokens.", status_code=500,
                          type="server_error")
    return ids


@dataclasses.dataclass
class ChatPlan:
    """Tools, constraint and output parsers of one chat request (see the module docstring).

    Attributes:
      template_tools: the tools as the chat template takes them (None: none).
      structured_output: the constraint to generate under (None: none).
    """

    req: ChatCompletionRequest
    served: ServedModel
    template_tools: list[dict] | None
    structured_output: StructuredOutput | None
    thinks: bool = False
    starts_in_reasoning: bool = False

    def bind_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Reads the rendered prompt: whether the template opened (or closed) the
        thinking, and so when the constraint starts."""
        if not self.thinks:
            return
        start_id, end_id = reasoning_marker_ids(self.served)
        self.starts_in_reasoning = prompt_opens_reasoning(prompt_ids, start_id, end_id)
        tail = list(prompt_ids[-_CLOSED_TAIL:])
        closed = not self.starts_in_reasoning and end_id in tail
        if closed:
            self.thinks = False  # the template turned thinking off
        elif self.structured_output is not None:
            self.structured_output = dataclasses.replace(self.structured_output, after_token_id=end_id)

    def output(self, gen: TextGeneration) -> ChatChoiceOutput:
        """The output parsers of one choice."""
        reasoning = counter = None
        if self.thinks:
            start_id, end_id = reasoning_marker_ids(self.served)
            starts = self.starts_in_reasoning
            reasoning = ReasoningParser(THINK_START, THINK_END, starts_in_reasoning=starts)
            counter = functools.partial(count_reasoning_tokens, start_id=start_id, end_id=end_id,
                                        starts_in_reasoning=starts)
        return ChatChoiceOutput(gen, reasoning, self._tool_parser(), counter)

    def _tool_parser(self):
        choice = self.req.effective_tool_choice
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return NamedCallParser(choice.name)
        if choice == "required":
            return RequiredCallsParser()
        return tool_parser(self.served.tool_call_parser)([t.function.name for t in self.req.tools])


def chat_plan(req: ChatCompletionRequest, served: ServedModel) -> ChatPlan:
    """The plan of `req` on `served` (see the module docstring).

    Raises:
      OpenAIError: 400 ``tool_choice`` "auto" on a model served without a
        tool-call parser.
    """
    tools = req.tools or []
    choice = req.effective_tool_choice
    so = req.structured_output
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.name)
        so = StructuredOutput("json_schema", named_schema(fn))
    elif choice == "required":
        so = StructuredOutput("json_schema", required_schema([t.function for t in tools],
                                                             req.parallel_tool_calls))
    elif choice == "auto" and served.tool_call_parser is None:
        raise OpenAIError(f"Model {served.name!r} has no tool-call parser, so it cannot choose to call "
                          f"tools ('tool_choice': 'auto'); send 'tool_choice': 'required' or a named "
                          f"function, or serve it with --tool-call-parser.", param="tool_choice")
    return ChatPlan(req, served, [t.to_template() for t in tools] or None, so,
                    thinks=served.reasoning_parser is not None)
