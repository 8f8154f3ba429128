"""A sum over the last axis whose order of additions is fixed by the axis length alone.

``jnp.sum`` leaves the order of a row's additions to the backend, and XLA:CPU
chooses it by the size of the whole array: on the 2-core test machine a
``[rows, 640]`` float32 sum of squares runs through YNNPACK from 8 rows up and
through XLA's own loop below, and a ``[rows, 64]`` one changes order at 64 rows,
so the same row gets a sum that differs in its last bits with the number of rows
beside it (measured 2026-12-01 on jax 0.10.2; the norm of RMSNorm and the
denominator of the attention softmax are where it showed). :func:`ordered_sum`
spells the order out as elementwise additions, which every backend computes
exactly as written (XLA does not reassociate floating-point additions):

    the row zero-padded to the next power of two, then
    level 1:  y[i] = x[2i] + x[2i + 1]
    level 2:  the same on y, ... until one element is left

The result of a row depends only on that row's values, never on the other
dimensions of the array; and since a complete pairwise tree adds trailing zeros
only to zeros, appending zeros to a row never changes its sum (attention's key
axis grows with the page-table bucket of the step, which follows the longest
sequence in it, and differs between prefill and decode). This is the
batch-invariant reduction of "Defeating Nondeterminism in LLM Inference"
(Horace He, Thinking Machines Lab, 2025) in its simplest form: a per-row order
that no batch dimension can change.

Cost: log2 of the padded width elementwise passes over halving arrays (about
twice the data of one pass); used only where the backend policy asks for
batch invariance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """Sum over the last axis in the fixed pairwise order above.

    Args:
      x: [..., n] any float dtype (n >= 1); the sum is in x's dtype.
      keepdims: keep the last axis with size 1 (as ``jnp.sum(..., keepdims=True)``).

    Returns:
      [...] (or [..., 1] with keepdims).
    """
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x if keepdims else x[..., 0]
