"""Hugging Face checkpoints through ``model.safetensors_loader`` against transformers' own outputs.

The tiny random checkpoints in tests/data/hf_tiny (one per architecture: Llama, Mistral,
Qwen3, Gemma 3 text and multimodal, Qwen2, Phi-3, Gemma 2, Mixtral, Qwen3-MoE; float32,
"llama" in shards with an index) and transformers' logits and greedy ids for them
were recorded once by tests/data/hf_tiny/make_fixtures.py; no torch here. Each
checkpoint is loaded, run over the prompt (one prefill over the paged KV cache)
and then decoded greedily one token per step (decode mode, reading the cache):
logits within 1e-4 of transformers' float32 logits, greedy ids equal up to the
first step whose top-1/top-2 margin is below the recorded cutoff.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from model.factory import build_model
from model.hf_config import read_hf_config
from model.safetensors_loader import is_hf_checkpoint, load_hf_checkpoint
from tests.support.hf_tiny_parity import ATOL, DATA, agree_until_near_tie, golden, prefill_then_greedy

DENSE = ["llama", "mistral", "qwen3", "gemma3_text", "gemma3_mm", "qwen2", "phi3", "gemma2"]
MOE = ["mixtral", "qwen3_moe"]


@pytest.mark.parametrize("case", DENSE + MOE)
def test_logits_and_greedy_ids_match_transformers(case):
    ref = golden(case)
    cfg, params = load_hf_checkpoint(DATA / case, dtype="float32", progress=False)
    model = build_model(cfg, params=params, dtype=jnp.float32)
    logits, ids, step_logits = prefill_then_greedy(model, ref["prompt"], len(ref["greedy"]["ids"]))
    want = np.load(DATA / case / "logits.npy")
    assert logits.shape == want.shape
    err = np.abs(logits - want).max()
    assert err <= ATOL, f"{case}: prompt logits differ from transformers' by {err:.2e}"
    assert np.abs(want).max() > 1.0  # the logits are not flat: a wrong weight would show
    compared = agree_until_near_tie(ids, ref, case)
    assert compared >= 6, f"{case}: only {compared} greedy steps above the near-tie cutoff"
    # each decode step (through the KV cache, sliding windows included) while the ids agree
    want_steps = np.load(DATA / case / "greedy_logits.npy")[:compared + 1]
    err = np.abs(step_logits[:len(want_steps)] - want_steps).max()
    assert err <= ATOL, f"{case}: decode-step logits differ from transformers' by {err:.2e}"


def test_config_choices_from_the_fixtures():
    """What each fixture's config.json exercises, read by model.hf_config."""
    cfgs = {c: read_hf_config(DATA / c) for c in DENSE + MOE}
    assert cfgs["llama"].rope_scaling_type == "llama3" and not cfgs["llama"].tie_embeddings
    assert cfgs["mistral"].sliding_layers == (True, True) and cfgs["mistral"].sliding_window == 5
    q = cfgs["qwen3"]
    assert q.sliding_layers == (False, True) and q.sliding_window == 6  # from max_window_layers=1
    assert q.rope_scaling_type == "yarn" and q.tie_embeddings and q.qk_norm
    assert q.head_dim * q.num_heads != q.hidden_size  # head_dim read, not derived
    g = cfgs["gemma3_text"]
    assert g.architecture == "gemma3" and g.sliding_layers == (True, False)
    assert g.rope_scaling_type == "linear" and g.final_logit_softcap == 30.0
    assert cfgs["gemma3_mm"].architecture == "gemma3" and cfgs["gemma3_mm"].vocab_size == 256
    assert cfgs["mixtral"].num_experts == 4 and cfgs["qwen3_moe"].num_experts == 8
    assert cfgs["llama"].name == "llama"


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"{case}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(DATA / case, dst)
    return dst


