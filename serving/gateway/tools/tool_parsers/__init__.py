"""Tool calls in a model's generated text, found as it streams.

A parser is fed the generated text delta by delta (as the detokenizer yields
it) and splits it into plain content and tool calls, the latter as OpenAI's
streamed ``tool_calls`` deltas; after :meth:`ToolParser.finish`,
:attr:`ToolParser.calls` holds the complete calls for a non-streamed reply.
One class per model family's format (:data:`TOOL_PARSERS`):

- ``hermes``: Hermes' / Qwen's function-calling format (NousResearch
  Hermes-Function-Calling; Qwen 2.5 and Qwen3 chat templates): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; any
  number of them, with content before, between or after.
- ``llama3_json``: Meta's Llama 3.1 / 3.2 / 3.3 JSON tool calling ("Model
  Cards & Prompt formats", JSON based tool calling): the whole output is
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted too),
  optionally after ``<|python_tag|>``, several calls separated by ``;``.
- ``pythonic``: Google's Gemma function-calling docs and Llama 3.2 / 4's
  pythonic format: the whole output is a Python list of calls with keyword
  arguments, ``[get_weather(city="Paris"), get_time()]``, optionally in a
  ```` ```tool_code ```` fence.

The rules all formats share:

- The result does not depend on how the text is chunked: the same text fed
  in any deltas gives the same ``calls`` and the same concatenated content.
  A decision that needs text not yet seen (``<tool_`` at the end of a delta,
  an output that so far is only whitespace) waits for it.
- A call's first delta carries its ``index``, ``id`` and ``name`` with
  ``arguments=""``; later deltas carry argument fragments, which concatenated
  equal :attr:`ToolCall.arguments`. ``index`` counts the calls of the
  completion whose first delta was sent (0, 1, ...).
- ``arguments`` is JSON text of an object. In the JSON formats it is the
  arguments object's text exactly as the model wrote it (no re-serialising),
  so its fragments stream as they arrive; an arguments value given as a JSON
  string holding an object (``"arguments": "{\\"a\\": 1}"``) is unwrapped to
  that string's text (sent in one fragment when the string closes); a
  missing, ``null``, ``{}`` or empty-string value is ``"{}"``. In the
  pythonic format it is ``json.dumps(kwargs, ensure_ascii=False)`` of the
  literal keyword arguments (``", "`` and ``": "`` separators), sent in one
  fragment when the call's text is complete; ``g()`` is ``"{}"``.
- A malformed call is content, never an exception: its raw text (tags
  included) is returned as content. Malformed means invalid JSON (``NaN``
  included), no string ``name``, a name not in ``tool_names`` (when given),
  arguments that are not an object, or (pythonic) positional or non-literal
  arguments. So is the text of a call that is unfinished at :meth:`finish`,
  unless its JSON object (or pythonic call) is already complete, which then
  is a call. A JSON call's first delta is sent as soon as its name is known,
  and its arguments stream, so a call can turn out malformed (invalid JSON
  later on, or cut off by ``max_tokens``) after deltas for it were sent: its
  index is then listed in :attr:`ToolParser.abandoned`, its text comes back
  as content, and the next call takes the next index (indexes are not
  reused). Pythonic calls are only sent once complete and never abandoned.
- Whitespace that only separates calls (before a ``<tool_call>`` tag, around
  ``;``, after the last call when nothing else follows) is dropped; any other
  text outside calls is content, unchanged.

May import: nothing of ours.
"""

from __future__ import annotations

from serving.gateway.tools.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser, new_call_id
from serving.gateway.tools.tool_parsers.json_formats import HermesToolParser, Llama3JsonToolParser
from serving.gateway.tools.tool_parsers.pythonic import PythonicToolParser

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "PythonicToolParser",
           "ToolCall", "ToolCallDelta", "ToolParser", "new_call_id", "tool_parser"]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}
"""The tool call formats by name (the names vLLM's ``--tool-call-parser`` uses)."""


def tool_parser(name: str) -> type[ToolParser]:
    """The parser class (a factory taking ``tool_names``, ``new_id``) of
    format `name`; raises ValueError naming the known formats."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
