"""Row counts at which a low-precision matmul gives each row the same result.

A backend may compute a bfloat16 matmul's rows with different kernels by the
number of rows M, and two kernels may sum a row's products over the
contraction axis in different orders, so a row's float32 result changes in its
last bits with the rows beside it. On the Intel Xeon (Sapphire Rapids, AMX)
test machine, XLA:CPU (YNNPACK, jax 0.10.2) computes a bf16 x bf16 -> f32
``[M, K] x [K, N]`` product in tiles of 16 rows, and a tile of one or two rows
(M = 1, M = 2, or the last 1 or 2 rows of M = 16j + 1, 16j + 2) goes to
another kernel than a tile of 3 to 16 rows: that row's result differs from the
same row's at any other M (measured 2026-12-01 for K, N of the tiny test model
and of Gemma 3 270M, and for the per-(slot, KV head) attention dots; with K = 16
the smaller kernel reached up to 4 rows). On an AMD Zen 4 machine every M gave
the same result; on an AMD EPYC without AVX-512 (bf16 widened to float32, no
native bf16 dot) every M from 2 up did, and M = 1 did not (measured 2026-12-05). :class:`DotRows` says how many rows to compute instead: the
rows are padded by repeating the last row (the padding rows' results are
dropped), so every tile holds at least ``min_rows`` rows::

    M < min_rows                         -> min_rows
    0 < M mod tile < min_rows (M > tile) -> M rounded up so the last tile holds min_rows
    otherwise                            -> M

The backend policy (``serving.engine.backend_policy``) picks the numbers for its
platform, and on a CPU by its features (``serving.engine.cpu_features``), when batch
invariance is on; the default (1, no tile) pads nothing.
This is the fixed-kernel half of the batch-invariant matmul of "Defeating
Nondeterminism in LLM Inference" (Horace He, Thinking Machines Lab, 2025):
keep every row on one kernel whatever the batch.

Cost: at most ``min_rows - 1`` extra rows per matmul; a step of few rows reads
the same weights either way, so it is bandwidth, not FLOPs, that it pays
(benchmarks/RESULTS.md, issue 17).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DotRows:
    """The row padding of a low-precision matmul (static: part of every compiled step).

    Attributes:
      min_rows: the fewest rows a matmul (and, with ``tile``, each tile of rows) runs with.
      tile: the backend's tile height in rows (0: no tiles, only ``min_rows`` applies).

    Raises:
      ValueError: min_rows < 1, tile < 0, or a tile smaller than min_rows.
    """

    min_rows: int = 1
    tile: int = 0

    def __post_init__(self):
        if self.min_rows < 1 or self.tile < 0:
            raise ValueError(f"DotRows needs min_rows >= 1 and tile >= 0, got {self}")
        if self.tile and self.tile < self.min_rows:
            raise ValueError(f"DotRows tile ({self.tile}) must be >= min_rows ({self.min_rows})")

    def count(self, rows: int) -> int:
        """The rows to compute for ``rows`` real ones (>= rows; see the module docstring)."""
        if rows < self.min_rows:
            return self.min_rows
        tail = rows % self.tile if self.tile else 0
        if 0 < tail < self.min_rows:
            return rows - tail + self.min_rows
        return rows

    def pad(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """``x`` padded along ``axis`` to ``count(x.shape[axis])`` entries (:func:`repeat_last`)."""
        return repeat_last(x, self.count(x.shape[axis]), axis)


def repeat_last(x: jax.Array, size: int, axis: int = 0) -> jax.Array:
    """``x`` with its last entry along ``axis`` repeated up to ``size`` entries (unchanged
    when it has as many already); any shape and dtype."""
    rows = x.shape[axis]
    if size <= rows:
        return x
    last = jax.lax.slice_in_dim(x, rows - 1, rows, axis=axis)
    return jnp.concatenate([x, jnp.repeat(last, size - rows, axis=axis)], axis=axis)
