"""Which tool-call and reasoning parsers a served model gets.

``--tool-call-parser`` and ``--reasoning-parser`` name them; "auto" (the
default) picks from the chat template the model is served with:

=====================================================  ==================  =========
chat template                                          tool-call parser    reasoning
=====================================================  ==================  =========
Gemma 3's built-in one (``model/chat_template.py``)    ``pythonic``        none
a Jinja template that writes ``<tool_call>``           ``hermes``          (below)
(Qwen 2.5 / Qwen3, Hermes)
a Jinja template with ``<|python_tag|>`` or the        ``llama3_json``     (below)
``ipython`` role (Llama 3.1 / 3.2 / 3.3)
a Jinja template that writes ``<think>``, with         (above)             ``think``
``<think>`` and ``</think>`` single tokens
(Qwen3, DeepSeek-R1 distills)
anything else                                          none                none
=====================================================  ==================  =========

A model with no tool-call parser still takes ``tools`` with ``tool_choice``
"none", "required" or a named function (forced calls are parsed as JSON,
``tool_choice.py``); "auto" gets a 400 naming ``--tool-call-parser``.
"""

from __future__ import annotations

from typing import Any

from serving.gateway.tools.tool_parsers import TOOL_PARSERS

REASONING_PARSERS = ("think",)
"""Reasoning formats: ``think`` is ``<think>...</think>`` before the answer."""


def _template_source(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    source = getattr(template, "source", None)
    return source if isinstance(source, str) else None


def _single_tokens(tokenizer: Any, *texts: str) -> bool:
    encode = getattr(tokenizer, "encode_markup", None)
    return encode is not None and all(len(encode(t)) == 1 for t in texts)


def pick_tool_call_parser(tokenizer: Any, setting: str | None = "auto") -> str | None:
    """The tool-call parser for a model served with `tokenizer` (see the table).

    Args:
      setting: "auto", "none", or a name of ``TOOL_PARSERS``.

    Raises:
      ValueError: an unknown setting.
    """
    if setting in (None, "auto"):
        source = _template_source(tokenizer)
        if source is None:
            gemma = getattr(tokenizer, "start_of_turn_id", None) is not None
            return "pythonic" if gemma else None
        if "<tool_call>" in source:
            return "hermes"
        if "<|python_tag|>" in source or "ipython" in source:
            return "llama3_json"
        return None
    if setting == "none":
        return None
    if setting not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {setting!r}; known: auto, none, {', '.join(TOOL_PARSERS)}")
    return setting


def pick_reasoning_parser(tokenizer: Any, setting: str | None = "auto") -> str | None:
    """The reasoning parser for a model served with `tokenizer` (see the table).

    Args:
      setting: "auto", "none" or "think".

    Raises:
      ValueError: an unknown setting, or "think" for a tokenizer without
        single ``<think>`` / ``</think>`` tokens (their ids count reasoning tokens).
    """
    if setting in (None, "auto"):
        source = _template_source(tokenizer)
        if source is not None and "<think>" in source and _single_tokens(tokenizer, "<think>", "</think>"):
            return "think"
        return None
    if setting == "none":
        return None
    if setting not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {setting!r}; known: auto, none, {', '.join(REASONING_PARSERS)}")
    if not _single_tokens(tokenizer, "<think>", "</think>"):
        raise ValueError("--reasoning-parser think needs <think> and </think> to be single tokens of the "
                         "model's tokenizer")
    return setting
