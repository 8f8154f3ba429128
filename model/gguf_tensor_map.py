"""Which GGUF tensor becomes which parameter, per ``general.architecture``, and how.

GGUF (llama.cpp) names tensors ``token_embd.weight``, ``blk.{i}.attn_q.weight``
and so on, and stores a linear layer as ``[ne0 = in, ne1 = out]``: the
dequantized row-major numpy array is ``(out, in)`` (HF's ``nn.Linear.weight``
layout) and ``y = x @ W.T``. Stacked MoE experts are ``(E, out, in)``. The
functions here turn one such array into our einsum layouts (``model.gemma3``,
``model.llama.param_layout``).

llama.cpp's Q/K row permutation
-------------------------------
llama.cpp's HF -> GGUF converter (``convert_hf_to_gguf.py``, ``LlamaModel``:
``modify_tensors`` calls ``LlamaModel.permute(data_torch, n_head, n_head)`` on
``q_proj`` and ``LlamaModel.permute(data_torch, n_head, n_kv_head)`` on
``k_proj``) reorders the rows of every head of ``attn_q`` / ``attn_k``::

    permute(w, n) = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:])
                     .swapaxes(1, 2).reshape(w.shape)      # n = kv heads for K

HF's Llama rotates halves (element d pairs with d + H/2, "NeoX" style), while
llama.cpp runs the ``llama`` architecture with ``LLAMA_ROPE_TYPE_NORM``
(adjacent pairs 2j, 2j+1; ``llama_model_rope_type`` in ``src/llama-model.cpp``).
The permutation moves row ``j`` of a head to ``2j`` and row ``j + H/2`` to
``2j + 1``, so llama.cpp's interleaved RoPE on the GGUF rows computes what HF's
rotate-half RoPE computes on the HF rows. ``model.layers.apply_rope`` is
rotate-half, so the loader undoes the permutation (:func:`unpermute_qk`) for
architectures that llama.cpp permutes (``PERMUTED_QK``). Qwen2, Qwen3 / Qwen3-MoE,
Phi-3, Gemma 2 and Gemma 3 use NeoX RoPE in llama.cpp too (``LLAMA_ROPE_TYPE_NEOX``)
and their converters do not permute: their rows load as stored.
"""

from __future__ import annotations

import math

import numpy as np

PERMUTED_QK = frozenset({"llama"})
"""GGUF architectures whose attn_q / attn_k rows llama.cpp's converter permutes."""

GEMMA3_LAYER_TENSORS = {
    # ours: (gguf name, layout kind)
    "attn_norm": ("attn_norm", "vector"),
    "post_attn_norm": ("post_attention_norm", "vector"),
    "ffw_norm": ("ffn_norm", "vector"),
    "post_ffw_norm": ("post_ffw_norm", "vector"),
    "q_norm": ("attn_q_norm", "vector"),
    "k_norm": ("attn_k_norm", "vector"),
    "wq": ("attn_q", "q"),
    "wk": ("attn_k", "kv"),
    "wv": ("attn_v", "kv"),
    "wo": ("attn_output", "out"),
    "w_gate": ("ffn_gate", "in"),
    "w_up": ("ffn_up", "in"),
    "w_down": ("ffn_down", "in"),
}

_LLAMA_ATTENTION = {
    "attn_norm": ("attn_norm", "vector"),
    "ffw_norm": ("ffn_norm", "vector"),
    "wq": ("attn_q", "q"),
    "wk": ("attn_k", "kv"),
    "wv": ("attn_v", "kv"),
    "wo": ("attn_output", "out"),
}
_QK_NORM = {"q_norm": ("attn_q_norm", "vector"), "k_norm": ("attn_k_norm", "vector")}
_DENSE_FFN = {"w_gate": ("ffn_gate", "in"), "w_up": ("ffn_up", "in"), "w_down": ("ffn_down", "in")}
_MOE_FFN = {
    "router": ("ffn_gate_inp", "in"),
    "w_gate": ("ffn_gate_exps", "experts"),
    "w_up": ("ffn_up_exps", "experts"),
    "w_down": ("ffn_down_exps", "experts"),
}


_QKV_BIAS = {"bq": ("attn_q.bias", "bias_q"), "bk": ("attn_k.bias", "bias_kv"),
             "bv": ("attn_v.bias", "bias_kv")}
