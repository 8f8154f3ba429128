"""Content policy hooks: an input check before generation, an output filter while streaming.

An **input policy** sees the prompt text (a completion's prompt, or each chat
message's content) and may reject the request: 400 with code
``content_policy_violation``. An **output policy** sees the generated text and
may stop the stream: the response ends with finish_reason "content_filter"
and the offending text is never sent. Both outcomes are metered and traced.

The built-in :class:`BlocklistPolicy` matches whole words or phrases,
case-insensitively. Its output filter holds back the last few characters of
the text (as stop strings do), so a blocked phrase split across tokens is
caught before any of it reaches the client. Custom policies implement
:class:`InputPolicy` / :class:`OutputPolicy` and are named in the server
config as ``module:factory``. An output filter is the output pipeline's
:class:`~serving.output.output_processor.OutputFilter` (``feed``/``flush``).
"""

from __future__ import annotations

import importlib
import re
from typing import Protocol, Sequence

from serving.output.output_processor import OutputFilter


class PolicyViolation(Exception):
    """Raised by an input policy to reject a request.

    Attributes:
      policy: the policy's name.
    """

    def __init__(self, policy: str, message: str) -> None:
        super().__init__(message)
        self.policy = policy


class InputPolicy(Protocol):
    name: str

    def check_input(self, texts: Sequence[str]) -> None:
        """Raises PolicyViolation to reject the request."""


class OutputPolicy(Protocol):
    name: str

    def output_filter(self) -> OutputFilter:
        """A fresh filter for one request."""


class BlocklistPolicy:
    """Rejects prompts and stops completions that contain a blocked word or phrase.

    Args:
      phrases: words or phrases, matched case-insensitively on word boundaries.
      check_input, check_output: where it applies.

    Raises:
      ValueError: an empty phrase.
    """

    name = "blocklist"

    def __init__(self, phrases: Sequence[str], check_input: bool = True, check_output: bool = True):
        phrases = [p.strip() for p in phrases]
        if any(not p for p in phrases):
            raise ValueError("blocklist phrases must not be empty")
        self.phrases = phrases
        self.applies_to_input = check_input
        self.applies_to_output = check_output
        self.max_len = max((len(p) for p in phrases), default=0)
        self._re = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in phrases) + r")\b",
                              re.IGNORECASE) if phrases else None

    def check_input(self, texts: Sequence[str]) -> None:
        if not (self._re and self.applies_to_input):
            return
        for text in texts:
            if self._re.search(text):
                raise PolicyViolation(self.name, "The request was rejected by the content policy "
                                      "(blocklist).")

    def output_filter(self) -> OutputFilter:
        return _BlocklistFilter(self._re if self.applies_to_output else None, self.max_len)


class _BlocklistFilter:
    """Holds back ``max_len`` characters; a match is decided once the character
    after it is known (or at the end), so word boundaries are exact."""

    def __init__(self, pattern: re.Pattern | None, max_len: int) -> None:
        self.pattern = pattern
        self.hold = max_len
        self.text = ""
        self.sent = 0

    def _scan(self, final: bool) -> tuple[str, bool]:
        start = max(0, self.sent - 1)  # one character of context for \b
        for m in self.pattern.finditer(self.text, start):
            if m.start() >= self.sent and (final or m.end() < len(self.text)):
                out = self.text[self.sent:m.start()]
                self.sent = len(self.text)
                return out, True
        safe = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:safe]
        self.sent = safe
        return out, False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.pattern is None:
            return text, False
        self.text += text
        return self._scan(final=False)

    def flush(self) -> tuple[str, bool]:
        if self.pattern is None:
            return "", False
        return self._scan(final=True)


class _Chain:
    """Runs several output filters in sequence."""

    def __init__(self, filters: Sequence[OutputFilter]) -> None:
        self.filters = list(filters)

    def feed(self, text: str) -> tuple[str, bool]:
        for f in self.filters:
            text, stop = f.feed(text)
            if stop:
                return text, True
        return text, False

    def flush(self) -> tuple[str, bool]:
        """Each filter gets what the previous one released at the end, then flushes."""
        text = ""
        for f in self.filters:
            out, stop = f.feed(text) if text else ("", False)
            if not stop:
                rest, stop = f.flush()
                out += rest
            text = out
            if stop:
                return text, True
        return text, False


class Policies:
    """The configured input and output policies."""

    def __init__(self, input_policies: Sequence[InputPolicy] = (),
                 output_policies: Sequence[OutputPolicy] = ()) -> None:
        self.input_policies = list(input_policies)
        self.output_policies = list(output_policies)

    def check_input(self, texts: Sequence[str]) -> None:
        """Raises PolicyViolation from the first policy that rejects."""
        for p in self.input_policies:
            p.check_input(texts)

    def output_filter(self) -> OutputFilter | None:
        """A filter chain for one request, or None when no output policy is configured."""
        if not self.output_policies:
            return None
        return _Chain([p.output_filter() for p in self.output_policies])

    @classmethod
    def from_config(cls, blocklist: Sequence[str] = (), blocklist_applies_to: Sequence[str] = ("input", "output"),
                    plugins: Sequence[str] = ()) -> "Policies":
        """Builds the policies from server settings.

        Args:
          blocklist: phrases for the built-in blocklist (empty: none).
          blocklist_applies_to: "input" and/or "output".
          plugins: "module:factory" names; each factory returns an object with
            ``check_input`` and/or ``output_filter``.

        Raises:
          ValueError: a bad applies_to value or a plugin that cannot be loaded.
        """
        bad = set(blocklist_applies_to) - {"input", "output"}
        if bad:
            raise ValueError(f"policy_blocklist_applies_to must name input and/or output, got {sorted(bad)}")
        ins: list = []
        outs: list = []
        if blocklist:
            b = BlocklistPolicy(blocklist, "input" in blocklist_applies_to, "output" in blocklist_applies_to)
            ins.append(b)
            outs.append(b)
        for spec in plugins:
            mod, _, attr = spec.partition(":")
            try:
                obj = getattr(importlib.import_module(mod), attr)()
            except (ImportError, AttributeError, TypeError) as e:
                raise ValueError(f"cannot load policy plugin {spec!r}: {e}") from None
            if hasattr(obj, "check_input"):
                ins.append(obj)
            if hasattr(obj, "output_filter"):
                outs.append(obj)
        return cls(ins, outs)
