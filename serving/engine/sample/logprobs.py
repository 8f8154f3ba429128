"""Log probabilities on device: of the sampled tokens, and of every prompt token (echo).

Both are taken from the float32 log-softmax of the *raw* logits (before logit
bias, penalties, temperature and the rest), as the contract of
``serving.contract.engine_client.SamplingParams`` says and as vLLM returns them by
default: ``logprob(t) = logit(t) - logsumexp(logits)``. Only fixed-width
results leave the device (never a vocabulary-wide row): per row the token's
log probability and the ``MAX_LOGPROBS`` most likely (id, log probability)
pairs, most likely first (``jax.lax.top_k``: equal logits by lower id); the
engine loop cuts them to the k each request asked for.

``jax.lax.top_k`` over 262144 entries measured 15-18 ms for 8 to 32 rows on
the 2-core CPU build machine (2026-12-01), against ~110 ms for a blocked
two-pass top-k and ~30 passes for a bisection threshold (as sampling's top-k
uses), so it is the form used; it runs only when a row of the batch asks
(``lax.cond``), and top-k only when a row asks for k > 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from serving.contract.engine_client import MAX_LOGPROBS, TokenLogprobs

PROMPT_BLOCK = 16
"""Prompt tokens whose log-softmax and top-k are computed together (bounds the
temporaries of :func:`prompt_logprobs` to ``PROMPT_BLOCK * V`` floats)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step returns per row (device arrays; the host reads only what was asked).

    Attributes:
      tokens: [R] int32 the sampled tokens.
      logprob: [R] float32 each sampled token's log probability (0 where no row asked).
      top_ids: [R, MAX_LOGPROBS] int32 the most likely tokens, most likely first.
      top_logprobs: [R, MAX_LOGPROBS] float32 their log probabilities.
    """

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per prompt token of a prefill step: the log probability of the token that follows it.

    Attributes:
      logprob: [T] float32 log probability of ``next_ids[t]`` given tokens up to t
        (0 where next_ids[t] is -1).
      top_ids: [T, MAX_LOGPROBS] int32 the most likely next tokens, most likely first.
      top_logprobs: [T, MAX_LOGPROBS] float32 their log probabilities.
    """

    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _top(logits: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    values, ids = jax.lax.top_k(logits, MAX_LOGPROBS)
    return ids.astype(jnp.int32), values - lse[:, None]


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: jax.Array | None) -> StepOutput:
    """The step output for sampled ``tokens``, with log probabilities where asked.

    Args:
      logits: [R, V] float32 raw logits.
      tokens: [R] int32 the sampled tokens.
      num_logprobs: [R] int32 alternatives wanted per row, -1 = none (None: no row).

    Returns:
      a :class:`StepOutput`; its log-probability fields are zeros when no row asked.
    """
    rows = logits.shape[0]
    zeros = (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
             jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))
    if num_logprobs is None:
        return StepOutput(tokens, *zeros)

    def compute(x):
        lse = jax.nn.logsumexp(x, axis=-1)
        lp = jnp.take_along_axis(x, tokens[:, None], axis=1)[:, 0] - lse
        ids, top_lp = jax.lax.cond(jnp.any(num_logprobs > 0), lambda: _top(x, lse), lambda: zeros[1:])
        return lp, ids, top_lp

    lp, ids, top_lp = jax.lax.cond(jnp.any(num_logprobs >= 0), compute, lambda x: zeros, logits)
    return StepOutput(tokens, lp, ids, top_lp)


def prompt_logprobs(logits: jax.Array, next_ids: jax.Array) -> PromptLogprobs:
    """Log probabilities of each prompt token's successor, in blocks of ``PROMPT_BLOCK`` tokens.

    Args:
      logits: [T, V] float32 raw logits at every token of a prefill step (T a
        multiple of PROMPT_BLOCK: the token buckets are powers of two >= 16).
      next_ids: [T] int32 the token that follows each one in its prompt; -1 where
        none is known here (the prompt's last token, generated tokens, padding).

    Returns:
      :class:`PromptLogprobs` for the T tokens.
    """
    T, V = logits.shape
    blocks = logits.reshape(T // PROMPT_BLOCK, PROMPT_BLOCK, V)
    nxt = next_ids.reshape(T // PROMPT_BLOCK, PROMPT_BLOCK)

    def one(args):
        x, n = args
        lse = jax.nn.logsumexp(x, axis=-1)
        lp = jnp.take_along_axis(x, jnp.maximum(n, 0)[:, None], axis=1)[:, 0] - lse
        ids, top_lp = _top(x, lse)
        return jnp.where(n >= 0, lp, 0.0), ids, top_lp

    lp, ids, top_lp = jax.lax.map(one, (blocks, nxt))
    return PromptLogprobs(lp.reshape(T), ids.reshape(T, MAX_LOGPROBS), top_lp.reshape(T, MAX_LOGPROBS))


class HostLogprobs:
    """A step's log-probability arrays read back to the host (only when a row asked).

    Args:
      out: a :class:`StepOutput` or :class:`PromptLogprobs`: ``logprob [rows] f32``,
        ``top_ids [rows, MAX_LOGPROBS] i32``, ``top_logprobs [rows, MAX_LOGPROBS] f32``.
    """

    def __init__(self, out: StepOutput | PromptLogprobs):
        self.logprob = np.asarray(out.logprob)
        self.top_ids = np.asarray(out.top_ids)
        self.top_logprobs = np.asarray(out.top_logprobs)

    def entry(self, i: int, token: int, k: int) -> TokenLogprobs:
        """Row i's entry for ``token`` with its k most likely alternatives."""
        top = tuple(zip(self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()))
        return TokenLogprobs(token, float(self.logprob[i]), top)
