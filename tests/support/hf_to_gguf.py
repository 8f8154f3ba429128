"""A tiny Hugging Face checkpoint (tests/data/hf_tiny) written as a GGUF, the way llama.cpp's
``convert_hf_to_gguf.py`` writes Qwen2, Phi-3 and Gemma 2 (its ``Qwen2Model``,
``Phi3MiniModel`` and ``Gemma2Model``): llama.cpp's tensor names and metadata keys,
written with gguf-py's ``GGUFWriter``, every tensor float32 (so a load of the GGUF can
be compared bit for bit with a load of the safetensors).

What the converter does, re-done here independently of ``model.gguf_loader``:

  * qwen2: ``q_proj`` / ``k_proj`` / ``v_proj`` weights and biases as ``attn_q`` /
    ``attn_k`` / ``attn_v`` ``.weight`` / ``.bias``; rows not permuted (NeoX RoPE).
  * phi3: ``qkv_proj`` as ``attn_qkv``, ``gate_up_proj`` as ``ffn_up`` (both fused, as
    stored); ``rope.dimension_count`` = ``int(partial_rotary_factor * hidden) // heads``;
    ``attention.sliding_window`` (0 when none); with LongRoPE the ``rope_factors_long`` /
    ``rope_factors_short`` tensors, ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor`` = ``sqrt(1 + ln(s) / ln(original))``, s =
    ``max_position_embeddings / original``.
  * gemma2: every norm weight + 1 (HF's ``1 + w``), ``attn_logit_softcapping``,
    ``final_logit_softcapping``, ``attention.sliding_window``, key / value length; no
    ``rope.freq_base`` (llama.cpp's default 10000) and no ``output`` (tied).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ARCH = {"Qwen2ForCausalLM": "qwen2", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2"}


def write_gguf_from_hf(hf_dir: Path, path: Path) -> Path:
    """Writes ``hf_dir`` (config.json + model.safetensors) as a GGUF at ``path``; returns it."""
    import gguf
    from safetensors.numpy import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[hp["architectures"][0]]
    t = load_file(str(hf_dir / "model.safetensors"))
    L, D, N = hp["num_hidden_layers"], hp["hidden_size"], hp["num_attention_heads"]
    K = hp.get("num_key_value_heads") or N
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(D)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    rope = hp.get("rope_scaling") or {}
    theta = hp.get("rope_theta", (hp.get("rope_parameters") or {}).get("rope_theta"))

    def put(name: str, arr: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))

    def hf(name: str) -> np.ndarray:
        return t[f"model.{name}"]

    put("token_embd.weight", hf("embed_tokens.weight"))
    if arch == "gemma2":
        head_dim = hp["head_dim"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_float32(f"{arch}.attn_logit_softcapping", hp["attn_logit_softcapping"])
        w.add_float32(f"{arch}.final_logit_softcapping", hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
        put("output_norm.weight", hf("norm.weight") + 1)
        for i in range(L):
            p, b = f"layers.{i}.", f"blk.{i}."
            for ours, theirs in (("input_layernorm", "attn_norm"),
                                 ("post_attention_layernorm", "post_attention_norm"),
                                 ("pre_feedforward_layernorm", "ffn_norm"),
                                 ("post_feedforward_layernorm", "post_ffw_norm")):
                put(f"{b}{theirs}.weight", hf(f"{p}{ours}.weight") + 1)
            _attention_and_mlp(put, hf, p, b)
    else:
        w.add_rope_freq_base(theta)
        put("output_norm.weight", hf("norm.weight"))
        if "lm_head.weight" in t:
            put("output.weight", t["lm_head.weight"])
        if arch == "phi3":
            partial = hp.get("partial_rotary_factor", 1.0)
            w.add_rope_dimension_count(int(partial * D) // N)
            w.add_sliding_window(hp.get("sliding_window") or 0)
            original = hp["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(original)
            if rope:
                scale = hp["max_position_embeddings"] / original
                w.add_rope_scaling_attn_factors(
                    math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
                put("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
                put("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
        for i in range(L):
            p, b = f"layers.{i}.", f"blk.{i}."
            put(b + "attn_norm.weight", hf(p + "input_layernorm.weight"))
            put(b + "ffn_norm.weight", hf(p + "post_attention_layernorm.weight"))
            if arch == "phi3":
                put(b + "attn_qkv.weight", hf(p + "self_attn.qkv_proj.weight"))
                put(b + "attn_output.weight", hf(p + "self_attn.o_proj.weight"))
                put(b + "ffn_up.weight", hf(p + "mlp.gate_up_proj.weight"))
                put(b + "ffn_down.weight", hf(p + "mlp.down_proj.weight"))
            else:
                _attention_and_mlp(put, hf, p, b)
                for x in "qkv":
                    put(f"{b}attn_{x}.bias", hf(f"{p}self_attn.{x}_proj.bias"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _attention_and_mlp(put, hf, p: str, b: str) -> None:
    for x in "qkv":
        put(f"{b}attn_{x}.weight", hf(f"{p}self_attn.{x}_proj.weight"))
    put(b + "attn_output.weight", hf(p + "self_attn.o_proj.weight"))
    for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
        put(f"{b}{theirs}.weight", hf(f"{p}mlp.{ours}.weight"))
