"""A request's prompt to token ids, off the event loop.

Tokenizing a prompt (``encode``), rendering a chat template and decoding a
token-id prompt (for the input policies) cost time that grows with the
prompt: about 20-50 ms of SentencePiece per 100k characters, seconds for
megabytes. On the event loop that time would freeze every other client's
stream, so :class:`PromptWorkers` runs it in worker threads:
``anyio.to_thread.run_sync`` with a ``CapacityLimiter`` of its own (at most
``threads`` prompts at once; further ones wait for a thread, without holding
the event loop). Every call is offloaded, small ones too: the hop costs about
0.15 ms of latency per request (a 25-character prompt encodes in 0.01 ms
inline), little next to a request, and the event loop itself does only the
hand-over.

Thread safety: SentencePiece's encode and decode are const C++ methods that
release the GIL, and ``model.tokenizer.Tokenizer`` and the chat template
(``model/chat_template.py``) keep no mutable state after construction, so
one tokenizer serves all threads at once; so does
``model.bpe_tokenizer.BPETokenizer`` (see its docstring).

The prompt's length in characters (``max_prompt_chars``) is checked here
before any tokenization.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import anyio

from serving.contract.tokenizer_protocol import TextTokenizer
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import DEFAULT_TOKENIZER_THREADS

T = TypeVar("T")

PROMPT_TOO_LONG = "string_above_max_length"
"""The error ``code`` of a prompt over ``max_prompt_chars`` (OpenAI's code for a too-long string)."""


def check_prompt_chars(chars: int, limit: int | None, param: str, what: str) -> None:
    """Refuses a prompt of `chars` characters over `limit` (None: no limit).

    Args:
      param: the request field ("prompt" or "messages").
      what: how the message names the length, e.g. "'prompt' is" or
        "the contents of 'messages' total".

    Raises:
      OpenAIError: 400 ``string_above_max_length`` naming `param`, `chars` and `limit`.
    """
    if limit is not None and chars > limit:
        raise OpenAIError(
            f"{what} {chars} characters; this server accepts at most {limit} "
            f"(its max_prompt_chars). Shorten the prompt.",
            param=param, code=PROMPT_TOO_LONG)


def _checked_ids(tok: TextTokenizer, prompt: Sequence[int], decode: bool) -> tuple[list[int], list[str]]:
    """A token-id prompt's ids checked against the vocabulary, and its text when `decode`."""
    ids = list(prompt)
    vocab = tok.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(f"Token id {bad} in 'prompt' is outside the vocabulary [0, {vocab}).",
                          param="prompt")
    return ids, [tok.decode(ids)] if decode else []


class PromptWorkers:
    """Prompt length checks, then tokenization in worker threads (see the module docstring).

    Args:
      max_prompt_chars: the longest prompt in characters; None: no limit.
      threads: how many prompts may be tokenized at once (>= 1).
    """

    def __init__(self, max_prompt_chars: int | None = None, threads: int = DEFAULT_TOKENIZER_THREADS) -> None:
        self.max_prompt_chars = max_prompt_chars
        self.limiter = anyio.CapacityLimiter(threads)

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread; returns or raises what it does."""
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs),
                                              limiter=self.limiter)

    async def completion(self, tok: TextTokenizer, prompt: str | list[int],
                         decode: bool) -> tuple[list[int], list[str]]:
        """A completion's prompt ids (BOS added to text) and its text for the input policies.

        Args:
          prompt: text, or token ids used as they are.
          decode: whether to decode a token-id prompt to text (only input
            policies need it); text prompts are returned as they are.

        Returns:
          (prompt ids, [prompt text] or [] for token ids without `decode`).

        Raises:
          OpenAIError: 400 for a prompt over ``max_prompt_chars`` or a token
            id outside the vocabulary.
        """
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), self.max_prompt_chars, "prompt", "'prompt' is")
            return await self.run(tok.encode, prompt, add_bos=True), [prompt]
        return await self.run(_checked_ids, tok, prompt, decode)

    async def chat(self, tok: TextTokenizer, messages: Sequence[dict],
                   tools: Sequence[dict] | None = None) -> list[int]:
        """The chat template's ids for `messages` (``[{"role", "content", ...}]``,
        content text) and `tools` (None: no tools; passed only when given).

        Raises:
          OpenAIError: 400 when the contents total more than ``max_prompt_chars``.
          ValueError: messages (or tools) the chat template rejects.
        """
        chars = sum(len(m["content"]) if isinstance(m["content"], str)
                    else sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
        check_prompt_chars(chars, self.max_prompt_chars, "messages", "The contents of 'messages' total")
        if tools is None:
            return list(await self.run(tok.apply_chat_template, messages))
        return list(await self.run(tok.apply_chat_template, messages, tools=tools))
