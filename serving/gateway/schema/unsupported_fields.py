"""Request fields that other OpenAI-compatible servers implement and this one does not.

Clients written for vLLM or for OpenAI send these; ignoring them would hand
the client unconstrained output with a 200 (a ``guided_choice`` the model never
saw, a ``min_p`` that was not applied). So each field here is refused with a
400 naming it, unless its value is *neutral*: the value that means what this
server does anyway (``min_p`` 0, ``use_beam_search`` false,
``skip_special_tokens`` true, ...). ``null`` is always neutral (absent).

Fields this server does not know and that cannot change the output (``user``,
``metadata``, ``request_id``, ``kv_transfer_params``, ...) are not listed: they
are ignored, as OpenAI's API allows. Fields the protocol models declare
themselves (``suffix``, ``tools``, ...) are
refused there. Implementing a field means removing it from these tables
(``min_p``, ``repetition_penalty``, ``min_tokens`` and ``stop_token_ids`` were,
and are now fields of ``protocol.py``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A field refused unless its value is one of ``neutral``.

    Attributes:
      neutral: the values that change nothing (compared with ``==``, a bool
        matching only a bool, so ``1`` is not ``true``); ``None`` is always neutral.
      message: why it is refused / what to do instead (one sentence).
    """

    neutral: tuple[Any, ...]
    message: str

    def is_neutral(self, value: Any) -> bool:
        """Whether `value` (parsed JSON) means what the server does anyway."""
        return value is None or any(_same(value, n) for n in self.neutral)

    def refusal(self, name: str) -> str:
        """The error message for a non-neutral value of the field `name`."""
        fix = f"Omit it or send {json.dumps(self.neutral[0])}" if self.neutral else "Omit it"
        return f"Unsupported parameter '{name}': {self.message} {fix}."


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


_GUIDED = ("this option of structured output is not supported; send the constraint in "
           "'response_format', 'structured_outputs' or a 'guided_*' field.")

SAMPLING_FIELDS: Mapping[str, Unsupported] = {
    # vLLM sampling parameters
    "use_beam_search": Unsupported((False,), "beam search is not supported by this server."),
    "length_penalty": Unsupported((1,), "beam search (and its length_penalty) is not supported."),
    "include_stop_str_in_output": Unsupported(
        (False,), "the stop string is never included in the output by this server."),
    "skip_special_tokens": Unsupported((True,), "special tokens are always left out of the text."),
    "bad_words": Unsupported(([],), "bad_words is not supported by this server."),
    "allowed_token_ids": Unsupported((), "allowed_token_ids is not supported by this server."),
    "logits_processors": Unsupported(([],), "logits processors are not supported by this server."),
    "prompt_logprobs": Unsupported(
        (), "vLLM's prompt_logprobs response field is not produced; on /v1/completions send "
            "'echo': true with 'logprobs' (the prompt's tokens come first, OpenAI's shape)."),
    "truncate_prompt_tokens": Unsupported(
        (), "prompts are never truncated by this server; shorten the prompt instead."),
    "return_token_ids": Unsupported((False,), "return_token_ids is not supported by this server."),
    "vllm_xargs": Unsupported(({},), "vllm_xargs is not supported by this server."),
    # vLLM structured-output options (the constraints themselves: structured_request.py)
    "guided_decoding_backend": Unsupported((), _GUIDED),
    "guided_whitespace_pattern": Unsupported((), _GUIDED),
    "structural_tag": Unsupported((), _GUIDED),
}
"""Refused on both ``/v1/completions`` and ``/v1/chat/completions``."""

COMPLETION_FIELDS: Mapping[str, Unsupported] = {
    **SAMPLING_FIELDS,
    "add_special_tokens": Unsupported((True,), "the BOS token is always added to a text prompt."),
    "prompt_embeds": Unsupported((), "prompt embeddings are not supported; send text or token ids."),
}
"""Refused on ``/v1/completions``."""

CHAT_FIELDS: Mapping[str, Unsupported] = {
    **SAMPLING_FIELDS,
    "add_special_tokens": Unsupported((False,), "the chat template alone adds special tokens."),
    "echo": Unsupported((False,), "echo is not supported by this server."),
    "best_of": Unsupported((1,), "best_of is a /v1/completions option; on chat send 'n'."),
    "add_generation_prompt": Unsupported((True,), "the generation prompt is always added."),
    "continue_final_message": Unsupported((False,), "continuing the final message is not supported."),
    "chat_template": Unsupported((), "the model's own chat template is always used."),
    "chat_template_kwargs": Unsupported(({},), "chat template arguments are not supported."),
    "documents": Unsupported((), "documents (RAG) are not supported by this server."),
    "modalities": Unsupported((["text"],), "only text output is supported."),
    "audio": Unsupported((), "audio output is not supported by this server."),
    "web_search_options": Unsupported((), "web search is not supported by this server."),
}
"""Refused on ``/v1/chat/completions``."""

RESPONSES_FIELDS: Mapping[str, Unsupported] = {
    "background": Unsupported((False,), "background responses are not supported; use the Batch API."),
    "conversation": Unsupported((), "conversations are not supported; continue with 'previous_response_id'."),
    "prompt": Unsupported((), "prompt templates are not supported; send 'instructions' and 'input'."),
    "max_tool_calls": Unsupported(
        (), "max_tool_calls is not supported; 'parallel_tool_calls': false allows one call."),
    "top_logprobs": Unsupported((0,), "log probabilities are not returned by the Responses API here; "
                                      "use /v1/chat/completions with 'logprobs'."),
    "include": Unsupported(([],), "no extra output ('include') is available from this server."),
    "truncation": Unsupported(("disabled",), "input is never truncated by this server."),
}
"""Refused on ``/v1/responses``."""

STREAM_OPTION_FIELDS: Mapping[str, Unsupported] = {
    "continuous_usage_stats": Unsupported(
        (False,), "usage is only sent in the final chunk ('include_usage')."),
}
"""Refused inside ``stream_options``."""


def first_unsupported(data: Mapping[str, Any], table: Mapping[str, Unsupported]) -> str | None:
    """The first field of `data` (a request's JSON object) that `table` refuses, or None."""
    for name, value in data.items():
        rule = table.get(name)
        if rule is not None and not rule.is_neutral(value):
            return name
    return None
