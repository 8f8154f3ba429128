"""Llama-family GGUFs (llama, Mixtral-style MoE, qwen3, qwen3moe) through ``model.gguf_loader``.

Tiny GGUFs are written as llama.cpp's converter writes them (tests/support/gguf_fixtures.py:
Q/K rows permuted for "llama", experts stacked, F32/F16/Q8_0 storage), loaded
with ``load_gguf`` and run; their logits must equal those of the same decoder
built straight from the HF-layout weights (float32, same quantization round trip).
"""

from __future__ import annotations

import argparse
import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import gguf_tensor_map as tmap
from model.attention_metadata import AttentionMetadata
from model.factory import build_model
from model.gguf_loader import load_gguf
from model.kv_cache import KVCache
from model.layers import apply_rope, rope_inv_freq
from tests.support import gguf_fixtures as fx

Q = gguf.GGMLQuantizationType
PAGE = 8
PROMPT = [5, 17, 3, 42, 9, 28, 11, 60, 1, 33, 7, 50]

DENSE = dict(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=96, theta=500000.0)
MIXTRAL = dict(DENSE, heads=8, head_dim=16, experts=4, top_k=2, ffn=32, theta=1e6)
QWEN3_MOE = dict(DENSE, heads=4, kv_heads=2, head_dim=32, qk_norm=True, experts=8, top_k=2, ffn=32,
                 theta=1e6)
