"""Input and output plumbing shared by the Pallas paged-attention kernels (GPU and TPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.kv_quant import split_pages
from kernels_pallas.kv_storage import from_storage


def as_stacked_cache(k_pages, v_pages, layer, num_heads: int):
    """Normalizes the cache arguments of a kernel.

    Args:
      k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim], or with
        ``layer`` the stacked [num_layers, kv_heads, num_pages, page_size, head_dim]; arrays,
        or ``kernels_pallas.kv_quant.QuantizedPages`` (values and scale pages).
      layer: None, or an int / int32 scalar.
      num_heads: query heads.

    Returns:
      (k_pages, v_pages, k_scale, v_scale, layer, group): the stacked values, the stacked
      scale pages [num_layers, kv_heads, num_pages, page_size] float32 (None for an
      unquantized cache), the layer (0 for an unstacked one) and the query heads per kv head.

    Raises:
      ValueError: num_heads not a multiple of kv_heads.
    """
    (k_pages, k_scale), (v_pages, v_scale) = split_pages(k_pages), split_pages(v_pages)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
        if k_scale is not None:
            k_scale, v_scale = k_scale[None], v_scale[None]
    # bf16 stored as uint16 bits (XLA:CPU only, where the kernels run interpreted): view as bf16.
    k_pages, v_pages = from_storage(k_pages), from_storage(v_pages)
    kv_heads = k_pages.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    return k_pages, v_pages, k_scale, v_scale, layer, num_heads // kv_heads


def cache_refs(refs, quantized: bool):
    """A kernel's trailing refs split as (k, k_scale, v, v_scale, rest...): the scale refs
    are None for an unquantized cache (the kernels take them after their values)."""
    if quantized:
        return refs
    k_ref, v_ref, *rest = refs
    return (k_ref, None, v_ref, None, *rest)


def load_pages(ref, scale_ref, index) -> jax.Array:
    """``ref[index]`` in float32, dequantized by ``scale_ref[index]`` (the scale pages,
    indexed the same way up to head_dim) when there is one."""
    x = ref[index].astype(jnp.float32)
    if scale_ref is None:
        return x
    return x * scale_ref[index].astype(jnp.float32)[..., None]


def ragged_from_slabs(slab: jax.Array, cu_q_lens: jax.Array, num_seqs, num_tokens: int) -> jax.Array:
    """Gathers a prefill kernel's per-sequence output slabs back into the ragged token order.

    Args:
      slab: [max_seqs, rows, kv_heads, group, head_dim]; row r of slab s is token cu_q_lens[s] + r.
      cu_q_lens: [max_seqs + 1] int32.
      num_seqs: [] int32, real sequences.
      num_tokens: T, the step's token count.

    Returns:
      [T, kv_heads * group, head_dim]; padding tokens are 0.
    """
    max_seqs, rows = slab.shape[:2]
    cu = cu_q_lens.astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    valid = (t < cu[jnp.asarray(num_seqs, jnp.int32)]) & (seq < num_seqs)
    out = slab[seq, jnp.clip(t - cu[seq], 0, rows - 1)]
    out = jnp.where(valid[:, None, None, None], out, 0)
    return out.reshape(num_tokens, -1, slab.shape[-1])
