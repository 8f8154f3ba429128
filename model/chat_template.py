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

No JAX import here: the gateway renders prompts through this module.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

__all__ = ["render_gemma3_chat", "render_gemma3_chat_text", "normalize_messages"]

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


def _segments(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    segs: list[str] = [_Control(_BOS)]
    for role, text in normalize_messages(messages):
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


def render_gemma3_chat(messages: Sequence[Mapping[str, Any]], tokenizer: _ChatTokenizer) -> list[int]:
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
    for seg in _segments(messages):
        if isinstance(seg, _Control):
            ids.append(control[str(seg)])
        else:
            ids.extend(tokenizer.encode(seg))
    return ids


def render_gemma3_chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render chat messages to the Gemma 3 prompt text, for display/debugging.

    Control tokens are spelled out (``<bos>``, ``<start_of_turn>``, ...), so
    the result is ambiguous when message text spells them too: never encode
    this string to get model input; use :func:`render_gemma3_chat`.

    Raises:
      ValueError: as :func:`normalize_messages`.
    """
    return "".join(str(s) for s in _segments(messages))
