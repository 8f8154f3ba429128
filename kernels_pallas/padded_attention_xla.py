"""Attention over a padded batch of whole sequences, in plain XLA: the encoder path.

Embedding models run each input once, whole, and keep no KV cache, so their
attention needs no pages: queries, keys and values of a batch of sequences
padded to one length bucket::

    q:       [batch, seq, num_heads, head_dim]
    k, v:    [batch, seq, kv_heads, head_dim]       (grouped-query: num_heads % kv_heads == 0)
    lengths: [batch] int32                           row b's tokens are 0 .. lengths[b] - 1

Masks (query position i, key position j, both < the row's length):

- causal (``causal=True``, a decoder's): key j is seen iff ``j <= i`` and, with a
  sliding ``window`` > 0, ``i - j < window`` (as ``paged_attention_xla``);
- bidirectional (``causal=False``, EmbeddingGemma's ``use_bidirectional_attention``):
  every key of the row, and with a sliding ``window`` > 0, those with
  ``|i - j| <= window // 2``: transformers' Gemma 3 turns the config's window into
  ``window // 2 + 1`` for bidirectional models (``Gemma3TextConfig.__post_init__``)
  and masks ``|i - j| < that`` (``modeling_gemma3._bidirectional_window_overlay``).

``window <= 0`` (or None) means unlimited; it may be a traced int32 scalar, one per
layer of a layer scan. Padding keys are masked (their probabilities are exactly
zero, their values replaced by zero), so what padding holds never reaches a real
query; padding queries see key 0 only and their rows are garbage for the caller
to ignore. The softmax runs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30

__all__ = ["padded_attention_mask", "padded_attention_xla"]


def padded_attention_mask(lengths: jax.Array, seq: int, *, causal: bool, window=None) -> jax.Array:
    """Which keys each query sees.

    Args:
      lengths: [batch] int32, each row's real tokens.
      seq: the padded length.
      causal: a decoder's mask (else bidirectional).
      window: None, or an int / int32 scalar sliding window (<= 0: unlimited).

    Returns:
      [batch, seq (queries), seq (keys)] bool. A padding query sees key 0 only, so
      its softmax stays finite.
    """
    pos = jnp.arange(seq, dtype=jnp.int32)
    q_pos, k_pos = pos[:, None], pos[None, :]
    if causal:
        mask = k_pos <= q_pos
        if window is not None:
            w = jnp.asarray(window, jnp.int32)
            mask = mask & ((w <= 0) | (q_pos - k_pos < w))
    else:
        mask = jnp.ones((seq, seq), bool)
        if window is not None:
            w = jnp.asarray(window, jnp.int32)
            mask = mask & ((w <= 0) | (jnp.abs(q_pos - k_pos) <= w // 2))
    real = pos[None, :] < lengths[:, None]  # [batch, seq]
    mask = mask[None] & real[:, None, :] & real[:, :, None]
    return mask | (~real[:, :, None] & (k_pos == 0)[None])


def padded_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, scale: float,
                         causal: bool = True, sliding_window=None, soft_cap: float | None = None
                         ) -> jax.Array:
    """Multi-head attention of a padded batch (module docstring: shapes and masks).

    Args:
      q: [B, S, N, H]; k, v: [B, S, K, H] with N % K == 0; any float dtype.
      lengths: [B] int32, 1 <= lengths[b] <= S.
      scale: score multiplier (1 / sqrt(query_pre_attn_scalar) for Gemma).
      causal: the decoder's causal mask, else bidirectional.
      sliding_window: None, or an int / int32 scalar (<= 0: unlimited).
      soft_cap: optional tanh soft-cap of the scores (Gemma 2).

    Returns:
      [B, S, N, H] in q's dtype; rows at padding positions are meaningless.

    Raises:
      ValueError: shapes that disagree, or N not a multiple of K.
    """
    B, S, N, H = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, S) or k.shape[3] != H:
        raise ValueError(f"padded_attention_xla: q {q.shape}, k {k.shape}, v {v.shape} disagree")
    K = k.shape[2]
    if N % K:
        raise ValueError(f"padded_attention_xla: {N} query heads are not a multiple of {K} kv heads")
    if lengths.shape != (B,):
        raise ValueError(f"padded_attention_xla: lengths {lengths.shape}, expected ({B},)")
    G = N // K
    qf = q.astype(jnp.float32).reshape(B, S, K, G, H)
    scores = jnp.einsum("bqkgh,bskh->bkgqs", qf, k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = padded_attention_mask(lengths, S, causal=causal, window=sliding_window)[:, None, None]
    scores = jnp.where(mask, scores, _MASK_VALUE)
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    p = jnp.where(mask, p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    real_v = (jnp.arange(S)[None, :] < lengths[:, None])[:, :, None, None]
    vf = jnp.where(real_v, v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgqs,bskh->bqkgh", p, vf)
    return out.reshape(B, S, N, H).astype(q.dtype)
