"""The engine loop's side of structured output: a request's matcher at submit, a step's
token bitmask before dispatch.

The grammars, matchers and masks themselves are ``serving.core.structured_output``'s
(llguidance); it is imported only here and only once a request is constrained,
so an engine without llguidance still runs unconstrained requests.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from serving.contract.engine_client import EngineRequest, RequestRejectedError
from serving.contract.tokenizer_protocol import TextTokenizer


def request_matcher(tokenizer: TextTokenizer | None, request: EngineRequest):
    """The request's llguidance matcher (None: unconstrained); compiled grammars are cached
    per tokenizer.

    Raises:
      RequestRejectedError: the constraint does not compile, or there is no tokenizer.
    """
    so = request.sampling.structured_output
    if so is None:
        return None
    if tokenizer is None:
        raise RequestRejectedError("structured output needs the engine's tokenizer")
    from serving.core.structured_output import StructuredOutputError, grammars_for

    try:
        return grammars_for(tokenizer).matcher(so)
    except StructuredOutputError as e:
        raise RequestRejectedError(f"invalid structured output ({so.kind}): {e}") from None


def step_mask(tokenizer: TextTokenizer, vocab_size: int, seqs: Sequence, samples: Sequence[bool],
              failed: list) -> np.ndarray | None:
    """The structured-output bitmask of a step's rows.

    Args:
      seqs: the rows' sequences (``.matcher``, ``.armed_by``), one per row.
      samples: whether each row samples a token this step.
      failed: (seq, message) is appended for each matcher in error (its row is left
        unconstrained: all ones).

    Returns:
      [rows, ceil(vocab_size / 32)] int32, or None when no sampling row is constrained.
    """
    matchers = [(seq.matcher, i) for i, (seq, s) in enumerate(zip(seqs, samples))
                if s and seq.matcher is not None and seq.armed_by is None]
    if not matchers:
        return None
    from serving.core.structured_output import grammars_for

    mask = grammars_for(tokenizer).fill(matchers, len(seqs), vocab_size)
    for m, i in matchers:
        if m.is_error():
            failed.append((seqs[i], f"structured output failed: {m.get_error()}"))
            mask[i] = -1
    return mask
