"""How KV pages (and stacked weights) are stored: bfloat16 may live as its uint16 bits,
float8_e4m3fn (fp8 KV pages, ``kernels_pallas.kv_quant``) as its uint8 bits.

Convention: a uint16 cache or weight always holds bfloat16 bits, a uint8 one
float8_e4m3fn bits (int8 is stored as int8). Writes
bit-cast the new rows into the stored dtype, reads bit-cast gathered pages
back, and every function here is a no-op for any other dtype, so code that
reads through :func:`from_storage` works whatever the storage.

Which platforms store bits is :func:`storage_dtype`'s table, consulted by the
engine's backend policy (``serving.engine.backend_policy``), never by the model or the
kernels: XLA:CPU does not scatter or dynamic-update bfloat16 in place (each
KV write converted the whole cache: 4.4 s per decode step for a 4096-page
cache, against 0.12 ms in float32; benchmarks/RESULTS.md) and slices a
stacked bfloat16 weight in the layer scan ~10x slower than its bits, while
integer scatters and slices are fast (float8_e4m3fn likewise: scattering 32
rows into an 18-layer fp8 cache took 1.4 s against 0.01 ms for its uint8 bits,
2026-12-07). Accelerators store bfloat16 and float8 as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = jnp.uint16
_BITS_OF = {jnp.dtype(jnp.uint16): jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint8): jnp.dtype(jnp.float8_e4m3fn)}
"""Stored bits dtype -> the logical dtype they hold."""


def storage_dtype(dtype, backend: str):
    """The array dtype that holds values of logical ``dtype`` on ``backend`` ("cpu", "gpu", "tpu")."""
    dtype = jnp.dtype(dtype)
    if backend == "cpu":
        for bits, logical in _BITS_OF.items():
            if dtype == logical:
                return bits
    return dtype


def logical_dtype(stored) -> jnp.dtype:
    """The dtype a stored cache holds (bfloat16 for uint16 bits, float8_e4m3fn for uint8)."""
    stored = jnp.dtype(stored)
    return _BITS_OF.get(stored, stored)


def from_storage(x: jax.Array) -> jax.Array:
    """Stored pages (any shape) -> their logical values."""
    logical = _BITS_OF.get(jnp.dtype(x.dtype))
    return x if logical is None else jax.lax.bitcast_convert_type(x, logical)


def to_storage(x: jax.Array, stored) -> jax.Array:
    """Values -> the stored representation of a cache of dtype ``stored``."""
    logical = _BITS_OF.get(jnp.dtype(stored))
    if logical is not None:
        return jax.lax.bitcast_convert_type(x.astype(logical), stored)
    return x.astype(stored)
