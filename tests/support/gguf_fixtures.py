"""Tiny Llama-family GGUF files written the way llama.cpp's HF -> GGUF converter writes them.

``hf_params`` draws a tiny HF-layout checkpoint (``nn.Linear`` weights as
``(out, in)``, experts stacked ``(E, out, in)``); ``write_gguf`` writes it as a
GGUF with llama.cpp's tensor names, metadata keys and, for the "llama"
architecture, llama.cpp's Q/K row permutation (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``, re-implemented here independently of
``model.gguf_tensor_map``); ``reference_params`` turns the same HF checkpoint
(after the same quantization round trip) straight into ``model.llama``'s layout.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_params(spec: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights: {"embed": (V, D), "layers.{i}.q_proj": (N*H, D), ...}."""
    rng = np.random.default_rng(seed)
    V, D, L = spec["vocab"], spec["hidden"], spec["layers"]
    N, K, H = spec["heads"], spec["kv_heads"], spec["head_dim"]
    E, F = spec.get("experts", 0), spec["ffn"]

    def lin(*shape):
        return (rng.normal(size=shape) / math.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32)

    p = {"embed": lin(V, D), "norm": norm(D)}
    if not spec.get("tied", False):
        p["lm_head"] = lin(V, D)
    for i in range(L):
        pre = f"layers.{i}."
        p.update({pre + "input_layernorm": norm(D), pre + "post_attention_layernorm": norm(D),
                  pre + "q_proj": lin(N * H, D), pre + "k_proj": lin(K * H, D),
                  pre + "v_proj": lin(K * H, D), pre + "o_proj": lin(D, N * H)})
        if spec.get("qk_norm"):
            p[pre + "q_norm"], p[pre + "k_norm"] = norm(H), norm(H)
        if E:
            p[pre + "router"] = lin(E, D) * 4  # sharper routing
            p[pre + "gate_exps"], p[pre + "up_exps"] = lin(E, F, D), lin(E, F, D)
            p[pre + "down_exps"] = lin(E, D, F)
        else:
            p[pre + "gate_proj"], p[pre + "up_proj"], p[pre + "down_proj"] = lin(F, D), lin(F, D), lin(D, F)
    return p


def _roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if qtype == GGMLQuantizationType.F32 or w.ndim == 1:
        return w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize(w, qtype), qtype).astype(np.float32).reshape(w.shape)


def quantized(p: dict[str, np.ndarray], qtype) -> dict[str, np.ndarray]:
    """What the model sees after ``qtype`` storage (the router and norms stay float32)."""
    return {k: v if k.endswith("router") else _roundtrip(v, qtype) for k, v in p.items()}


def reference_params(p: dict[str, np.ndarray], spec: dict) -> dict[str, np.ndarray]:
    """HF weights -> ``model.llama.param_layout`` (HF's rows: rotate-half RoPE, like ours)."""
    D, L, N, K, H = spec["hidden"], spec["layers"], spec["heads"], spec["kv_heads"], spec["head_dim"]

    def stack(f):
        return np.stack([f(f"layers.{i}.") for i in range(L)])

    out = {"embed": p["embed"], "final_norm": p["norm"],
           "attn_norm": stack(lambda s: p[s + "input_layernorm"]),
           "ffw_norm": stack(lambda s: p[s + "post_attention_layernorm"]),
           "wq": stack(lambda s: p[s + "q_proj"].T.reshape(D, N, H)),
           "wk": stack(lambda s: p[s + "k_proj"].T.reshape(D, K, H)),
           "wv": stack(lambda s: p[s + "v_proj"].T.reshape(D, K, H)),
           "wo": stack(lambda s: p[s + "o_proj"].T.reshape(N, H, D))}
    if "lm_head" in p:
        out["lm_head"] = p["lm_head"].T
    if spec.get("qk_norm"):
        out["q_norm"] = stack(lambda s: p[s + "q_norm"])
        out["k_norm"] = stack(lambda s: p[s + "k_norm"])
    if spec.get("experts"):
        out["router"] = stack(lambda s: p[s + "router"].T)
        out["w_gate"] = stack(lambda s: p[s + "gate_exps"].transpose(0, 2, 1))
        out["w_up"] = stack(lambda s: p[s + "up_exps"].transpose(0, 2, 1))
        out["w_down"] = stack(lambda s: p[s + "down_exps"].transpose(0, 2, 1))
    else:
        out["w_gate"] = stack(lambda s: p[s + "gate_proj"].T)
        out["w_up"] = stack(lambda s: p[s + "up_proj"].T)
        out["w_down"] = stack(lambda s: p[s + "down_proj"].T)
    return out


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                        old: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for rope_type "llama3"."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