_PHI3_FUSED = {  # llama.cpp's phi3: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up (gate rows first)
    "wq": ("attn_qkv", "qkv_q"), "wk": ("attn_qkv", "qkv_k"), "wv": ("attn_qkv", "qkv_v"),
    "w_gate": ("ffn_up", "gate_up_gate"), "w_up": ("ffn_up", "gate_up_up"),
}


def llama_layer_tensors(qk_norm: bool, moe: bool, qkv_bias: bool = False,
                        fused_phi3: bool = False) -> dict[str, tuple[str, str]]:
    """{our layer param: (GGUF tensor name within ``blk.{i}.``, layout kind)} for a
    Llama-family decoder (``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, ``phi3``).
    A name ending in ``.bias`` is the whole suffix; any other gets ``.weight``."""
    out = dict(_LLAMA_ATTENTION)
    if qk_norm:
        out.update(_QK_NORM)
    if qkv_bias:
        out.update(_QKV_BIAS)
    out.update(_MOE_FFN if moe else _DENSE_FFN)
    if fused_phi3:
        out.update(_PHI3_FUSED)
    return out


def gemma_layer_tensors(qk_norm: bool) -> dict[str, tuple[str, str]]:
    """The layer tensors of ``gemma3`` GGUFs, and of ``gemma2`` ones (no QK-norm)."""
    if qk_norm:
        return dict(GEMMA3_LAYER_TENSORS)
    return {k: v for k, v in GEMMA3_LAYER_TENSORS.items() if k not in ("q_norm", "k_norm")}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's ``LlamaModel.permute`` (module docstring) on GGUF rows.

    Args:
      w: [n_head * H, D] (GGUF ``attn_q``/``attn_k`` as ``(out, in)``).
      n_head: query heads for Q, KV heads for K.

    Returns:
      [n_head * H, D] in HF's row order (rotate-half RoPE).
    """
    h = w.shape[0] // n_head
    return w.reshape(n_head, h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation, HF rows -> GGUF rows (the inverse of :func:`unpermute_qk`)."""
    h = w.shape[0] // n_head
    return w.reshape(n_head, 2, h // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_layout(arr: np.ndarray, kind: str, *, hidden: int, heads: int, kv_heads: int,
              head_dim: int) -> np.ndarray:
    """One dequantized GGUF tensor (numpy ``(out, in)`` order) in our layout.

    kinds: "vector" [n] as is; "q" (N*H, D) -> [D, N, H]; "kv" (K*H, D) -> [D, K, H];
    "out" (D, N*H) -> [N, H, D]; "in" (out, in) -> [in, out] (also the router:
    (E, D) -> [D, E]); "experts" (E, out, in) -> [E, in, out] (``ffn_gate_exps``
    (E, F, D) -> [E, D, F], ``ffn_down_exps`` (E, D, F) -> [E, F, D]);
    "bias_q" (N*H,) -> [N, H], "bias_kv" (K*H,) -> [K, H]; Phi-3's fused
    ``attn_qkv`` ((N + 2K) * H, D): "qkv_q" / "qkv_k" / "qkv_v" its q / k / v rows
    as "q" / "kv"; fused ``ffn_up`` (2F, D): "gate_up_gate" / "gate_up_up" its
    first / second half of rows as "in".

    Raises:
      ValueError: unknown kind.
    """
    D, H = hidden, head_dim
    if kind == "vector":
        return arr
    if kind == "bias_q":
        return arr.reshape(heads, H)
    if kind == "bias_kv":
        return arr.reshape(kv_heads, H)
    if kind in ("qkv_q", "qkv_k", "qkv_v"):
        if arr.shape[0] != (heads + 2 * kv_heads) * H:
            raise ValueError(f"fused qkv has {arr.shape[0]} rows, expected (N + 2K) * H = "
                             f"{(heads + 2 * kv_heads) * H}")
        q, k = heads * H, kv_heads * H
        part = {"qkv_q": arr[:q], "qkv_k": arr[q:q + k], "qkv_v": arr[q + k:]}[kind]
        return part.T.reshape(D, -1, H)
    if kind in ("gate_up_gate", "gate_up_up"):
        f = arr.shape[0] // 2
        return (arr[:f] if kind == "gate_up_gate" else arr[f:]).T
    if kind == "q":
        return arr.T.reshape(D, heads, H)
    if kind == "kv":
        return arr.T.reshape(D, kv_heads, H)
    if kind == "out":
        return arr.T.reshape(heads, H, D)
    if kind == "in":
        return arr.T
    if kind == "experts":
        return arr.swapaxes(1, 2)
    raise ValueError(f"unknown tensor layout kind {kind!r}")


