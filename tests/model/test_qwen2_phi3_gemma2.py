"""What Qwen2, Phi-3 and Gemma 2 add, beyond the parity of tests/model/test_hf_checkpoint.py.

The tiny checkpoints ``qwen2``, ``phi3`` and ``gemma2`` of tests/data/hf_tiny (made by its
make_fixtures.py with transformers): their configs read as transformers reads them
(biases, LongRoPE with partial rotary, soft-caps and alternating windows); Phi-3's
LongRoPE frequencies, long ones included, equal transformers'; Gemma 2's soft-caps
matter to these logits (without them the logits leave transformers' by far more than the
tolerance) and reach the Pallas attention kernels (interpret mode); each checkpoint
written as a GGUF the way llama.cpp's converter writes it (tests/support/hf_to_gguf.py)
loads through ``model.gguf_loader`` to the same config and the same parameters.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import select_attention
from model.compute import Compute
from model.factory import build_model
from model.gguf_loader import load_gguf
from model.hf_config import config_from_hf, read_hf_config
from model.layers import apply_rope, rope_attention_factor, rope_inv_freq
from model.safetensors_loader import load_hf_checkpoint
from tests.support.hf_tiny_parity import ATOL, DATA, golden, prefill_then_greedy
from tests.support.hf_to_gguf import write_gguf_from_hf

NEW = ["qwen2", "phi3", "gemma2"]


def test_config_choices_from_the_new_fixtures():
    q, p, g = (read_hf_config(DATA / c) for c in NEW)
    assert q.architecture == "llama" and q.qkv_bias and not q.qk_norm and q.tie_embeddings
    assert not q.has_sliding_layers
    assert p.architecture == "llama" and not p.qkv_bias and not p.tie_embeddings
    assert p.rotary_dim == 6 and p.rope_dim == 6 and p.head_dim == 12  # partial_rotary_factor 0.5
    assert p.rope_scaling_type == "longrope" and p.rope_original_max_position == 64
    assert p.rope_scaling_factor == 4.0  # max_position_embeddings 256 / original 64
    assert p.rope_short_factors == (1.0, 1.7, 3.1) and p.rope_long_factors == (1.3, 4.2, 11.5)
    assert p.sliding_layers == (True, True) and p.sliding_window == 7
    assert g.architecture == "gemma3" and not g.qk_norm and g.tie_embeddings
    assert g.sliding_layers == (True, False) and g.sliding_window == 4  # from the v4 config's rule
    assert (g.attn_logit_softcap, g.final_logit_softcap) == (3.0, 8.0)
    assert g.query_pre_attn_scalar == 24 and g.rope_theta_global == g.rope_theta_local == 10000.0


def test_longrope_frequencies_and_attention_factor_match_transformers():
    cfg = read_hf_config(DATA / "phi3")
    ref = golden("phi3")
    short = next(v for k, v in ref["rope"].items() if k.endswith("inv_freq"))
    long = ref["longrope"]["long_inv_freq"]
    np.testing.assert_allclose(np.asarray(rope_inv_freq(6, 10000.0, cfg)), short, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(6, 10000.0, cfg, long=True)), long, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(ref["longrope"]["attention_factor"], rel=1e-7)
    assert rope_attention_factor(cfg) == pytest.approx((1 + np.log(4) / np.log(64)) ** 0.5)
    # positions from the original context on rotate with the long factors; the unrotated
    # half of each head (partial rotary) passes through
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1, 12)), jnp.float32)
    pos = jnp.asarray([63, 64], jnp.int32)
    out = np.asarray(apply_rope(x, pos, 10000.0, cfg))
    np.testing.assert_array_equal(out[..., 6:], np.asarray(x)[..., 6:])
    for row, freqs in ((0, short), (1, long)):
        ang = float(pos[row]) * np.asarray(freqs, np.float32)
        c, s = np.cos(ang) * rope_attention_factor(cfg), np.sin(ang) * rope_attention_factor(cfg)
        x1, x2 = np.asarray(x)[row, 0, :3], np.asarray(x)[row, 0, 3:6]
        np.testing.assert_allclose(out[row, 0, :6], np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s]),
                                   rtol=1e-5, atol=2e-5)


def test_gemma2_attention_soft_cap_shapes_these_logits():
    """Without the attention soft-cap the prompt logits leave transformers' by far more than
    1e-4: the parity of test_hf_checkpoint.py checks the cap, not numbers it never touches.
    (The final soft-cap's logits go through the gemma3_text fixture's path as well.)"""
    cfg, params = load_hf_checkpoint(DATA / "gemma2", progress=False)
    want = np.load(DATA / "gemma2" / "logits.npy")
    model = build_model(dataclasses.replace(cfg, attn_logit_softcap=None), params=params,
                        dtype=jnp.float32)
    logits, _, _ = prefill_then_greedy(model, golden("gemma2")["prompt"], 1)
    assert np.abs(logits - want).max() > 0.05


@pytest.mark.parametrize("case", ["gemma2"])
def test_pallas_kernels_match_transformers(case):
    """The Pallas paged-attention kernels (interpret mode on CPU) with Gemma 2's attention
    soft-cap and alternating windows: prefill and each decode step within 1e-4 of
    transformers' logits, greedy ids equal to the first near-tie."""
    ref = golden(case)
    cfg, params = load_hf_checkpoint(DATA / case, progress=False)
    model = build_model(cfg, params=params, dtype=jnp.float32)
    pallas = Compute(attention=select_attention("pallas", "cpu"))
    steps = 6  # of the 12 recorded: interpret mode is slow; no near-tie among them (checked)
    assert min(ref["greedy"]["step_top1_top2_margin"][:steps]) > ref["cutoff"]
    logits, ids, step_logits = prefill_then_greedy(model, ref["prompt"], steps, compute=pallas)
    assert np.abs(logits - np.load(DATA / case / "logits.npy")).max() <= ATOL
    assert ids == ref["greedy"]["ids"][:steps]
    want_steps = np.load(DATA / case / "greedy_logits.npy")[:steps]
    assert np.abs(step_logits - want_steps).max() <= ATOL


