"""Gemma 3 chat template, rendered straight to token ids.

The GGUF carries no chat template; the format is written down in
``tests/data/gemma3_chat_template.md`` (Gemma 3's published template):

    <bos><start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n
    <start_of_turn>model\\n{assistant}<end_of_turn>\\n ... <start_of_turn>model\\n

- a leading ``system`` message has no turn of its own: its trimmed content plus
  ``"\\n\\n"`` is prepended to the first user message's content;
- each message is ``<start_of_turn>`` + ROLE + ``"\\n"`` + trimmed content +
  ``<end_of_turn>`` + ``"\\n"``, ROLE ``user`` or ``model`` (for ``assistant``);
- the generation prompt ``<start_of_turn>model\\n`` is always appended.

Only the template inserts control tokens (``<bos>``, ``<start_of_turn>``,
``<end_of_turn>``). The text between two control tokens is encoded as one
plain-text segment without BOS, so message text that spells
``<start_of_turn>`` stays ordinary text. This matches the reference ids,
which were produced by encoding each segment between control tokens.

Tools (our format; Gemma 3 has no tool tokens, and Google's function-calling
guide for it asks for calls written as a Python list in plain text):

- with ``tools``, the system text (a system message is made when there is
  none) ends with :data:`TOOLS_PREAMBLE` and one line per function: its
  ``{"name", "description", "parameters"}`` as JSON;
- an assistant message's ``tool_calls`` are rendered after its content as
  ``[name(arg=value, ...), ...]`` with the arguments as Python literals
  (strings quoted as JSON does, ``True``/``False``/``None``), which is what
  the ``pythonic`` tool-call parser reads back;
- consecutive ``tool`` messages become one user turn, each result as a
  fenced block: ```` ```tool_output\n{content}\n``` ````.

Without tools, tool calls or tool messages, the rendering is exactly the
published template above.

No JAX import here: the gateway renders prompts through this module.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Protocol, Sequence

__all__ = ["render_gemma3_chat", "render_gemma3_chat_text", "normalize_messages", "TOOLS_PREAMBLE"]

TOOLS_PREAMBLE = (
    "You can call functions. To call one or more, reply with only a Python list of calls, "
    "like [name(arg=value), other()], and no other text. Their results come back in "
    "```tool_output``` blocks. The functions, as JSON schemas:"
)
"""The text that introduces the tools in the system text (see the module docstring)."""

_ROLE_NAMES = {"user": "user", "assistant": "model", "model": "model"}


class _ChatTokenizer(Protocol):
    bos_id: int
    start_of_turn_id: int
    end_of_turn_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...


# A rendered chat is a list of segments: a _Control is a control token (one of
# the spellings below), any other str is plain text.
_BOS, _SOT, _EOT = "<bos>", "<start_of_turn>", "<end_of_turn>"


class _Control(str):
    """Marks a control-token segment (its value is the token's spelling)."""


def _content_text(content: Any, index: int) -> str:
    """OpenAI-style content (str, None, or list of text parts) -> str."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(
                    f"messages[{index}].content[{j}] must be an object like "
                    f'{{"type": "text", "text": ...}}, got {type(part).__name__}'
                )
            ptype = part.get("type")
            if ptype != "text":
                raise ValueError(
                    f"messages[{index}].content[{j}] has type {ptype!r}; only text content "
                    f'("type": "text") is supported'
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{index}].content[{j}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise ValueError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Validate chat messages and return ``[(turn_role, text), ...]``.

    The leading system message (if any) is folded into the first user message
    as ``system.strip() + "\\n\\n" + user.strip()``; every other content is
    stripped (Jinja ``trim``, i.e. ``str.strip()``). ``turn_role`` is ``"user"``
    or ``"model"``. A list of text parts is concatenated before trimming.
    Content ``None`` counts as empty. If the conversation has a system message
    but no user message, the system text becomes a user turn at the start.
    Roles need not alternate.

    Args:
      messages: a sequence of mappings with ``"role"`` (``system``, ``user``,
        ``assistant``; ``model`` is accepted as an alias of ``assistant``) and
        ``"content"`` (a string or a list of ``{"type": "text", "text": str}``).

    Raises:
      ValueError: empty list, a message that is not a mapping or has no role,
        an unknown role, a system message that is not the first message, or
        content that is not text.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role', 'content'} objects")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")

    system_text: str | None = None
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] has no 'role' string")
        text = _content_text(msg.get("content"), i).strip()
        if role == "system":
            if i != 0:
                raise ValueError(
                    f"a system message is only allowed as the first message (found at messages[{i}])"
                )
            system_text = text
            continue
        if role not in _ROLE_NAMES:
            raise ValueError(
                f"messages[{i}] has unknown role {role!r}; expected 'system', 'user' or 'assistant'"
            )
        turns.append((_ROLE_NAMES[role], text))

    if system_text is not None:
        for k, (role, text) in enumerate(turns):
            if role == "user":
                turns[k] = (role, system_text + "\n\n" + text)
                break
        else:
            turns.insert(0, ("user", system_text))
    return turns


def _python_literal(value: Any) -> str:
    """`value` (parsed JSON) as a Python literal."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "None"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_python_literal(str(k))}: {_python_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"a tool-call argument of type {type(value).__name__} is not JSON")


def _call_text(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be {{'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args or "{}")
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments must be an object")
    return fn["name"] + "(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in args.items()) + ")"


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [TOOLS_PREAMBLE]
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
        lines.append(json.dumps({k: fn[k] for k in ("name", "description", "parameters") if k in fn},
                                ensure_ascii=False))
    return "\n".join(lines)


def _with_tools(messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None) -> Sequence[Mapping[str, Any]]:
    """The messages with tools, tool calls and tool results written as plain text
    (see the module docstring); unchanged when there are none."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return messages  # normalize_messages says what is wrong
    plain = not tools and all(
        isinstance(m, Mapping) and m.get("role") != "tool" and not m.get("tool_calls") for m in messages)
    if plain:
        return messages
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        text = _content_text(m.get("content"), i).strip()
        if role == "tool":
            block = f"```tool_output\n{text}\n```"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "[" + ", ".join(_call_text(c, f"messages[{i}].tool_calls[{k}]")
                                    for k, c in enumerate(m["tool_calls"])) + "]"
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": role, "content": text})
    if tools:
        block = _tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _segments(messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    segs: list[str] = [_Control(_BOS)]
    for role, text in normalize_messages(_with_tools(messages, tools)):
        segs += [_Control(_SOT), role + "\n" + text, _Control(_EOT), "\n"]
    segs += [_Control(_SOT), "model\n"]
    # Merge adjacent plain-text segments so each run between control tokens is
    # encoded once (as the reference did); drop empty text.
    merged: list[str] = []
    for s in segs:
        if not isinstance(s, _Control) and merged and not isinstance(merged[-1], _Control):
            merged[-1] = merged[-1] + s
        elif isinstance(s, _Control) or s:
            merged.append(s)
    return merged


def render_gemma3_chat(messages: Sequence[Mapping[str, Any]], tokenizer: _ChatTokenizer,
                       tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """Render chat messages to Gemma 3 prompt token ids, with the generation prompt.

    Implements ``tests/data/gemma3_chat_template.md`` (see the module
    docstring). Control ids come from ``tokenizer.bos_id``,
    ``start_of_turn_id`` and ``end_of_turn_id``; each text run between two
    control tokens is encoded with ``tokenizer.encode(text)`` (no BOS), so
    control-token spellings inside messages stay plain text.

    Args:
      messages: see :func:`normalize_messages`.
      tokenizer: a ``model.tokenizer.Tokenizer`` (anything with ``encode``,
        ``bos_id``, ``start_of_turn_id``, ``end_of_turn_id``).
      tools: functions the model may call (``[{"type": "function", "function":
        {"name", "description", "parameters"}}]``), or None.

    Returns:
      ``list[int]``, starting with ``bos_id`` and ending with the ids of
      ``<start_of_turn>model\\n``.

    Raises:
      ValueError: as :func:`normalize_messages`.
    """
    control = {
        _BOS: tokenizer.bos_id,
        _SOT: tokenizer.start_of_turn_id,
        _EOT: tokenizer.end_of_turn_id,
    }
    ids: list[int] = []
    for seg in _segments(messages, tools):
        if isinstance(seg, _Control):
            ids.append(control[str(seg)])
        else:
            ids.extend(tokenizer.encode(seg))
    return ids


def render_gemma3_chat_text(messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Render chat messages to the Gemma 3 prompt text, for display/debugging.

    Control tokens are spelled out (``<bos>``, ``<start_of_turn>``, ...), so
    the result is ambiguous when message text spells them too: never encode
    this string to get model input; use :func:`render_gemma3_chat`.

    Raises:
      ValueError: as :func:`normalize_messages`.
    """
    return "".join(str(s) for s in _segments(messages, tools))
