"""How KV pages (and stacked weights) are stored: bfloat16 may live as its uint16 bits.

Convention: a uint16 cache or weight always holds bfloat16 bits. Writes
bit-cast the new rows into the stored dtype, reads bit-cast gathered pages
back, and every function here is a no-op for any other dtype, so code that
reads through :func:`from_storage` works whatever the storage.

Which platforms store bits is :func:`storage_dtype`'s table, consulted by the
engine's backend policy (``serving.engine.backend_policy``), never by the model or the
kernels: XLA:CPU does not scatter or dynamic-update bfloat16 in place (each
KV write converted the whole cache: 4.4 s per decode step for a 4096-page
cache, against 0.12 ms in float32; benchmarks/RESULTS.md) and slices a
stacked bfloat16 weight in the layer scan ~10x slower than its bits, while
integer scatters and slices are fast. Accelerators store bfloat16 as is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = jnp.uint16


def storage_dtype(dtype, backend: str):
    """The array dtype that holds values of logical ``dtype`` on ``backend`` ("cpu", "gpu", "tpu")."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and backend == "cpu":
        return jnp.dtype(_BITS)
    return dtype


def logical_dtype(stored) -> jnp.dtype:
    """The dtype a stored cache holds (bfloat16 for uint16 bits)."""
    stored = jnp.dtype(stored)
    return jnp.dtype(jnp.bfloat16) if stored == _BITS else stored


def from_storage(x: jax.Array) -> jax.Array:
    """Stored pages (any shape) -> their logical values."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == _BITS else x


def to_storage(x: jax.Array, stored) -> jax.Array:
    """Values -> the stored representation of a cache of dtype ``stored``."""
    if jnp.dtype(stored) == _BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), _BITS)
    return x.astype(stored)