def llama3_rope_scaling(freq_factors: np.ndarray, head_dim: int, theta: float,
                        original_max_position: int) -> dict[str, float] | None:
    """Llama 3.1 RoPE scaling parameters from a GGUF ``rope_freqs.weight`` tensor.

    llama.cpp's converter (``LlamaModel.generate_extra_tensors``, rope_type
    "llama3") stores per frequency i the divisor ``ff_i`` llama.cpp applies to
    ``inv_freq_i``: 1 for wavelengths below ``old / high_freq_factor``,
    ``factor`` above ``old / low_freq_factor``, and ``1 / ((1 - s) / factor + s)``
    between, with ``s = (old / wavelen - low) / (high - low)``. We recover
    ``factor = max(ff)`` and fit ``low, high`` from the band (``s`` is linear in
    ``1 / wavelen``), then check that our formula (``model.layers.rope_inv_freq``)
    reproduces every ``ff_i``.

    Args:
      freq_factors: [head_dim / 2] f32.
      head_dim, theta: the RoPE dimension and base.
      original_max_position: ``old`` in tokens (GGUF
        ``{arch}.rope.scaling.original_context_length``, else Llama 3.1's 8192).

    With fewer than two frequencies inside the band (a small head_dim, or a short
    original context) low and high are not determined: any edges that leave every
    frequency on its side, and the one inside at its value, give the same frequencies
    (:func:`_band_edges`).

    Returns:
      None when every factor is 1, else {"rope_scaling_factor",
      "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position"}.

    Raises:
      ValueError: the factors are not of Llama 3's form.
    """
    ff = np.asarray(freq_factors, np.float64).reshape(-1)
    if ff.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs has {ff.size} entries, expected head_dim / 2 = {head_dim // 2}")
    if np.allclose(ff, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(ff.max())
    old = float(original_max_position)
    inv_freq = 1.0 / theta ** (np.arange(head_dim // 2) * 2.0 / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    band = (ff > 1 + 1e-6) & (ff < factor * (1 - 1e-6))
    s = (1.0 / ff - 1.0 / factor) / (1.0 - 1.0 / factor)  # 0 scaled by factor .. 1 unscaled
    if band.sum() >= 2:
        a, b = np.polyfit(x[band], s[band], 1)  # s = old / (high - low) * x - low / (high - low)
        width = old / a
        low = round(float(-b * width), 6)
        high = round(float(-b * width + width), 6)
    else:
        low, high = _band_edges(x, s, band, ~band & (ff > 1 + 1e-6), old)
    params = {"rope_scaling_factor": factor, "rope_low_freq_factor": low,
              "rope_high_freq_factor": high, "rope_original_max_position": int(old)}
    wavelen = 1.0 / x
    smooth = (old / wavelen - low) / (high - low)
    want = np.where(wavelen > old / low, factor,
                    np.where(wavelen < old / high, 1.0, 1.0 / ((1 - smooth) / factor + smooth)))
    if not np.allclose(want, ff, rtol=1e-4, atol=1e-6):
        raise ValueError(f"rope_freqs is not Llama 3 RoPE scaling (best fit {params} "
                         f"differs by {np.abs(want - ff).max():.2e})")
    return params


def _band_edges(x: np.ndarray, s: np.ndarray, band: np.ndarray, scaled: np.ndarray,
                old: float) -> tuple[float, float]:
    """(low, high) freq factors for :func:`llama3_rope_scaling` with < 2 frequencies in the band.

    In ``x = 1 / wavelength`` the band is ``low / old < x < high / old`` with ``s``
    linear from 0 to 1 across it; frequencies with ``x`` below it are divided by the
    factor, those above it kept. Picks edges halfway to the nearest outside
    frequency on each side, through the band frequency's ``(x, s)`` when there is one.
    """
    below = float(x[scaled].max()) if scaled.any() else 0.0
    above_x = x[~scaled & ~band]
    above = float(above_x.min()) if above_x.size else math.inf
    if band.any():
        x0, s0 = float(x[band][0]), float(s[band][0])
        width = 0.5 * min((x0 - below) / s0, (above - x0) / (1.0 - s0))
        lo = x0 - s0 * width
    elif math.isinf(above):  # every frequency divided: a band above them all
        lo, width = 2.0 * below, 2.0 * below
    else:
        lo, width = below + (above - below) / 3.0, (above - below) / 3.0
    return lo * old, (lo + width) * old