QWEN3 = dict(DENSE, heads=4, kv_heads=4, head_dim=16, qk_norm=True, tied=True, theta=1e6)
LLAMA31_SCALING = dict(factor=8.0, low=1.0, high=4.0, old=256)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, tokens):
    T = tokens.shape[0]
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    pages = -(-T // PAGE)
    cache = KVCache.zeros(cfg, pages + 1, PAGE, jnp.float32)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)
    md = AttentionMetadata(slot_mapping=table[pos // PAGE] * PAGE + pos % PAGE, page_table=table[None],
                           kv_lens=jnp.asarray([T], jnp.int32), cu_q_lens=jnp.asarray([0, T], jnp.int32),
                           num_seqs=jnp.asarray(1, jnp.int32), mode="prefill")
    logits, _ = model(tokens, pos, cache, md, pos)
    return logits


def logits(cfg, params) -> np.ndarray:
    """[T, vocab] f32: every prompt position's logits after one prefill step."""
    graphdef, state = nnx.split(build_model(cfg, params=params, dtype=jnp.float32))
    return np.asarray(_prefill(graphdef, state, jnp.asarray(PROMPT, jnp.int32)))


def _load(tmp_path, arch, spec, qtype=None, **kw):
    hf = fx.hf_params(spec)
    path = fx.write_gguf(tmp_path / f"{arch}.gguf", arch, spec, hf, qtype=qtype, **kw)
    cfg, params = load_gguf(path, progress=False)
    want = fx.reference_params(fx.quantized(hf, Q.F32 if qtype is None else qtype), spec)
    return cfg, params, want


CASES = {
    # name: (architecture, shapes, storage type, Llama 3.1 RoPE scaling, write_gguf kwargs)
    "llama3-dense-gqa-f32": ("llama", DENSE, None, LLAMA31_SCALING, {}),
    "mixtral-moe-f16": ("llama", MIXTRAL, Q.F16, None, {}),
    "mixtral-per-expert-tensors": ("llama", MIXTRAL, None, None, {"per_expert": True}),
    "qwen3moe-q8_0": ("qwen3moe", QWEN3_MOE, Q.Q8_0, None, {}),
    "qwen3-dense-tied-q8_0": ("qwen3", QWEN3, Q.Q8_0, None, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_logits_equal_hf_layout_model(tmp_path, case):
    arch, spec, qtype, scaling, kw = CASES[case]
    cfg, params, want = _load(tmp_path, arch, spec, qtype, rope_scaling=scaling, **kw)
    assert set(params) == set(want)
    for k in want:  # the un-permutation is exact, so every array is bit-equal
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)
    got_logits, want_logits = logits(cfg, params), logits(cfg, want)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-6, atol=1e-6)
    assert np.abs(want_logits).max() > 0.1


def test_skipping_the_unpermutation_changes_logits(tmp_path, monkeypatch):
    cfg, params, want = _load(tmp_path, "llama", DENSE)
    monkeypatch.setattr(tmap, "PERMUTED_QK", frozenset())
    path = fx.write_gguf(tmp_path / "again.gguf", "llama", DENSE, fx.hf_params(DENSE))
    cfg2, wrong = load_gguf(path, progress=False)
    assert cfg2 == cfg
    assert not np.array_equal(wrong["wq"], want["wq"])
    err = np.abs(logits(cfg, wrong) - logits(cfg, want)).max()
    assert err > 1e-2, f"logits barely moved ({err:.2e}): the test could not catch a missing unpermute"


def test_interleaved_rope_on_gguf_rows_equals_rotate_half_on_hf_rows():
    """Why the converter permutes: llama.cpp's NORM RoPE (pairs 2j, 2j+1) on permuted rows gives
    the same q.k scores as HF's rotate-half RoPE (ours) on HF rows."""
    rng = np.random.default_rng(1)
    T, N, H, D = 7, 2, 16, 24
    wq = rng.normal(size=(N * H, D)).astype(np.float32)
    wk = rng.normal(size=(N * H, D)).astype(np.float32)
    x = rng.normal(size=(T, D)).astype(np.float32)
    pos = np.arange(T, dtype=np.int32) * 3

    def interleaved(v, theta=10000.0):  # ggml_rope mode 0: rotate (v[2j], v[2j+1]) by pos * theta^(-2j/H)
        inv = theta ** (-np.arange(0, H, 2) / H)
        ang = pos[:, None, None] * inv[None, None, :]
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
        out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
        return out

    def scores(q, k):
        return np.einsum("tnh,snh->nts", q, k)

    hf_q = np.asarray(apply_rope(jnp.asarray((x @ wq.T).reshape(T, N, H)), jnp.asarray(pos), 10000.0))
    hf_k = np.asarray(apply_rope(jnp.asarray((x @ wk.T).reshape(T, N, H)), jnp.asarray(pos), 10000.0))
    gq = interleaved((x @ fx.converter_permute(wq, N).T).reshape(T, N, H))
    gk = interleaved((x @ fx.converter_permute(wk, N).T).reshape(T, N, H))
    np.testing.assert_allclose(scores(gq, gk), scores(hf_q, hf_k), rtol=1e-4, atol=1e-3)
    # and our un-permutation is the converter's inverse
    np.testing.assert_array_equal(tmap.unpermute_qk(fx.converter_permute(wq, N), N), wq)
    np.testing.assert_array_equal(tmap.permute_qk(wq, N), fx.converter_permute(wq, N))


def test_config_from_metadata(tmp_path):
    cfg, _, _ = _load(tmp_path, "llama", DENSE, rope_scaling=LLAMA31_SCALING)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 2, 64)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim) == (4, 2, 32, 96)
    assert cfg.rope_theta_global == 500000.0 and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert not cfg.qk_norm and not cfg.tie_embeddings and not cfg.is_moe and cfg.vocab_size == 64
    # llama.cpp stores Llama 3.1 scaling as per-frequency divisors only (no original context
    # length): the loader assumes 8192, so low/high come out scaled by 8192 / 256, with the
    # same band edges (old / low, old / high) and so the same frequencies.
    assert cfg.rope_scaling_factor == pytest.approx(8.0)
    assert cfg.rope_original_max_position / cfg.rope_low_freq_factor == pytest.approx(256 / 1.0)
    assert cfg.rope_original_max_position / cfg.rope_high_freq_factor == pytest.approx(256 / 4.0)
    ff = fx.llama3_freq_factors(32, 500000.0, **LLAMA31_SCALING)
    plain = 1.0 / 500000.0 ** (np.arange(16) * 2.0 / 32)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(32, 500000.0, cfg)), plain / ff, rtol=1e-5)

    moe, _, _ = _load(tmp_path, "qwen3moe", QWEN3_MOE)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.expert_mlp_dim, moe.mlp_dim) == (8, 2, 32, 0)
    assert moe.qk_norm and moe.head_dim == 32 and moe.num_heads * moe.head_dim != moe.hidden_size
    assert moe.rope_scaling_factor is None and moe.name == "qwen3-moe"
    mix, _, _ = _load(tmp_path, "llama", MIXTRAL)
    assert (mix.num_experts, mix.num_experts_per_tok, mix.expert_mlp_dim) == (4, 2, 32)
    assert not mix.qk_norm
    dense, _, _ = _load(tmp_path, "qwen3", QWEN3)
    assert dense.tie_embeddings and dense.qk_norm