def _rewrite(path: Path, change) -> None:
    """Rewrites one safetensors file through ``change({name: array}) -> {name: array}``."""
    from safetensors.numpy import load_file, save_file

    save_file(change(load_file(str(path))), str(path), metadata={"format": "pt"})


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path):
    """A bf16 checkpoint served in bf16: weights arrive as the stored bf16 values (no float32
    round trip can change them), norms as float32; served in float32 they widen exactly."""
    import ml_dtypes

    d = _copy("qwen3", tmp_path)
    _rewrite(d / "model.safetensors",
             lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    cfg, params = load_hf_checkpoint(d, dtype="bfloat16", progress=False)
    from safetensors.numpy import load_file

    stored = load_file(str(d / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert params["wq"].dtype == jnp.bfloat16 and params["embed"].dtype == jnp.bfloat16
    assert params["attn_norm"].dtype == jnp.float32
    q0 = stored["model.layers.0.self_attn.q_proj.weight"]  # (N*H, D) -> ours [D, N, H]
    np.testing.assert_array_equal(np.asarray(params["wq"][0]),
                                  q0.T.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim))
    _, wide = load_hf_checkpoint(d, dtype="float32", progress=False)
    np.testing.assert_array_equal(np.asarray(wide["wq"]), np.asarray(params["wq"]).astype(np.float32))


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    d = _copy("mistral", tmp_path)
    f = d / "model.safetensors"
    _rewrite(f, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_checkpoint(d, progress=False)

    d = _copy("llama", tmp_path)  # sharded: add a bias to one shard
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    _rewrite(d / shard, lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"would ignore: 'model.layers.0.self_attn.q_proj.bias'"):
        load_hf_checkpoint(d, progress=False)

    d = _copy("qwen3", tmp_path)  # tied: an lm_head beside it would be ignored
    _rewrite(d / "model.safetensors",
             lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].copy()})
    with pytest.raises(ValueError, match=r"would ignore: 'lm_head.weight'"):
        load_hf_checkpoint(d, progress=False)

    d = _copy("mistral", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                         r"\(48, 48\), the config implies \(80, 48\)"):
        load_hf_checkpoint(d, progress=False)

    d = _copy("llama", tmp_path)
    gone = sorted(p for p in d.glob("model-*.safetensors"))[0]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=gone.name):
        load_hf_checkpoint(d, progress=False)


def test_vision_tower_is_skipped_with_a_log_line(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        cfg, params = load_hf_checkpoint(DATA / "gemma3_mm", progress=False)
    assert "vision tower is skipped" in caplog.text and "vision-tower tensors" in caplog.text
    assert not any("vision" in k for k in params)


def test_is_hf_checkpoint(tmp_path):
    assert is_hf_checkpoint(DATA / "llama") and is_hf_checkpoint(DATA / "qwen3")
    assert not is_hf_checkpoint(DATA) and not is_hf_checkpoint(DATA / "llama" / "config.json")
    (tmp_path / "config.json").write_text("{}")  # an orbax checkpoint's layout
    (tmp_path / "params").mkdir()
    assert not is_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("case, names", [
    ("qwen3_moe", ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                   "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")),
    ("mixtral", ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                 "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")),
])
def test_fused_expert_layout_loads_alike(tmp_path, case, names):
    """transformers v5's own MoE layout (``save_pretrained(save_original_format=False)``):
    per layer ``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows, then up
    rows) and ``mlp.experts.down_proj`` [E, D, F]; make_fixtures.py checks this construction
    against transformers' own fused save. The parameters equal the per-expert load's."""
    cfg, want = load_hf_checkpoint(DATA / case, progress=False)
    router, gate, up, down = names

    def fuse(t):
        out = {k: v for k, v in t.items() if ".experts." not in k and not k.endswith(router)}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            stack = lambda pat: np.stack([t[p + pat.format(e=e)] for e in range(cfg.num_experts)])  # noqa: E731
            out[p + "mlp.gate.weight"] = t[p + router]
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate([stack(gate), stack(up)], axis=1)
            out[p + "mlp.experts.down_proj"] = stack(down)
        return out

    d = _copy(case, tmp_path)
    _rewrite(d / "model.safetensors", fuse)
    _, got = load_hf_checkpoint(d, progress=False)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
