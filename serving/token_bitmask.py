"""Structured output on device: a token bitmask applied to the logits inside the jitted sampler.

The host (``serving.structured_output``) fills one ``[R, W] int32`` row per
batch row, ``W = ceil(vocab / 32)``: bit ``t % 32`` of word ``t // 32`` set
means token ``t`` may be sampled (llguidance's layout, as vLLM v1's and
tpu-inference's). An unconstrained row is all ones (-1), and a batch with no
constrained row skips the expansion entirely (``lax.cond``). The shape is the
batch's, fixed per bucket, so a constrained request compiles nothing new.

No mask at all (None, ``SamplingArrays``' default) is dropped at trace time;
the engine always passes one, so its programs do not depend on constraints.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=64)
def unconstrained(rows: int, words: int) -> np.ndarray:
    """A read-only all-ones ``[rows, words] int32`` mask (no row constrained), shared."""
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
    """Logits with the tokens a row's mask forbids set to -inf.

    Args:
      logits: [R, V] float32.
      mask: [R, ceil(V / 32)] int32, bit t % 32 of word t // 32 allows token t;
        -1 (all bits) leaves the row untouched, bit for bit. None: no mask.

    Returns:
      [R, V] float32. Rows of an all-ones batch are the input itself (the
      expansion is skipped by ``lax.cond``).
    """
    if mask is None:
        return logits
    rows, vocab = logits.shape
    words = mask.shape[-1]
    if words != mask_words(vocab):
        raise ValueError(f"a token mask of {words} words does not fit a vocabulary of {vocab}")

    def masked(_):
        bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
        allowed = bits.reshape(rows, words * 32)[:, :vocab].astype(bool)
        return jnp.where(allowed, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(mask != -1), masked, lambda _: logits, None)