def test_llama3_rope_scaling_round_trip():
    """Llama 3.1 8B's own numbers (head_dim 128, theta 5e5, factor 8, 1, 4, 8192)."""
    ff = fx.llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    got = tmap.llama3_rope_scaling(ff, 128, 500000.0, 8192)
    assert got["rope_scaling_factor"] == pytest.approx(8.0)
    assert got["rope_low_freq_factor"] == pytest.approx(1.0, abs=1e-3)
    assert got["rope_high_freq_factor"] == pytest.approx(4.0, abs=1e-3)
    assert tmap.llama3_rope_scaling(np.ones(64, np.float32), 128, 500000.0, 8192) is None
    with pytest.raises(ValueError, match="not Llama 3"):
        tmap.llama3_rope_scaling(np.linspace(1, 8, 64), 128, 500000.0, 8192)


def test_unsupported_architecture_missing_and_extra_tensors(tmp_path):
    hf = fx.hf_params(DENSE)
    bad_arch = fx.write_gguf(tmp_path / "bert.gguf", "bert", DENSE, hf)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'bert'"):
        load_gguf(bad_arch, progress=False)
    with_bias = fx.write_gguf(tmp_path / "bias.gguf", "llama", DENSE, hf,
                              extra_tensors={"blk.0.attn_q.bias": np.zeros(128, np.float32)})
    with pytest.raises(ValueError, match="blk.0.attn_q.bias"):
        load_gguf(with_bias, progress=False)
    missing = fx.write_gguf(tmp_path / "missing.gguf", "llama", MIXTRAL, fx.hf_params(MIXTRAL),
                            drop=frozenset({"blk.1.ffn_down_exps.weight"}))
    with pytest.raises(ValueError, match="lacks tensor 'blk.1.ffn_down_exps.weight'"):
        load_gguf(missing, progress=False)


def test_convert_then_restore_checkpoint(tmp_path, caplog):
    """``xlaserve convert tiny.gguf OUT`` writes an orbax checkpoint that restores to the same logits
    (the llama.cpp-style SentencePiece test vocabulary has no Gemma chat pieces, so it is stored
    as ``tokenizers`` files, not as a ``tokenizer.model``)."""
    from model.checkpoint import load_config, restore_params, tokenizer_model
    from model.factory import abstract_params
    from serving.cli.convert import cmd_convert
    from sharding.placement import abstract_targets
    from sharding.rules import ShardingRules

    cfg, params, _ = _load(tmp_path, "llama", MIXTRAL)
    assert cmd_convert(argparse.Namespace(source=str(tmp_path / "llama.gguf"),
                                          out_dir=str(tmp_path / "ckpt"))) == 0
    assert load_config(tmp_path / "ckpt") == cfg  # named after the file's stem, "llama"
    restored = restore_params(tmp_path / "ckpt",
                              abstract_targets(abstract_params(cfg), None, ShardingRules.default()))
    np.testing.assert_array_equal(logits(cfg, restored), logits(cfg, params))
    assert tokenizer_model(tmp_path / "ckpt") is None and (tmp_path / "ckpt" / "tokenizer.json").is_file()


def test_serve_and_generate_refuse_what_has_no_usable_tokenizer(tmp_path, capsys):
    """A GGUF whose vocabulary xlaserve cannot rebuild, and a weights-only checkpoint converted
    from it, are refused with a clear error instead of served through the test vocabulary."""
    from serving.cli.main import main
    from serving.config.server_config import load_server_config
    from serving.loading.mesh_loader import load_for_serving
    from serving.loading.model_registry import load_model

    def rwkv_vocab(w):  # a vocabulary type llama.cpp has and xlaserve does not read
        w.add_tokenizer_model("rwkv")
        w.add_token_list([f"t{i}" for i in range(MIXTRAL["vocab"])])

    _load(tmp_path, "llama", MIXTRAL, add_vocab=rwkv_vocab)
    gguf_path = str(tmp_path / "llama.gguf")
    with pytest.raises(ValueError, match="carries no tokenizer xlaserve can use.*'rwkv'"):
        load_model(gguf_path, progress=False)
    assert main(["convert", gguf_path, str(tmp_path / "ckpt")]) == 0  # weights only, with a warning
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_for_serving(load_server_config(checkpoint=str(tmp_path / "ckpt")))
    assert main(["generate", "hello", "--checkpoint", str(tmp_path / "ckpt")]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
    assert main(["generate", "hello", "--model", gguf_path]) == 2
    assert "carries no tokenizer" in capsys.readouterr().err
