"""Reasoning ("thinking") text in a model's output, split off as it streams.

Qwen3 and the DeepSeek-R1 distills write their reasoning between ``<think>``
and ``</think>`` before the answer (Qwen3's chat template renders a past
turn as ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``; DeepSeek-R1's
template, and Qwen3's newer ones with thinking on, end the prompt with
``<think>\\n`` already open, so the output starts inside the reasoning).
:class:`ReasoningParser` splits the generated text into reasoning and content
(OpenAI-style ``reasoning_content``); :func:`count_reasoning_tokens` counts
the reasoning's tokens for usage; :func:`prompt_opens_reasoning` tells from a
rendered prompt whether its template left ``<think>`` open.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def _held_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Splits streamed output into reasoning and content.

    `start`, `end`: the markers. `starts_in_reasoning`: the prompt already
    opened the reasoning (see :func:`prompt_opens_reasoning`), so the output
    is reasoning until `end` (a repeated `start` at its very beginning is
    dropped). Otherwise the output is reasoning only if it begins, after
    whitespace, with `start`; any other output is all content, unchanged.

    The markers appear in neither part, and a marker split across deltas is
    found (text that may be the start of one is held back until known). The
    newlines the templates put around the reasoning are dropped: one newline
    right after `start`, one right before `end`, and the newlines right after
    `end` (Qwen3 emits ``</think>\\n\\n``). Reasoning cut off before `end`
    stays reasoning. A second `start` or `end` later on is content.

    Attributes: ``reasoning`` and ``content`` (str): all of each so far;
    ``ended`` (bool): the end marker was seen.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>",
                 starts_in_reasoning: bool = False):
        if not start or not end:
            raise ValueError("the reasoning markers must not be empty")
        self.start, self.end = start, end
        self.starts_in_reasoning = starts_in_reasoning
        self.reasoning = ""
        self.content = ""
        self.ended = False
        self._buf = ""
        self._state = "start"             # start, reasoning, content
        self._skip_newline = False        # drop a newline at the start of the buffer
        self._finished = False

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next generated text; returns (reasoning delta, content
        delta). Raises RuntimeError after :meth:`finish`."""
        if self._finished:
            raise RuntimeError("ReasoningParser.feed() after finish()")
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """End of generation: returns what was held back. Later calls return ("", "")."""
        if self._finished:
            return "", ""
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            if self._skip_newline and self._buf:
                if self._buf.startswith("\n"):
                    self._buf = self._buf[1:]
                    self._skip_newline = self._state == "content"   # all of them after `end`
                    continue
                self._skip_newline = False
            if self._state == "start":
                body = self._buf.lstrip()
                if body.startswith(self.start):
                    self._buf, self._state = body[len(self.start):], "reasoning"
                    self._skip_newline = True
                    continue
                if not final and self.start.startswith(body):   # "" or a prefix of `start`
                    break
                self._state = "reasoning" if self.starts_in_reasoning else "content"
                self._skip_newline = self.starts_in_reasoning
                continue
            if self._state == "content":
                if self._buf and not self._skip_newline:
                    content.append(self._buf)
                    self._buf = ""
                break
            i = self._buf.find(self.end)
            if i >= 0:
                reasoning.append(self._buf[:i].removesuffix("\n"))
                self._buf, self._state, self.ended = self._buf[i + len(self.end):], "content", True
                self._skip_newline = True
                continue
            # Hold back what may be the start of `end`, and a newline just before it.
            held = len(self._buf) if final else _held_suffix(self._buf, self.end)
            safe = len(self._buf) - held
            if not final and self._buf[:safe].endswith("\n"):
                safe -= 1
            reasoning.append(self._buf[:safe])
            self._buf = self._buf[safe:]
            if final:
                reasoning.append(self._buf)
                self._buf = ""
            break
        out = "".join(reasoning), "".join(content)
        self.reasoning += out[0]
        self.content += out[1]
        return out


def count_reasoning_tokens(token_ids: Iterable[int], start_id: int, end_id: int,
                           starts_in_reasoning: bool) -> int:
    """The number of generated ids strictly between the start marker's id
    and the end marker's id (markers excluded): from the first id when
    `starts_in_reasoning` (a `start_id` there is skipped too), else from after
    the first `start_id`; to the first `end_id` after that, or to the end of
    `token_ids` when it never comes. 0 if the reasoning never starts."""
    inside, count = starts_in_reasoning, 0
    for t in token_ids:
        if not inside:
            inside = t == start_id
        elif t == end_id:
            break
        elif t != start_id:
            count += 1
    return count


def prompt_opens_reasoning(prompt_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Whether the rendered prompt leaves the reasoning open: its last
    `start_id` comes after its last `end_id` (as when the chat template ends
    with ``<think>\\n``), so the output starts inside the reasoning. A prompt
    without `start_id` does not."""
    for t in reversed(prompt_ids):
        if t == start_id:
            return True
        if t == end_id:
            return False
    return False
