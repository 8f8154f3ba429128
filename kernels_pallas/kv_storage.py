"""How KV pages are stored: bfloat16 pages live as uint16 bits on XLA:CPU.

XLA:CPU does not scatter or dynamic-update bfloat16 in place: each KV write
converted the whole cache (4.4 s per decode step for a 4096-page cache,
against 0.12 ms in float32; benchmarks/RESULTS.md). Integer scatters are in
place, so on CPU a bfloat16 cache is stored as its uint16 bit pattern: writes
bit-cast the new rows, reads bit-cast the gathered pages back. Accelerators
store bfloat16 as is. Convention: a uint16 KV cache always holds bfloat16 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = jnp.uint16


def storage_dtype(dtype, backend: str | None = None):
    """The array dtype that holds a KV cache of logical ``dtype`` on ``backend`` (default: JAX's)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and (backend or jax.default_backend()) == "cpu":
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
