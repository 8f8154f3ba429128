"""Log probabilities of one choice, in OpenAI's response shapes, chunk by chunk.

The engine reports each generated token's :class:`TokenLogprobs` (and, for
``echo``, the prompt's) on its events; the output pipeline
(:class:`~serving.output.output_processor.TextGeneration`) keeps them in order in
``logprobs`` / ``prompt_logprobs``. A renderer here turns what arrived since
its last call into the next piece of the response: the whole response when
not streaming, one chunk's worth when streaming (so streamed pieces,
concatenated, equal the non-streamed response).

Every token the engine generated has an entry, a stop token included (its
text is not in the returned text): lm-evaluation-harness reads the entry of
the generated token after an echoed prompt. A stop string cuts the text, not
the entries: the token that completed it has one.

Values are the engine's float32 log-softmax of the raw logits, with anything
below -9999 (or not a number) reported as -9999.0, OpenAI's floor (JSON has
no -Infinity). Token spellings: ``token_text.py``.
"""

from __future__ import annotations

import math
from typing import Sequence

from serving.contract.engine_client import TokenLogprobs
from serving.gateway.openai.generation import EngineFailure
from serving.gateway.openai.token_text import TextOffsets, TokenTexts
from serving.gateway.schema.response_models import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from serving.output.output_processor import TextGeneration

LOGPROB_FLOOR = -9999.0
"""The smallest logprob reported (OpenAI's value for "very unlikely")."""


def logprob_value(x: float) -> float:
    """`x` as reported: at least :data:`LOGPROB_FLOOR`, never NaN or infinite."""
    x = float(x)
    return x if math.isfinite(x) and x >= LOGPROB_FLOOR else (0.0 if x == math.inf else LOGPROB_FLOOR)


def _new_entries(output: TextGeneration, sent: int) -> list[TokenLogprobs]:
    """The generated tokens' entries from `sent` on.

    Raises:
      EngineFailure: the engine sent fewer entries than tokens (it ignored ``logprobs``).
    """
    if len(output.logprobs) < len(output.token_ids):
        raise EngineFailure("The engine returned no log probabilities for the generated tokens.")
    return output.logprobs[sent:len(output.token_ids)]


class CompletionChoiceRenderer:
    """The text and ``logprobs`` pieces of one ``/v1/completions`` choice.

    Args:
      output: the choice's output pipeline.
      texts: token spellings for the model.
      echo_text: the prompt as returned with ``echo`` (None: no echo).
      prompt_ids: the prompt's token ids (for the echoed entries).
      prompt_source: the output pipeline that asked for the prompt's logprobs
        (the prompt's first choice; default `output`).
      logprobs: whether the client asked for ``logprobs``.
      as_ids: ``return_tokens_as_token_ids``.
    """

    def __init__(self, output: TextGeneration, texts: TokenTexts, *, echo_text: str | None,
                 prompt_ids: Sequence[int], logprobs: bool, as_ids: bool,
                 prompt_source: TextGeneration | None = None) -> None:
        self.output = output
        self.prompt_source = prompt_source or output
        self.texts = texts
        self.echo_text = echo_text
        self.prompt_ids = prompt_ids
        self.logprobs = logprobs
        self.as_ids = as_ids
        self._first = True
        self._sent = 0
        self._offsets = TextOffsets(len(echo_text) if echo_text is not None else 0)

    def piece(self, delta: str) -> tuple[str, CompletionLogprobs | None]:
        """(text, logprobs) to send next: `delta` (after the prompt, on the first
        piece, with ``echo``) and the entries of the tokens that arrived since."""
        text = delta
        out = CompletionLogprobs() if self.logprobs else None
        if self._first:
            self._first = False
            if self.echo_text is not None:
                text = self.echo_text + delta
                if out is not None:
                    self._add_prompt(out)
        if out is not None:
            entries = _new_entries(self.output, self._sent)
            self._sent += len(entries)
            for e in entries:
                self._add(out, e.token_id, e.logprob, e.top, self._offsets)
        return text, out

    def _add_prompt(self, out: CompletionLogprobs) -> None:
        prompt = self.prompt_source.prompt_logprobs
        if prompt is None or len(prompt) != len(self.prompt_ids):
            raise EngineFailure("The engine returned no log probabilities for the prompt.")
        offsets = TextOffsets(0)
        for tid, e in zip(self.prompt_ids, prompt):
            if e is None:
                out.tokens.append(self.texts.text(tid, self.as_ids))
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.text_offset.append(offsets.next(self.texts.token_bytes(tid)))
            else:
                self._add(out, tid, e.logprob, e.top, offsets)

    def _add(self, out: CompletionLogprobs, tid: int, logprob: float,
             top: Sequence[tuple[int, float]], offsets: TextOffsets) -> None:
        out.tokens.append(self.texts.text(tid, self.as_ids))
        out.token_logprobs.append(logprob_value(logprob))
        # Different ids can share a spelling (byte pieces, ...): a key keeps its most likely
        # token's logprob, so `token_logprob == max(values)` (lm-eval's is_greedy) still
        # means the token is the argmax.
        alternatives: dict[str, float] = {}
        for t, lp in [*top, (tid, logprob)]:
            key, value = self.texts.text(t, self.as_ids), logprob_value(lp)
            alternatives[key] = max(value, alternatives.get(key, value))
        out.top_logprobs.append(alternatives)
        out.text_offset.append(offsets.next(self.texts.token_bytes(tid)))


class ChatChoiceRenderer:
    """The ``logprobs`` pieces of one chat choice (``content`` entries since the last call).

    Args:
      output: the choice's output pipeline.
      texts: token spellings for the model.
      top_logprobs: alternatives per token (0: none).
      as_ids: ``return_tokens_as_token_ids``.
    """

    def __init__(self, output: TextGeneration, texts: TokenTexts, *, top_logprobs: int,
                 as_ids: bool) -> None:
        self.output = output
        self.texts = texts
        self.top_logprobs = top_logprobs
        self.as_ids = as_ids
        self._sent = 0

    def _top(self, tid: int, logprob: float) -> TopLogprob:
        data = self.texts.token_bytes(tid)
        return TopLogprob(token=self.texts.text(tid, self.as_ids), logprob=logprob_value(logprob),
                          bytes=None if data is None else list(data))

    def piece(self) -> ChatLogprobs:
        """The entries of the tokens that arrived since the last call."""
        entries = _new_entries(self.output, self._sent)
        self._sent += len(entries)
        content = []
        for e in entries:
            head = self._top(e.token_id, e.logprob)
            alts = [self._top(t, lp) for t, lp in e.top[:self.top_logprobs]]
            content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=alts))
        return ChatLogprobs(content=content)
