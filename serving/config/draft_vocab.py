"""A self draft's draft vocabulary (``--draft-vocab N``): the N token ids its head computes logits
over (``serving.engine.draft_model.head_slice``), as EAGLE-3 heads draft over a smaller
vocabulary than their target's.

Which ids: for a tokenizer with an entry in ``configs/draft_vocab.yaml`` (Gemma 3's), its
``frequent_ids`` first (the ids most frequent in a corpus, measured by
``python -m benchmarks.draft_vocab``), then the lowest ids not yet taken; for any other
vocabulary, the first N ids (SentencePiece and BPE vocabularies put frequent pieces first).
Gemma 3 needs the entry: its single characters (".", ",", digits, quotes, brackets) sit at ids
236000-237600 of 262144. Coverage at N = 32768 (benchmarks/RESULTS.md, issue 46): 94% of the
tokens of English prose prompts, 98% of the golden prompts' English greedy continuations.
"""

from __future__ import annotations

import functools

import numpy as np

from serving.config.config_files import read_config


@functools.cache
def _entries() -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    return tuple((name, int(e["vocab_size"]), tuple(int(i) for i in e["frequent_ids"]))
                 for name, e in read_config("draft_vocab.yaml").items())


def frequent_ids(architecture: str, vocab_size: int) -> tuple[int, ...]:
    """The ids ``configs/draft_vocab.yaml`` ranks first for a model of this architecture and
    vocabulary size (its tokenizer's entry), most frequent first; () for any other model."""
    for name, size, ids in _entries():
        if name == architecture and size == vocab_size:
            return ids
    return ()


def draft_ids(vocab_size: int, n: int, frequent: tuple[int, ...] | list[int] = ()) -> np.ndarray:
    """The draft vocabulary: [n] int32 ascending token ids, ``frequent``'s first ``n`` (those
    below ``vocab_size``), then the lowest ids not among them.

    Raises:
      ValueError: ``n`` not in 1..vocab_size.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"a draft vocabulary of {n} ids: the model has {vocab_size}")
    taken = np.zeros(vocab_size, bool)
    first = [i for i in frequent if 0 <= i < vocab_size][:n]
    taken[first] = True
    rest = np.flatnonzero(~taken)[:n - int(taken.sum())]
    taken[rest] = True
    return np.flatnonzero(taken).astype(np.int32)