@pytest.mark.parametrize("case", NEW)
def test_gguf_as_llama_cpp_converts_it_loads_to_the_same_model(tmp_path, case):
    """The checkpoint written as llama.cpp's converter writes it (float32 tensors) loads to
    the safetensors load's parameters bit for bit, and to its config except the name and
    what a GGUF does not say or rounds: Gemma 2's query_pre_attn_scalar follows llama.cpp's
    rule (key_length below 46 layers), the RoPE base of the llama decoder's unused local
    slot, and float32 metadata (the norm epsilon, Phi-3's attention factor)."""
    path = write_gguf_from_hf(DATA / case, tmp_path / f"{case}.gguf")
    g_cfg, g_params = load_gguf(path, progress=False)
    h_cfg, h_params = load_hf_checkpoint(DATA / case, progress=False)
    assert set(g_params) == set(h_params)
    for name in h_params:
        np.testing.assert_array_equal(np.asarray(g_params[name]), np.asarray(h_params[name]),
                                      err_msg=f"{case} {name}")
    assert g_cfg.rms_norm_eps == pytest.approx(h_cfg.rms_norm_eps, rel=1e-6)  # a float32 in GGUF
    same = dict(name=h_cfg.name, rope_theta_local=h_cfg.rope_theta_local,
                rms_norm_eps=h_cfg.rms_norm_eps)
    if case == "gemma2":
        assert g_cfg.query_pre_attn_scalar == g_cfg.head_dim
        same["query_pre_attn_scalar"] = h_cfg.query_pre_attn_scalar
    if case == "phi3":
        assert g_cfg.rope_attention_factor == pytest.approx(rope_attention_factor(h_cfg), rel=1e-6)
        same["rope_attention_factor"] = h_cfg.rope_attention_factor
        for f in ("rope_short_factors", "rope_long_factors"):  # float32 tensors in GGUF
            np.testing.assert_array_equal(np.float32(getattr(g_cfg, f)), np.float32(getattr(h_cfg, f)))
            same[f] = getattr(h_cfg, f)
    got = dataclasses.asdict(dataclasses.replace(g_cfg, **same))
    want = dataclasses.asdict(h_cfg)
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}


def test_unsupported_choices_are_named():
    phi3 = json.loads((DATA / "phi3" / "config.json").read_text())
    with pytest.raises(ValueError, match="Phi3ForCausalLM: RoPE scaling 'linear' is not supported"):
        config_from_hf({**phi3, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    qwen2 = json.loads((DATA / "qwen2" / "config.json").read_text())
    with pytest.raises(ValueError, match="type 'longrope' is supported for Phi3ForCausalLM only"):
        config_from_hf({**qwen2, "rope_scaling": phi3["rope_scaling"]})
    su = config_from_hf({**phi3, "rope_scaling": {**phi3["rope_scaling"], "rope_type": "su"}})
    assert su == config_from_hf(phi3)  # Phi-3's first name for LongRoPE
    with pytest.raises(ValueError, match="longrope needs 3 short and long factors"):
        config_from_hf({**phi3, "rope_scaling": {**phi3["rope_scaling"], "long_factor": [1.0]}})
