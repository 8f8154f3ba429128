"""RoPE scaling from GGUF metadata, and llama GGUFs written from a Hugging Face checkpoint.

llama.cpp's converter writes HF's ``rope_scaling`` as ``{arch}.rope.scaling.type`` /
``.factor`` / ``.original_context_length`` (linear: Gemma 3 4B and up; yarn), and Llama
3.1's "llama3" scaling as per-frequency divisors in a ``rope_freqs`` tensor. Here:

* the rotary frequencies a GGUF's metadata gives equal transformers' own for the same
  scaling at real sizes (tests/data/hf_tiny/rope.json: Llama 3.1 8B, Qwen3 with yarn
  factor 4, Gemma 3 4B's linear factor 8);
* the tiny Llama checkpoint of tests/data/hf_tiny/llama (GQA 4:2, untied head, llama3
  scaling), written as a GGUF the way ``convert_hf_to_gguf.py`` writes it (Q/K rows
  permuted, ``rope_freqs``), loads to the logits of its safetensors load and of
  transformers; with its config's scaling changed to yarn (and the GGUF's metadata
  saying the same), to the logits of the safetensors load (linear, the simplest
  formula, is checked on frequencies only, to keep the file fast).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from model import gguf_tensor_map as tmap
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.factory import build_model
from model.gguf_loader import load_gguf
from model.kv_cache import KVCache
from model.layers import rope_inv_freq
from model.safetensors_loader import load_hf_checkpoint
from tests.support import gguf_fixtures as fx
from tests.support.paths import TEST_DATA

HF = TEST_DATA / "hf_tiny"
ROPE = json.loads((HF / "rope.json").read_text())["cases"]


def _meta(arch: str, case: dict, **extra) -> dict:
    c = case["config"]
    heads = c["num_attention_heads"]
    return {"general.architecture": arch, "vocab_size": 32, f"{arch}.block_count": 2,
            f"{arch}.embedding_length": c["hidden_size"], f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": heads, f"{arch}.attention.key_length": c["head_dim"],
            f"{arch}.attention.value_length": c["head_dim"], f"{arch}.feed_forward_length": 64,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.rope.freq_base": c["rope_parameters"]["rope_theta"],
            f"{arch}.context_length": c["max_position_embeddings"],
            f"{arch}.attention.sliding_window": 1024, **{f"{arch}.{k}": v for k, v in extra.items()}}


def _inv_freq(cfg: ModelConfig, scaled=True) -> np.ndarray:
    return np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta_global, cfg, scaled=scaled))


def test_linear_metadata_gives_transformers_frequencies_gemma3_4b():
    case = ROPE["gemma3_4b_linear_8"]
    cfg = ModelConfig.from_gguf_metadata(_meta("gemma3", case, **{
        "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor) == ("linear", 8.0)
    np.testing.assert_allclose(_inv_freq(cfg), case["inv_freq"], rtol=1e-6)
    plain = 1.0 / 1e6 ** (np.arange(128) / 128)  # the sliding layers stay unscaled
    np.testing.assert_allclose(_inv_freq(cfg, scaled=False), plain, rtol=1e-6)
    unscaled = ModelConfig.from_gguf_metadata(_meta("gemma3", case))
    assert unscaled.rope_scaling_factor is None


def test_yarn_metadata_gives_transformers_frequencies_qwen3():
    case = ROPE["qwen3_yarn_4"]
    cfg = ModelConfig.from_gguf_metadata(_meta("qwen3", case, **{
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 32768}))
    assert (cfg.rope_scaling_type, cfg.rope_original_max_position) == ("yarn", 32768)
    np.testing.assert_allclose(_inv_freq(cfg), case["inv_freq"], rtol=1e-6)
    assert cfg.rope_attention_factor == pytest.approx(case["attention_factor"], rel=1e-6)


def test_rope_freqs_tensor_gives_transformers_frequencies_llama31_8b():
    case = ROPE["llama31_8b_llama3"]
    ff = fx.llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    base = ModelConfig.from_gguf_metadata(_meta("llama", case))
    cfg = dataclasses.replace(base, **tmap.llama3_rope_scaling(ff, 128, 500000.0, 8192))
    np.testing.assert_allclose(_inv_freq(cfg), case["inv_freq"], rtol=1e-6)


@pytest.mark.parametrize("bad, match", [
    ({"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}, "'longrope' is not supported"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1},
     "yarn_log_multiplier"),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "rope.scaling.attn_factor": 0.5},
     "attn_factor"),
])
def test_unsupported_scaling_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(_meta("llama", ROPE["llama31_8b_llama3"], **bad))


def test_llama3_band_with_one_frequency():
    """A short original context (the tiny fixture's 16 tokens): one frequency inside the
    band does not determine low / high, yet the factors must come back exactly."""
    for head_dim, old in ((12, 16), (8, 16), (12, 4096)):
        ff = fx.llama3_freq_factors(head_dim, 500000.0, 8.0, 1.0, 4.0, old)
        got = tmap.llama3_rope_scaling(ff, head_dim, 500000.0, 8192)
        cfg = ModelConfig(name="t", vocab_size=8, num_layers=1, hidden_size=head_dim, num_heads=1,
                          num_kv_heads=1, head_dim=head_dim, mlp_dim=8, architecture="llama",
                          rope_theta_global=500000.0,
                          **got)
        plain = 1.0 / 500000.0 ** (np.arange(head_dim // 2) * 2.0 / head_dim)
        np.testing.assert_allclose(_inv_freq(cfg), plain / ff, rtol=1e-6)


# -------------------------------------------------- the tiny HF llama checkpoint as a GGUF

SCALINGS = {
    # name: (config.json rope_scaling, GGUF rope metadata, rope_freqs parameters)
    "llama3": (None, None, dict(factor=8.0, low=1.0, high=4.0, old=16)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             {"type": "yarn", "factor": 4.0, "original_context_length": 64}, None),
}


def _hf_weights(d) -> dict[str, np.ndarray]:
    """The checkpoint's tensors in ``gguf_fixtures.hf_params``' names."""
    raw = {}
    for f in sorted(d.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    p = {"embed": raw.pop("model.embed_tokens.weight"), "norm": raw.pop("model.norm.weight"),
         "lm_head": raw.pop("lm_head.weight")}
    for name, arr in raw.items():
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        p[f"layers.{i}.{rest.split('.')[-2]}"] = arr
    return p


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, tokens):
    T = tokens.shape[0]
    model = nnx.merge(graphdef, state)
    cache = KVCache.zeros(model.cfg, 2, T, jnp.float32)  # one page of T tokens (page 1)
    pos = jnp.arange(T, dtype=jnp.int32)
    md = AttentionMetadata(slot_mapping=T + pos, page_table=jnp.ones((1, 1), jnp.int32),
                           kv_lens=jnp.asarray([T], jnp.int32), cu_q_lens=jnp.asarray([0, T], jnp.int32),
                           num_seqs=jnp.asarray(1, jnp.int32), mode="prefill")
    return model(tokens, pos, cache, md, pos)[0]


def _logits(cfg: ModelConfig, params, prompt: list[int]) -> np.ndarray:
    """[T, vocab] float32 logits at every prompt position (one jitted prefill)."""
    graphdef, state = nnx.split(build_model(cfg, params=params, dtype=jnp.float32))
    return np.asarray(_prefill(graphdef, state, jnp.asarray(prompt, jnp.int32)))


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_gguf_of_the_hf_llama_gives_its_logits(tmp_path, scaling):
    hf_scaling, metadata, freqs = SCALINGS[scaling]
    d = tmp_path / "llama"
    shutil.copytree(HF / "llama", d)
    config = json.loads((d / "config.json").read_text())
    if hf_scaling is not None:
        config["rope_scaling"] = hf_scaling
        (d / "config.json").write_text(json.dumps(config))
    spec = dict(vocab=config["vocab_size"], hidden=config["hidden_size"],
                layers=config["num_hidden_layers"], heads=config["num_attention_heads"],
                kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
                ffn=config["intermediate_size"], theta=config["rope_theta"],
                context=config["max_position_embeddings"], eps=config["rms_norm_eps"])
    assert spec["kv_heads"] < spec["heads"]  # GQA: K rows permuted per KV head
    path = fx.write_gguf(tmp_path / "llama.gguf", "llama", spec, _hf_weights(d),
                         rope_scaling=freqs, rope_metadata=metadata)
    gcfg, gparams = load_gguf(path, progress=False)
    hcfg, hparams = load_hf_checkpoint(d, dtype="float32", progress=False)
    assert gcfg.rope_scaling_type == hcfg.rope_scaling_type == scaling
    np.testing.assert_allclose(_inv_freq(gcfg), _inv_freq(hcfg), rtol=2e-7)
    assert (gcfg.num_heads, gcfg.num_kv_heads, gcfg.head_dim) == (hcfg.num_heads, hcfg.num_kv_heads,
                                                                  hcfg.head_dim)
    for k in hparams:
        np.testing.assert_array_equal(np.asarray(gparams[k]), np.asarray(hparams[k]), err_msg=k)
    prompt = json.loads((HF / "llama" / "golden.json").read_text())["prompt"]
    got, want = _logits(gcfg, gparams, prompt), _logits(hcfg, hparams, prompt)
    # llama3: the frequencies recovered from llama.cpp's divisors differ by up to one float32
    # ulp (measured: logits within 7.7e-5 of the safetensors load's, and 3.8e-5 of
    # transformers' where the safetensors load is 9.4e-5 away); linear / yarn: same formula
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 if scaling == "llama3" else 1e-5)
    if scaling == "llama3":  # the fixture as transformers ran it
        np.testing.assert_allclose(got, np.load(HF / "llama" / "logits.npy"), rtol=0, atol=1e-4)
