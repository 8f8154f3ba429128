"""Speculative sampling's acceptance rule for drafts drawn from a draft model's distribution.

The rule of Leviathan, Kalman, Matias ("Fast Inference from Transformers via Speculative
Decoding", 2023, Algorithm 1) and Chen et al. ("Accelerating Large Language Model Decoding
with Speculative Sampling", 2023, Algorithm 2); the code is our own. With ``p`` the served
model's sampling distribution at a position and ``q`` the draft's, a draft ``x ~ q`` is
accepted with probability ``min(1, p(x) / q(x))``; the first rejected one is replaced by a
sample of the residual ``norm(max(0, p - q))``, and when every draft is accepted the next
token is sampled from ``p`` as plain decoding samples it. The emitted tokens are then
distributed exactly as plain sampling's (tests/serving/core/test_speculative_draft.py checks
it with a chi-square test), though seeded outputs differ from plain decoding's: the draft's,
the acceptance's and the residual's random numbers are their own streams of the row's
``(seed, position)`` key (``fold_in`` with :data:`DRAFT_STREAM`, :data:`ACCEPT_STREAM`,
:data:`RESIDUAL_STREAM`), independent of each other and of plain sampling's.

Greedy rows (temperature 0) keep the exact rule (a draft is accepted when it equals the argmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.engine.sample.sampling import SamplingArrays, argmax_rows, row_keys, sampling_logits

DRAFT_STREAM = 0x0D5A
ACCEPT_STREAM = 0x0ACC
RESIDUAL_STREAM = 0x0E51


def stream_keys(seed: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """[R] keys of one of a row's extra random streams at ``positions`` [R] (see the module
    docstring)."""
    return jax.vmap(lambda k: jax.random.fold_in(k, stream))(row_keys(seed, positions))


def _gumbel(keys: jax.Array, vocab: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def draft_sample(logits: jax.Array, positions: jax.Array, s: SamplingArrays,
                 argmax_block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """A draft model's token and distribution per row.

    Args:
      logits: [R, V] float32 the draft's logits.
      positions: [R] int32 the position the drafted token will occupy (keys its stream).
      s: the rows' sampling settings (the served request's; logit processors are not applied:
        ``q`` is whatever distribution the draft is drawn from).

    Returns:
      (tokens [R] int32, q [R, V] float32): a temperature row's draft ``x ~ q`` with ``q`` the
      softmax of :func:`~serving.engine.sample.sampling.sampling_logits`; a greedy row's argmax
      (its ``q`` unused).
    """
    greedy = argmax_rows(logits, argmax_block)

    def sampled(_):
        scaled = sampling_logits(logits, s)
        drawn = argmax_rows(scaled + _gumbel(stream_keys(s.seed, positions, DRAFT_STREAM), logits.shape[-1]),
                            argmax_block)
        return jnp.where(s.temperature > 0, drawn, greedy), jax.nn.softmax(scaled, axis=-1)

    return jax.lax.cond(jnp.any(s.temperature > 0), sampled,
                        lambda _: (greedy, jnp.zeros(logits.shape, jnp.float32)), None)


def accept_and_residual(p: jax.Array, q: jax.Array, x: jax.Array, accept_keys: jax.Array,
                        residual_keys: jax.Array, argmax_block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The acceptance test of draft ``x`` and the residual sample, per row.

    Args:
      p: [R, V] float32 the served model's sampling distribution (rows sum to 1).
      q: [R, V] float32 the draft's distribution ``x`` was drawn from.
      x: [R] int32 the drafts.
      accept_keys, residual_keys: [R] PRNG keys of the two streams.

    Returns:
      (accept [R] bool: ``u < p(x) / q(x)`` for ``u ~ U[0, 1)``, residual [R] int32: a sample
      of ``norm(max(0, p - q))``; where that is all zero (p = q: never rejected) the argmax of p).
    """
    rows = jnp.arange(x.shape[0])
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(accept_keys)
    accept = u * q[rows, x] < p[rows, x]
    diff = jnp.maximum(p - q, 0.0)
    logd = jnp.where(diff > 0, jnp.log(jnp.where(diff > 0, diff, 1.0)), -jnp.inf)
    drawn = argmax_rows(logd + _gumbel(residual_keys, p.shape[-1]), argmax_block)
    residual = jnp.where(jnp.any(diff > 0, axis=-1), drawn, argmax_rows(p, argmax_block))
    return accept, residual
