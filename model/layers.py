"""Building blocks shared by the decoders: RMSNorm, RoPE, parameters and the paged attention block.

``attention_block`` is the whole attention sub-layer of Gemma 2 and 3, Llama 3, Qwen2, Phi-3 and
Qwen3(-MoE) over the paged KV cache: QKV projections (optional biases), optional per-head QK-norm
(Gemma 3, Qwen3), RoPE, the KV write, paged attention and the output
projection. Decoders differ around it (norm placement, MLP, embeddings).
``encode_attention_block`` is the same sub-layer over a padded batch of whole sequences without a
cache (embedding models' ``encode``: causal, or bidirectional when ``cfg.causal`` is False);
both share ``project_qkv``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.attention import paged_attention, write_kv_pages
from kernels_pallas.kv_quant import logical_kv_dtype
from kernels_pallas.padded_attention_xla import padded_attention_xla
from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.config import ModelConfig
from model.quantization import (
    CONTRACTION_AXES,
    QuantizedArray,
    check_quantization,
    quantize_per_channel,
    scale_axes,
)

SCALE_SUFFIX = "_scale"
"""An int8 parameter ``name`` keeps its scales in ``name + SCALE_SUFFIX``."""


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, compute: Compute = REFERENCE) -> jax.Array:
    """x: [..., d] (computed in float32), scale: [d] (the full multiplier). Returns float32.

    ``compute`` picks how the mean of squares is summed (``Compute.mean``)."""
    x = x.astype(jnp.float32)
    var = compute.mean(jnp.square(x))
    return x * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)


def rope_inv_freq(head_dim: int, theta, cfg: ModelConfig | None = None, scaled=True,
                  long: bool = False) -> jax.Array:
    """[head_dim / 2] f32 inverse frequencies ``theta ** (-2i / head_dim)``, scaled as
    ``cfg.rope_scaling_type`` says when ``cfg.rope_scaling_factor`` is set:

      * "llama3" (Llama 3.1; HF ``_compute_llama3_parameters``): wavelengths above
        ``original_max_position / low_freq_factor`` are divided by ``factor``,
        those below ``original_max_position / high_freq_factor`` kept, and the
        band between interpolated smoothly.
      * "linear" (Chen et al. 2023, "Extending Context Window of Large Language
        Models via Positional Interpolation"; HF ``_compute_linear_scaling_rope_parameters``):
        every frequency divided by ``factor``.
      * "yarn" (Peng et al. 2023, "YaRN: Efficient Context Window Extension of
        Large Language Models", sec. 3.2 "NTK-by-parts"; HF ``_compute_yarn_parameters``):
        with ``d(r) = head_dim * ln(original_max_position / (2 pi r)) / (2 ln theta)``
        the dimension that turns ``r`` times over the original context,
        ``low = d(beta_fast)``, ``high = d(beta_slow)`` (floored / ceiled when
        ``rope_yarn_truncate``, clamped to [0, head_dim - 1]) and
        ``ramp_i = clip((i - low) / (high - low), 0, 1)``, frequency i is
        ``inv_freq_i * (1 - ramp_i) + inv_freq_i / factor * ramp_i``; the
        cos/sin attention factor is :func:`rope_attention_factor`.
      * "longrope" (Phi-3's LongRoPE, Ding et al. 2024, "LongRoPE: Extending LLM
        Context Window Beyond 2 Million Tokens"; HF ``_compute_longrope_parameters``):
        frequency i is ``inv_freq_i / short_factors_i`` (this function) for
        positions below ``rope_original_max_position`` and ``inv_freq_i /
        long_factors_i`` from there on (:func:`apply_rope` picks per position;
        ``long=True`` returns these).

    Args:
      head_dim: the rotated width.
      theta: RoPE base (python float or traced scalar).
      cfg: the scaling parameters (None: unscaled).
      scaled: False (or a traced False) returns the unscaled frequencies
        (Gemma 3's sliding layers).
    """
    half = head_dim // 2
    exponent = jnp.arange(half, dtype=jnp.float32) * (2.0 / head_dim)
    inv_freq = 1.0 / (jnp.asarray(theta, jnp.float32) ** exponent)
    if cfg is None or cfg.rope_scaling_factor is None or scaled is False:
        return inv_freq
    factor = cfg.rope_scaling_factor
    kind = cfg.rope_scaling_type
    if kind == "linear":
        out = inv_freq / factor
    elif kind == "longrope":
        ext = cfg.rope_long_factors if long else cfg.rope_short_factors
        out = inv_freq / jnp.asarray(ext, jnp.float32)
    elif kind == "yarn":
        out = _yarn_inv_freq(inv_freq, head_dim, theta, cfg)
    else:
        lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = float(cfg.rope_original_max_position)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = jnp.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        out = jnp.where(medium, smoothed, out)
    return out if scaled is True else jnp.where(scaled, out, inv_freq)


def _yarn_inv_freq(inv_freq: jax.Array, head_dim: int, theta, cfg: ModelConfig) -> jax.Array:
    """YaRN's NTK-by-parts frequencies (formula in :func:`rope_inv_freq`)."""
    log_base = jnp.log(jnp.asarray(theta, jnp.float32))
    old_len = float(cfg.rope_original_max_position)

    def correction_dim(rotations: float):
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * log_base)

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = jnp.floor(low), jnp.ceil(high)
    low, high = jnp.maximum(low, 0.0), jnp.minimum(high, head_dim - 1.0)
    high = jnp.where(high == low, high + 0.001, high)  # as HF: no zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    return inv_freq / cfg.rope_scaling_factor * ramp + inv_freq * (1.0 - ramp)


def rope_attention_factor(cfg: ModelConfig | None) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1.0 for every other RoPE):
    ``cfg.rope_attention_factor``, else for YaRN the paper's ``0.1 ln(factor) + 1``
    (YaRN sec. 3.4, "sqrt(1/t) = 0.1 ln(s) + 1"; HF ``get_mscale``), for LongRoPE
    ``sqrt(1 + ln(factor) / ln(original_max_position))`` (HF
    ``_compute_longrope_parameters``, llama.cpp's ``rope.scaling.attn_factor``)."""
    if cfg is None or cfg.rope_scaling_factor is None or cfg.rope_scaling_type not in (
            "yarn", "longrope"):
        return 1.0
    if cfg.rope_attention_factor is not None:
        return float(cfg.rope_attention_factor)
    s = cfg.rope_scaling_factor
    if s <= 1:
        return 1.0
    if cfg.rope_scaling_type == "longrope":
        return math.sqrt(1 + math.log(s) / math.log(cfg.rope_original_max_position))
    return 0.1 * math.log(s) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, theta, cfg: ModelConfig | None = None,
               scaled=True) -> jax.Array:
    """Rotary embedding, rotate-half (NeoX) pairing: element d pairs with d + rot/2, where
    rot is ``cfg.rope_dim`` (the whole head unless ``cfg.rotary_dim`` says otherwise;
    elements from rot on pass unrotated, as HF's partial rotary).

    Args:
      x: [T, heads, head_dim] float32.
      positions: [T] int32 absolute positions.
      theta: RoPE base (python float or traced scalar).
      cfg: RoPE scaling (see :func:`rope_inv_freq`) and the rotated width; None: unscaled, whole head.
      scaled: whether this layer's RoPE is scaled (bool or traced bool; Gemma 3
        scales its global layers only).

    LongRoPE picks its long factors for positions from ``rope_original_max_position``
    on, per token (the KV cache keeps what earlier positions were written with). HF
    instead recomputes the whole sequence with the long factors once it is longer
    than the original context; the two agree on every sequence within it.
    """
    rot = cfg.rope_dim if cfg is not None else x.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rot], positions, theta, cfg, scaled),
                                x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    inv_freq = rope_inv_freq(x.shape[-1], theta, cfg, scaled)  # [half]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    if (cfg is not None and cfg.rope_scaling_type == "longrope"
            and cfg.rope_scaling_factor is not None and scaled is not False):
        long = positions.astype(jnp.float32)[:, None] * rope_inv_freq(
            x.shape[-1], theta, cfg, scaled, long=True)[None, :]
        angles = jnp.where((positions >= cfg.rope_original_max_position)[:, None], long, angles)
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    factor = rope_attention_factor(cfg) if scaled is not False else 1.0
    if factor != 1.0:
        factor = factor if scaled is True else jnp.where(scaled, factor, 1.0)
        cos, sin = cos * factor, sin * factor
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def check_params(params, layout) -> None:
    """Checks that `params` has every entry of `layout` ({name: (shape, axes)}) at its shape.

    Raises:
      ValueError: naming the missing parameters, or the first one with a wrong shape.
    """
    missing = set(layout) - set(params)
    if missing:
        raise ValueError(f"missing parameters: {sorted(missing)}")
    for name, (shape, _) in layout.items():
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(params[name].shape)}, expected {shape}")


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter annotated with its logical axes (read by ``sharding/``)."""
    return nnx.Param(value, logical_axes=axes)


# The dtype rule both decoders store their parameters by. Matmul inputs are
# rounded to the serving dtype; norm scales and the MoE router stay float32. The
# embedding lookup is a gather, not a matmul: a tied table that the output head
# reads in a low-precision dtype keeps a float32 copy for the lookup
# (``embed_lookup``), as the reference's bf16 simulation rounds only matmul inputs
# (Gemma 3's golden bf16 continuations depend on it: with a bf16 lookup the
# "english" prompt departs at step 11). An untied table is stored in the serving
# dtype and looked up as it is: a float32 copy of a 128k-vocabulary table would
# cost a 70B model 2 GB.
_FLOAT32_PARAMS = ("router",)


def param_dtype(name: str, dtype):
    """The stored dtype of parameter ``name`` of a decoder serving in ``dtype``."""
    if name.endswith("norm") or name in _FLOAT32_PARAMS:
        return jnp.float32
    return dtype


def set_params(module: nnx.Module, params: dict, layout: dict, dtype, quantization: str = "none",
               untied_embed: bool = False) -> None:
    """Sets every parameter of ``layout`` ({name: (shape, logical axes)}) on ``module``.

    Each is stored in ``param_dtype(name, dtype)``; with ``quantization`` "int8"
    the matmul weights (``model.quantization.CONTRACTION_AXES``) are stored as
    int8 ``name`` [the weight's shape] plus float32 ``name + "_scale"`` (logical
    axes ``scale_axes``): per-channel scales when ``params[name]`` is a float
    array, its own block scales when it is already a ``QuantizedArray`` (a GGUF
    Q8_0 tensor). A ``QuantizedArray`` served unquantized is dequantized, and so is
    an ``untied_embed`` table (only looked up, never a dot's operand).

    Raises:
      ValueError: an unknown quantization.
    """
    check_quantization(quantization)
    for name, (_, axes) in layout.items():
        value = params[name]
        if quantization == "int8" and name in CONTRACTION_AXES and not (untied_embed and name == "embed"):
            contract = CONTRACTION_AXES[name]
            q = value if isinstance(value, QuantizedArray) else quantize_per_channel(value, contract)
            setattr(module, name, param(jnp.asarray(q.values, jnp.int8), axes))
            setattr(module, name + SCALE_SUFFIX,
                    param(jnp.asarray(q.scales, jnp.float32), scale_axes(axes, contract)))
            continue
        if isinstance(value, QuantizedArray):
            value = value.dequantize()
        setattr(module, name, param(jnp.asarray(value, param_dtype(name, dtype)), axes))


def weight(module: nnx.Module, name: str):
    """Parameter ``name``'s value: an array, or a ``QuantizedArray`` when it has scales."""
    value = getattr(module, name)[...]
    scales = getattr(module, name + SCALE_SUFFIX, None)
    return value if scales is None else QuantizedArray(value, scales[...])


def embed_lookup_param(embed, dtype, tied: bool, quantized: bool = False) -> nnx.Param | None:
    """The float32 lookup copy of a tied low-precision or int8 embedding table (None: the
    lookup reads ``embed`` itself). An int8 table from a GGUF Q8_0 tensor dequantizes
    exactly, so its lookup reads what a float32 model's does."""
    if not tied or (jnp.dtype(dtype) == jnp.float32 and not quantized):
        return None
    if isinstance(embed, QuantizedArray):
        embed = embed.dequantize()
    return param(jnp.asarray(embed, jnp.float32), ("vocab", "embed"))


def embed_tokens(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """[T] int32 -> [T, D] float32 rows of the model's lookup table (``embed_lookup`` or ``embed``)."""
    table = model.embed if model.embed_lookup is None else model.embed_lookup
    return table[...][tokens].astype(jnp.float32)


def with_lora(y: jax.Array, x: jax.Array, lora, name: str, dtype, compute: Compute) -> jax.Array:
    """``y`` [T, out] f32 plus each row's LoRA update of projection ``name`` for input ``x``
    [T, in] (``model.lora``); ``y`` itself when ``lora`` is None.

    ``lora``: (this layer's {name: (a [S, in, R], b [S, R, out])}, token_slots [T] int32) or None."""
    if lora is None or name not in lora[0]:
        return y
    a, b = lora[0][name]
    return y + compute.lora_dot(x, a, b, lora[1], dtype)


def project_qkv(h: jax.Array, p: dict, positions: jax.Array, *, cfg: ModelConfig, theta, dtype,
                compute: Compute, rope_scaled=True, lora=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention sub-layer's projections: q, k, v with biases, QK-norm and RoPE applied.

    Args:
      h: [T, D] f32, the normed residual stream; positions: [T] int32.
      p, cfg, theta, dtype, compute, rope_scaled, lora: as in :func:`attention_block`.

    Returns:
      (q [T, N, H], k [T, K, H], v [T, K, H]) float32.
    """
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    T = h.shape[0]
    # Projections as plain 2-D matmuls, the heads folded into the columns.
    q = with_lora(compute.dot("td,de->te", h, p["wq"].reshape(D, N * H), dtype), h, lora, "wq", dtype,
                  compute).reshape(T, N, H)
    k = with_lora(compute.dot("td,de->te", h, p["wk"].reshape(D, K * H), dtype), h, lora, "wk", dtype,
                  compute).reshape(T, K, H)
    v = with_lora(compute.dot("td,de->te", h, p["wv"].reshape(D, K * H), dtype), h, lora, "wv", dtype,
                  compute).reshape(T, K, H)
    if cfg.qkv_bias:
        q = q + p["bq"].astype(jnp.float32)
        k = k + p["bk"].astype(jnp.float32)
        v = v + p["bv"].astype(jnp.float32)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], eps, compute), rms_norm(k, p["k_norm"], eps, compute)
    q = apply_rope(q, positions, theta, cfg, rope_scaled)
    k = apply_rope(k, positions, theta, cfg, rope_scaled)
    return q, k, v


def attention_block(h: jax.Array, p: dict, positions: jax.Array, k_cache: jax.Array,
                    v_cache: jax.Array, md: AttentionMetadata, layer, *, cfg: ModelConfig, theta,
                    window, dtype, compute: Compute, rope_scaled=True, lora=None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention sub-layer of one layer (inside the layer scan).

    Args:
      h: [T, D] f32, the normed residual stream.
      p: this layer's weights: wq [D, N, H], wk, wv [D, K, H], wo [N, H, D];
        with ``cfg.qk_norm`` also q_norm, k_norm [H]; with ``cfg.qkv_bias`` also
        bq [N, H], bk, bv [K, H] (added after the projections).
      positions: [T] int32.
      k_cache, v_cache: the stacked cache [layers, K, pages, page_size, H] (arrays, or
        ``kernels_pallas.kv_quant.QuantizedPages`` with their scale pages).
      md: the step's attention metadata.
      layer: int32 scalar, this layer's index into the cache.
      theta: this layer's RoPE base; window: its sliding window (None or int32, <= 0: global).
      rope_scaled: whether ``cfg``'s RoPE scaling applies to this layer (bool or traced bool).
      dtype: matmul-input dtype; compute: the dot and the attention implementation.
      lora: this layer's LoRA stacks and the tokens' slots (see :func:`with_lora`), or None.

    Returns:
      (o [T, D] f32 before any post-norm, k_cache, v_cache).

    Raises:
      ValueError: a bidirectional model (``cfg.causal`` False): the paged path is causal
        (such models run through :func:`encode_attention_block`).
    """
    if not cfg.causal:
        raise ValueError(f"{cfg.name} attends bidirectionally (an embedding model): it has no paged, "
                         "causal prefill or decode; serve it with --task embed")
    D, N, H = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    T = h.shape[0]
    q, k, v = project_qkv(h, p, positions, cfg=cfg, theta=theta, dtype=dtype, compute=compute,
                          rope_scaled=rope_scaled, lora=lora)
    k_cache, v_cache = write_kv_pages(k_cache, v_cache, k, v, md.slot_mapping, layer=layer)
    attn = paged_attention(
        q.astype(logical_kv_dtype(k_cache)), k_cache, v_cache, md, layer=layer,
        scale=cfg.attn_scale, sliding_window=window, soft_cap=cfg.attn_logit_softcap,
        config=compute.attention, window_bound=cfg.sliding_window if window is not None else None,
        bidirectional_spans=md.image_spans)
    attn = attn.reshape(T, N * H)
    o = with_lora(compute.dot("te,ed->td", attn, p["wo"].reshape(N * H, D), dtype), attn, lora, "wo",
                  dtype, compute)
    return o, k_cache, v_cache


def encode_attention_block(h: jax.Array, p: dict, positions: jax.Array, lengths: jax.Array, *,
                           cfg: ModelConfig, theta, window, dtype, compute: Compute,
                           rope_scaled=True) -> jax.Array:
    """The attention sub-layer over a padded batch of whole sequences, no KV cache (embeddings).

    Causal or bidirectional as ``cfg.causal`` says (``kernels_pallas.padded_attention_xla``).

    Args:
      h: [B * S, D] f32, the normed residual stream of B rows padded to S tokens.
      positions: [B * S] int32 (each row 0 .. S - 1).
      lengths: [B] int32 real tokens per row.
      p, cfg, theta, window, dtype, compute, rope_scaled: as in :func:`attention_block`.

    Returns:
      o [B * S, D] f32 before any post-norm.
    """
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    B = lengths.shape[0]
    T = h.shape[0]
    S = T // B
    q, k, v = project_qkv(h, p, positions, cfg=cfg, theta=theta, dtype=dtype, compute=compute,
                          rope_scaled=rope_scaled)
    attn = padded_attention_xla(
        q.astype(dtype).reshape(B, S, N, H), k.astype(dtype).reshape(B, S, K, H),
        v.astype(dtype).reshape(B, S, K, H), lengths, scale=cfg.attn_scale, causal=cfg.causal,
        sliding_window=window, soft_cap=cfg.attn_logit_softcap)
    return compute.dot("te,ed->td", attn.reshape(T, N * H), p["wo"].reshape(N * H, D), dtype)
