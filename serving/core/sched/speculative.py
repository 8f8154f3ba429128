"""Speculative decoding with n-gram (prompt-lookup) drafts: the proposer and the acceptance rule
(the settings: ``serving.config.speculative_config``).

No draft model: a request's own tokens (prompt + output) propose what comes
next. If the last ``n`` tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) occurred earlier in the sequence, the up to ``K``
tokens that followed that earlier occurrence (the most recent one) are the
drafts. This is prompt-lookup decoding (A. Saxena, "Prompt Lookup Decoding",
2023, github.com/apoorvumang/prompt-lookup-decoding) as vLLM's ``ngram``
method configures it (``prompt_lookup_min`` / ``prompt_lookup_max``); the
code here is our own.

A speculating row feeds ``[last token, draft_1 .. draft_d]`` at consecutive
positions through one *verify* step (``serving.engine.verify_step``) that computes
logits at each of them and samples at each exactly as a plain decode step
would at that position: the same logit processors, the same ``(seed,
position)`` random key (``serving.engine.sample.sampling``). The acceptance rule::

    sampled_j = the token sampled after input j (j = 0..d)
    accepted  = the number of leading j with draft_{j+1} == sampled_j
    emitted   = sampled_0 .. sampled_accepted        (accepted + 1 tokens)

so every emitted token is the one plain decoding would have produced at its
position given the same preceding tokens: greedy and seeded outputs are
identical with and without speculation whenever the logits are equal (float32
up to near-ties; bfloat16 where batch invariance holds, ``serving.engine.backend_policy``).
A draft token is only a guess of the input; the sample never depends on it
except through the tokens before it, which were accepted.

Which rows may speculate (:func:`may_speculate`): rows without penalties
(their device token counts advance one token per decode step), without an
unmet ``min_tokens`` (its suppression is decided per step on the host), and
without structured output (the mask of each position needs the matcher to
have consumed the tokens before it); such rows decode as before, in the same
turn. ``n > 1`` families, logit bias, log probabilities, temperature, top-k,
top-p and min-p all speculate.

No JAX here: the scheduler (host-only) proposes the drafts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from serving.core.sched.step_plan import SamplingSettings


def propose_ngram(tokens: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Draft tokens for a sequence from its own earlier n-grams (prompt lookup).

    For n from ``max_n`` down to ``min_n``: if the last n tokens also occur
    earlier, the up to ``num_tokens`` tokens after their most recent earlier
    occurrence are returned (a match whose continuation runs into the suffix
    itself continues into it, so a repeating run proposes its own period).

    Args:
      tokens: the sequence's known token ids (prompt + output), oldest first.
      num_tokens: the most drafts to return (>= 0).
      min_n, max_n: the n-gram sizes tried (1 <= min_n <= max_n).

    Returns:
      0..num_tokens draft ids (empty: no n-gram matched).
    """
    L = len(tokens)
    if num_tokens <= 0 or L < min_n + 1:
        return ()
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = arr[L - n:]
        # Start i of an earlier occurrence: arr[i:i + n] == suffix with i + n <= L - 1.
        starts = np.nonzero(arr[:L - n] == suffix[0])[0]
        for j in range(1, n):
            starts = starts[arr[starts + j] == suffix[j]]
        if starts.size:
            i = int(starts[-1])  # the most recent occurrence
            out = [int(t) for t in arr[i + n:i + n + num_tokens]]
            while len(out) < num_tokens:  # the continuation reached the end: it repeats
                out.append(out[i + n + len(out) - L])
            return tuple(out)
    return ()


def may_speculate(s: SamplingSettings, num_generated: int) -> bool:
    """Whether a decode row with settings ``s`` that generated ``num_generated`` tokens may
    be verified with drafts (see the module docstring)."""
    return not s.uses_penalties and not (s.suppress_ids and num_generated < s.min_tokens)


def accepted_count(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """The acceptance rule (host reference of the device's): leading drafts equal to the
    tokens sampled before them.

    Args:
      sampled: the tokens sampled after each input, len(drafts) + 1 of them.
      drafts: the draft tokens, draft j fed after sampled j - 1.

    Returns:
      a in 0..len(drafts): sampled[:a + 1] are emitted.
    """
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a