def write_gguf(path: Path, arch: str, spec: dict, p: dict[str, np.ndarray], qtype=None,
               permute: bool | None = None, rope_scaling: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None, drop: frozenset = frozenset(),
               per_expert: bool = False, add_vocab=None,
               typed_tensors: dict[str, np.ndarray | tuple] | None = None,
               rope_metadata: dict | None = None) -> Path:
    """Writes ``p`` (HF layout) as a GGUF of ``arch`` ("llama", "qwen3", "qwen3moe").

    permute: apply llama.cpp's Q/K permutation (default: for "llama", as the converter does).
    rope_scaling: {"factor", "low", "high", "old"} -> a ``rope_freqs`` tensor (Llama 3.1).
    rope_metadata: {"type": "linear" / "yarn", "factor", "original_context_length"?} ->
      ``{arch}.rope.scaling.*`` keys, as the converter writes HF's linear / yarn ``rope_scaling``.
    spec: shapes as ``hf_params`` reads them, ``theta``, and optionally ``context``
      (default 4096) and ``eps`` (RMSNorm epsilon, default 1e-5).
    qtype: storage type of 2-D/3-D weights (F32, F16, Q8_0; norms and router stay F32).
    extra_tensors: more F32 tensors to write; drop: GGUF tensor names not to write;
    typed_tensors: more tensors written in their numpy dtype's GGML type (int32 -> I32, ...),
      or given as ``(uint8 bytes, GGMLQuantizationType)``.
    per_expert: write experts one tensor each (``blk.{i}.ffn_gate.{e}.weight``, older
      Mixtral GGUFs) instead of stacked ``ffn_gate_exps``.
    add_vocab: ``writer -> None`` writing the tokenizer fields (default: a llama.cpp-style
      SentencePiece test vocabulary of ``spec["vocab"]`` pieces).
    """
    import gguf

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    permute = arch == "llama" if permute is None else permute
    N, K, H = spec["heads"], spec["kv_heads"], spec["head_dim"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(spec["layers"])
    w.add_context_length(spec.get("context", 4096))
    w.add_embedding_length(spec["hidden"])
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(spec.get("eps", 1e-5))
    w.add_rope_freq_base(spec["theta"])
    if rope_metadata:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_metadata["type"]))
        w.add_rope_scaling_factor(rope_metadata["factor"])
        if "original_context_length" in rope_metadata:
            w.add_rope_scaling_orig_ctx_len(rope_metadata["original_context_length"])
    if arch == "llama":
        w.add_rope_dimension_count(H)
    else:
        w.add_key_length(H)
        w.add_value_length(H)
    if spec.get("experts"):
        w.add_expert_count(spec["experts"])
        w.add_expert_used_count(spec["top_k"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(spec["ffn"])
            w.add_feed_forward_length(spec["ffn"] * 4)  # the (unused) dense width
        else:
            w.add_feed_forward_length(spec["ffn"])
    else:
        w.add_feed_forward_length(spec["ffn"])
    if add_vocab is not None:
        add_vocab(w)
    else:
        vocab = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(spec["vocab"] - 3)]
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab)
        w.add_token_scores([0.0] * len(vocab))
        w.add_token_types([2, 3, 3] + [1] * (len(vocab) - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    def put(name: str, arr: np.ndarray, keep_f32: bool = False):
        if name in drop:
            return
        if keep_f32 or arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype),
                         raw_dtype=qtype)

    put("token_embd.weight", p["embed"])
    put("output_norm.weight", p["norm"])
    if "lm_head" in p:
        put("output.weight", p["lm_head"])
    if rope_scaling:
        put("rope_freqs.weight", llama3_freq_factors(H, spec["theta"], **rope_scaling))
    for i in range(spec["layers"]):
        s, b = f"layers.{i}.", f"blk.{i}."
        q, k = p[s + "q_proj"], p[s + "k_proj"]
        if permute:
            q, k = converter_permute(q, N), converter_permute(k, K)
        put(b + "attn_norm.weight", p[s + "input_layernorm"])
        put(b + "ffn_norm.weight", p[s + "post_attention_layernorm"])
        put(b + "attn_q.weight", q)
        put(b + "attn_k.weight", k)
        put(b + "attn_v.weight", p[s + "v_proj"])
        put(b + "attn_output.weight", p[s + "o_proj"])
        if spec.get("qk_norm"):
            put(b + "attn_q_norm.weight", p[s + "q_norm"])
            put(b + "attn_k_norm.weight", p[s + "k_norm"])
        if spec.get("experts"):
            put(b + "ffn_gate_inp.weight", p[s + "router"], keep_f32=True)
            for ours, theirs in (("gate_exps", "ffn_gate"), ("up_exps", "ffn_up"),
                                 ("down_exps", "ffn_down")):
                if per_expert:
                    for e, arr in enumerate(p[s + ours]):
                        put(f"{b}{theirs}.{e}.weight", arr)
                else:
                    put(f"{b}{theirs}_exps.weight", p[s + ours])
        else:
            put(b + "ffn_gate.weight", p[s + "gate_proj"])
            put(b + "ffn_up.weight", p[s + "up_proj"])
            put(b + "ffn_down.weight", p[s + "down_proj"])
    for name, arr in (extra_tensors or {}).items():
        put(name, arr, keep_f32=True)
    for name, arr in (typed_tensors or {}).items():
        if isinstance(arr, tuple):  # (uint8 bytes, GGMLQuantizationType)
            w.add_tensor(name, arr[0], raw_dtype=arr[1])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
