"""Ways a model's output text arrives as stream deltas, for the tool-call and reasoning parser
tests."""

from __future__ import annotations

import re

_PIECE = re.compile(r"<\|\w+\|>| ?[A-Za-z]{1,5}|\d{1,3}| ?[^\w\s]{1,2}|\s+|.", re.S)


def tokens(text: str) -> list[str]:
    """`text` cut into subword-like pieces: words in pieces of up to five
    letters with their leading space, punctuation in pairs, special tokens whole."""
    pieces = _PIECE.findall(text)
    assert "".join(pieces) == text
    return pieces


CHUNKINGS = {
    "1 token": lambda text: tokens(text),
    "3 tokens": lambda text: ["".join(tokens(text)[i:i + 3]) for i in range(0, len(tokens(text)), 3)],
    "all at once": lambda text: [text],
    "characters": lambda text: list(text),
}
