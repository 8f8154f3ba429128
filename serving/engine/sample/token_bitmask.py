"""Structured output on device: a token bitmask applied to the logits inside the jitted sampler.

The host (``serving.core.structured_output``) fills one ``[R, W] int32`` row per
batch row, ``W = ceil(vocab / 32)``: bit ``t % 32`` of word ``t // 32`` set
means token ``t`` may be sampled (llguidance's layout, as vLLM v1's and
tpu-inference's). An unconstrained row is all ones (-1), and a greedy batch
with no constrained row skips the expansion (``lax.cond``,
:func:`argmax_allowed`); in a sampling branch the select fuses into the
temperature division. The shape is the batch's, fixed per bucket, so a
constrained request compiles nothing new.

No mask at all (None, ``SamplingArrays``' default) is dropped at trace time;
the engine always passes one, so its programs do not depend on constraints.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=64)
@functools.lru_cache(maxsize=64)
def unconstrained(rows: int, words: int) -> np.ndarray:
    """A read-only all-ones ``[rows, words] int32`` mask (no row constrained), shared: one
    per shape, not a new array every step."""
    mask = np.full((rows, words), -1, np.int32)
    mask.flags.writeable = False
    return mask


def pad_rows(mask: np.ndarray | None, rows: int, words: int) -> np.ndarray:
    """`mask` ([n, words] int32, n <= rows, or None: none constrained) padded to
    `rows` with unconstrained rows."""
    if mask is None:
        return unconstrained(rows, words)
    n = mask.shape[0]
    if n > rows or mask.shape[1] != words:
        raise ValueError(f"a token mask of shape {mask.shape} does not fit [{rows}, {words}]")
    if n == rows:
        return np.ascontiguousarray(mask, np.int32)
    out = np.full((rows, words), -1, np.int32)
    out[:n] = mask
    return out


def apply_token_bitmask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Logits with the tokens a row's mask forbids set to -inf (an elementwise select that
    XLA fuses into the consumer, e.g. the temperature division).

    Args:
      logits: [R, V] float32.
      mask: [R, ceil(V / 32)] int32, bit t % 32 of word t // 32 allows token t;
        -1 (all bits) leaves the row untouched, bit for bit. None: no mask.

    Returns:
      [R, V] float32.

    Raises:
      ValueError: the mask's width does not match V (at trace time).
    """
    if mask is None:
        return logits
    rows, vocab = logits.shape
    words = mask.shape[-1]
    if words != mask_words(vocab):
        raise ValueError(f"a token mask of {words} words does not fit a vocabulary of {vocab}")
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, words * 32)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def argmax_allowed(logits: jax.Array, mask: jax.Array | None,
                   argmax: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``argmax(apply_token_bitmask(logits, mask))``: each row's best allowed token.

    When no row is constrained the mask is skipped (``lax.cond``). The branch
    returns only the [R] ids, not masked [R, V] logits: a conditional that
    returned the logits costs a copy of them even when nothing is masked (on
    XLA:CPU, greedy [8, 262144]: 9 ms against 1 ms without a mask; this form
    1 ms; benchmarks/RESULTS.md, issue 13).

    Args:
      logits: [R, V] float32.
      mask: see :func:`apply_token_bitmask`.
      argmax: [R, V] -> [R] int32 (the backend policy's argmax).

    Returns:
      [R] int32.
    """
    if mask is None:
        return argmax(logits)
    return jax.lax.cond(jnp.any(mask != -1), lambda _: argmax(apply_token_bitmask(logits, mask)),
                        lambda _: argmax(logits), None)
