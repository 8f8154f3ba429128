"""The reference for benchmarks/lm_eval_check.py: loglikelihoods from a direct forward pass.

lm-evaluation-harness scores a (context, continuation) pair as the sum of the continuation tokens'
log-probabilities. Here that sum comes from the model itself, not through the HTTP route: one
forward pass of the whole sequence (``Gemma3.__call__`` on a fresh KV cache, the XLA reference
attention, float32, highest matmul precision), ``log_softmax`` of every position's logits, and the
log-probability of each next token.

The token ids are the ones lm-eval sends with ``tokenizer_backend=remote`` (read from lm-eval
0.4.13: ``TemplateLM._encode_pair``, ``TemplateAPI.tok_encode``, ``utils.get_rolling_token_windows``):

* Every text is encoded as xlaserve's ``POST /tokenize`` with ``add_special_tokens: false`` encodes
  it (the remote backend always sends that and ignores ``add_bos_token``): no BOS added, and
  special-token spellings in the text (``<bos>``) read as their ids (``encode_markup``).
* A context's trailing whitespace moves to the continuation; ``whole = encode(context +
  continuation)``, ``context_ids = encode(context)``, ``continuation_ids = whole[len(context_ids):]``.
* A perplexity (``loglikelihood_rolling``) text short enough for one window is scored after one
  prefix token, the BOS id (lm-eval derives it as the first id of ``/tokenize`` of
  ``/tokenizer_info``'s ``bos_token``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.kv_cache import KVCache

PAGE_SIZE = 16
LENGTH_BUCKET = 64  # sequences are padded to a multiple of this (one compiled program per bucket)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's ``_encode_pair`` splits them (causal models).

    Args:
      tok: the served tokenizer (``serving.contract.tokenizer_protocol.TextTokenizer``).
      context: non-empty conditioning text.
      continuation: the text scored.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    encode = getattr(tok, "encode_markup", tok.encode)  # as /tokenize reads special-token spellings
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


@dataclass(frozen=True)
class Score:
    """A continuation's score.

    Attributes:
      logprob: sum of the continuation tokens' log-probabilities (natural log).
      is_greedy: every continuation token is its position's argmax.
      max_gap: the largest ``max logprob - token logprob`` over the continuation (0 when greedy):
        how far the greediest miss is from a tie.
    """

    logprob: float
    is_greedy: bool
    max_gap: float


class ReferenceScorer:
    """Scores token sequences with a direct forward pass of ``model``.

    Args:
      model: a decoder with the ``Gemma3.__call__`` signature (float32 weights for the reference).
    """

    def __init__(self, model) -> None:
        self._graphdef, self._state = nnx.split(model)
        self._cfg = model.cfg
        self._forward = jax.jit(self._forward_impl)

    def _forward_impl(self, state, tokens: jax.Array, n: jax.Array):
        """tokens [T] int32 (T a multiple of PAGE_SIZE, ids past ``n`` padding) -> (log p(tokens[t+1])
        [T-1] float32 and max log p [T-1] float32 at positions t < T-1, argmax id [T] int32)."""
        model = nnx.merge(self._graphdef, state)
        T = tokens.shape[0]
        num_pages = T // PAGE_SIZE
        positions = jnp.arange(T, dtype=jnp.int32)
        # Page p of the sequence is cache page p + 1 (page 0 takes the padding tokens' K/V).
        slots = jnp.where(positions < n, positions + PAGE_SIZE, positions % PAGE_SIZE)
        md = AttentionMetadata(
            slot_mapping=slots, page_table=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None],
            kv_lens=n[None], cu_q_lens=jnp.stack([jnp.int32(0), n]), num_seqs=jnp.int32(1),
            mode="prefill")
        cache = KVCache.zeros(self._cfg, num_pages + 1, PAGE_SIZE, jnp.float32)
        logits, _ = model(tokens, positions, cache, md, positions)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        token_logp = jnp.take_along_axis(logp[:-1], tokens[1:, None], axis=-1)[:, 0]
        return token_logp, logp[:-1].max(axis=-1), jnp.argmax(logp, axis=-1).astype(jnp.int32)

    def _run(self, ids: list[int]):
        n = len(ids)
        T = (n // LENGTH_BUCKET + 1) * LENGTH_BUCKET  # room for the position after the last token
        tokens = np.zeros(T, np.int32)
        tokens[:n] = ids
        with jax.default_matmul_precision("highest"):
            out = self._forward(self._state, jnp.asarray(tokens), jnp.int32(n))
        return [np.asarray(a) for a in out]

    def next_token(self, ids: list[int]) -> int:
        """The greedy (argmax) next token after ``ids``."""
        return int(self._run(ids)[2][len(ids) - 1])

    def score(self, ids: list[int], ctxlen: int) -> Score:
        """The score of ``ids[ctxlen:]`` given ``ids[:ctxlen]``.

        Raises:
          ValueError: ``ctxlen`` is not in ``[1, len(ids))``.
        """
        n = len(ids)
        if not 1 <= ctxlen < n:
            raise ValueError(f"ctxlen {ctxlen} must be in [1, {n})")
        token_logp, max_logp, _ = self._run(ids)
        token_logp = np.asarray(token_logp, np.float64)[ctxlen - 1:n - 1]
        gaps = np.asarray(max_logp, np.float64)[ctxlen - 1:n - 1] - token_logp
        return Score(float(token_logp.sum()), bool((gaps <= 0).all()), float(max(gaps.max(), 0.0)))
