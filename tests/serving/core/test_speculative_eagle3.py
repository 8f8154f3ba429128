"""Speculative decoding with an EAGLE-3 head (``--speculative eagle3``): the checkpoint format
(written here by the test's own code in the layout published for Llama 3.1 8B, since no real
head can be fetched), its checks against the target, the head's forward against a numpy
reading of the HF tensors, the target's hidden states at the asked layers, and the tiny-random
Llama target with and without the head (greedy ids equal token for token on random prompts,
drafts accepted and rejected, K shrinking with the load).

The engine sizes are tests/serving/core/test_speculative.py's (``TINY_CFG``)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from serving.config.speculative_config import SpeculativeConfig
from tests.serving.core.test_speculative import TINY_CFG, run_both


def tiny_llama_cfg():
    from model.config import ModelConfig
    from serving.config.config_files import read_config

    return ModelConfig.from_dict(read_config("models.yaml")["tiny-llama"]["config"])


def head_json(target, draft_vocab: int = 256, **extra) -> dict:
    """An EAGLE-3 ``config.json`` for ``target`` (one Llama layer of the target's width)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": target.hidden_size, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab,
            "target_hidden_size": target.hidden_size, "torch_dtype": "float32", **extra}


def write_head(path, config: dict, params: dict) -> None:
    """Writes ``params`` (our layout, ``model.eagle3.param_layout``) as an EAGLE-3 checkpoint:
    ``config.json`` + ``model.safetensors`` with HF [out, in] matrices and ``t2d``."""
    from safetensors.numpy import save_file

    from model.eagle3 import hf_name

    tensors = {}
    for name, t in params.items():
        t = np.asarray(t)
        if name in ("wq", "wk", "wv"):
            t = t.reshape(t.shape[0], -1).T
        elif name == "wo":
            t = t.reshape(-1, t.shape[-1]).T
        elif t.ndim == 2 and name != "embed":
            t = t.T
        tensors[hf_name(name)] = np.ascontiguousarray(t.astype(np.int64 if name == "d2t" else np.float32))
    t2d = np.zeros(config["vocab_size"], bool)
    t2d[np.arange(config["draft_vocab_size"]) + tensors["d2t"]] = True
    tensors["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))


def random_head(target, seed: int = 0, draft_vocab: int = 256, **extra):
    from flax import nnx

    from model.eagle3 import config_from_json, random_params

    config = head_json(target, draft_vocab, **extra)
    return config, random_params(config_from_json(config), nnx.Rngs(seed))


# -- the format ------------------------------------------------------------------------------------


def test_eagle3_checkpoint_loads_and_mismatches_are_refused(tmp_path):
    from model.eagle3 import aux_layers, load_checkpoint
    from serving.loading.draft_source import _refuse_eagle3_dir

    target = tiny_llama_cfg()
    config, params = random_head(target)
    write_head(tmp_path / "ok", config, params)
    cfg, loaded = load_checkpoint(tmp_path / "ok", target)
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.has_embedding) == (256, 64, False)
    assert set(loaded) == set(params) and all(np.array_equal(loaded[k], params[k]) for k in params)
    assert loaded["wq"].shape == (128, 4, 16) and loaded["fc"].shape == (192, 64)
    assert aux_layers(cfg, 2) == (2, 1, 0) and aux_layers(cfg, 32) == (2, 16, 29)  # Llama 3.1 8B: 2, 16, 29
    with pytest.raises(ValueError, match="--speculative eagle3"):
        _refuse_eagle3_dir(str(tmp_path / "ok"))

    for name, (cfg_extra, other), match in (
            ("hidden", ({}, dataclasses.replace(target, hidden_size=96)), "target_hidden_size 64"),
            ("vocab", ({}, dataclasses.replace(target, vocab_size=1024)), "vocab_size 512"),
            ("gemma", ({}, dataclasses.replace(target, architecture="gemma3", tie_embeddings=True)), "Llama-family"),
            ("layers", (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}), target), "0..2"),
            ("arch", (dict(architectures=["LlamaForCausalLM"]), target), "not an EAGLE-3 head")):
        c = {**config, **cfg_extra}
        write_head(tmp_path / name, c, params)
        with pytest.raises(ValueError, match=match):
            load_checkpoint(tmp_path / name, other)
    bad = dict(params, fc=params["fc"][:, :32])
    write_head(tmp_path / "shape", config, bad)
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 192\), expected \(64, 192\)"):
        load_checkpoint(tmp_path / "shape", target)
    write_head(tmp_path / "missing", config, {k: v for k, v in params.items() if k != "lm_head"})
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_checkpoint(tmp_path / "missing", target)


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [T, heads, H], rotate-half
    H = x.shape[-1]
    inv = theta ** (-np.arange(0, H, 2) / H)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def test_eagle3_head_forward_matches_a_numpy_reading_of_the_hf_tensors(tmp_path):
    """Two tokens at positions 0, 1 with the target's features: the head's target-vocabulary
    logits and pre-norm outputs equal EAGLE-3's formula computed in numpy straight from the
    checkpoint's [out, in] tensors (the transposes, the concatenation order, RoPE, GQA, d2t)."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from model.attention_metadata import AttentionMetadata
    from model.eagle3 import Eagle3Head, load_checkpoint
    from model.kv_cache import KVCache

    target = tiny_llama_cfg()
    config, params = random_head(target, seed=3)
    write_head(tmp_path, config, params)
    cfg, loaded = load_checkpoint(tmp_path, target)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((target.vocab_size, 64)).astype(np.float32)
    head = Eagle3Head(cfg, loaded, embed)
    tokens, feats = np.array([7, 300]), rng.standard_normal((2, 192)).astype(np.float32)
    kv = KVCache.zeros(cfg.layer, 4, 8, jnp.float32)
    md = AttentionMetadata(slot_mapping=jnp.array([8, 9], jnp.int32), page_table=jnp.array([[1]], jnp.int32),
                           kv_lens=jnp.array([2], jnp.int32), cu_q_lens=jnp.array([0, 2], jnp.int32),
                           num_seqs=jnp.asarray(1, jnp.int32), mode="prefill")
    forward = jax.jit(lambda tok, f, kv, md: head(tok, f, jnp.arange(2, dtype=jnp.int32), kv, md))  # one program
    logits, out, _ = forward(jnp.asarray(tokens, jnp.int32), jnp.asarray(feats), kv, md)

    t = load_file(str(tmp_path / "model.safetensors"))
    g = feats @ t["fc.weight"].T
    x = np.concatenate([_rms(embed[tokens], t["midlayer.input_layernorm.weight"]),
                        _rms(g, t["midlayer.hidden_norm.weight"])], -1)
    pos = np.arange(2.0)
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(2, 4, 16), pos)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(2, 2, 16), pos)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(2, 2, 16)
    k, v = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # GQA: 2 query heads a kv head
    s = np.einsum("qnh,knh->nqk", q, k) / 4.0 + np.triu(np.full((2, 2), -np.inf), 1)
    w = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("nqk,knh->qnh", w / w.sum(-1, keepdims=True), v).reshape(2, 64)
    h = g + a @ t["midlayer.self_attn.o_proj.weight"].T
    y = _rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ t["midlayer.mlp.gate_proj.weight"].T, y @ t["midlayer.mlp.up_proj.weight"].T
    ref_out = h + (gate / (1 + np.exp(-gate)) * up) @ t["midlayer.mlp.down_proj.weight"].T
    draft_logits = _rms(ref_out, t["norm.weight"]) @ t["lm_head.weight"].T
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=2e-4, atol=2e-4)
    ids = np.arange(256) + t["d2t"]
    got = np.asarray(logits)
    np.testing.assert_allclose(got[:, ids], draft_logits, rtol=2e-4, atol=2e-4)
    assert np.isneginf(np.delete(got, ids, axis=1)).all()


def test_llama_returns_the_hidden_states_entering_the_asked_layers():
    """``aux_layers`` (2, 1, 0) of the 2-layer tiny Llama: layer 0's input is the embedding, id
    2 (= L) the last layer's output, whose final norm and head give the logits; the logits and
    the cache are those of the call without ``aux_layers``, which returns two values."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.attention_metadata import AttentionMetadata
    from model.kv_cache import KVCache
    from model.layers import rms_norm
    from model.llama import Llama

    cfg = tiny_llama_cfg()
    model = Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    tokens = jnp.array([1, 17, 300, 42, 9], jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.arange(8, 13, dtype=jnp.int32), page_table=jnp.array([[1]], jnp.int32),
                           kv_lens=jnp.array([5], jnp.int32), cu_q_lens=jnp.array([0, 5], jnp.int32),
                           num_seqs=jnp.asarray(1, jnp.int32), mode="prefill")
    kv = KVCache.zeros(cfg, 4, 8, jnp.float32)

    @jax.jit
    def both(kv):
        plain = model(tokens, jnp.arange(5, dtype=jnp.int32), kv, md, jnp.arange(5, dtype=jnp.int32))
        return plain, model(tokens, jnp.arange(5, dtype=jnp.int32), kv, md, jnp.arange(5, dtype=jnp.int32),
                            aux_layers=(2, 1, 0))

    (logits, kv1), (logits_aux, kv2, aux) = both(kv)
    D = cfg.hidden_size
    assert aux.shape == (5, 3 * D)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_aux))
    np.testing.assert_array_equal(np.asarray(kv1.k), np.asarray(kv2.k))
    np.testing.assert_allclose(np.asarray(aux[:, 2 * D:]), np.asarray(model.embed[...])[np.asarray(tokens)])
    head = rms_norm(aux[:, :D], model.final_norm[...], cfg.rms_norm_eps) @ model.lm_head[...]
    np.testing.assert_allclose(np.asarray(head), np.asarray(logits), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(aux[:, D:2 * D]), np.asarray(aux[:, 2 * D:]))  # layer 1's input moved


# -- the tiny-random Llama target with and without an EAGLE-3 head (float32) -------------------------


def copying_head(target, target_params) -> dict:
    """A head that drafts what the target would say: ``fc`` picks the target's last-layer
    output (aux layer id L = 2 of the tiny Llama), the layer adds only a small random part
    (``wo``, ``w_down`` scaled by 1e-3), and the final norm and ``lm_head`` are the target's
    over a draft vocabulary of the even ids. Its drafts repeat the target's prediction for the
    last token's own position, so they are accepted where the target repeats a token and
    rejected elsewhere."""
    from flax import nnx

    from model.eagle3 import config_from_json, random_params

    config = head_json(target, draft_vocab=256)
    p = random_params(config_from_json(config), nnx.Rngs(1))
    D = target.hidden_size
    fc = np.zeros((3 * D, D), np.float32)
    fc[:D] = np.eye(D)  # aux layers (2, 1, 0): the first block is "layer 2's input", the output
    p.update(fc=fc, wo=p["wo"] * 1e-3, w_down=p["w_down"] * 1e-3,
             final_norm=np.asarray(target_params["final_norm"]),
             lm_head=np.asarray(target_params["lm_head"])[:, ::2],
             d2t=np.arange(256, dtype=np.int32))  # draft id i -> target id 2 i
    return config, p


@pytest.fixture(scope="module")
def eagle_loop(jax_cache, tmp_path_factory):
    import jax.numpy as jnp
    from flax import nnx

    from model.llama import Llama, init_random_params
    from serving.engine.engine import Engine, EngineConfig
    from serving.loading.draft_source import load_eagle3
    from serving.runtime.engine_loop import EngineLoop

    target_cfg = tiny_llama_cfg()
    target_params = init_random_params(target_cfg, nnx.Rngs(0))
    target = Llama(target_cfg, dtype=jnp.float32, params=target_params)
    path = tmp_path_factory.mktemp("eagle3")
    write_head(path, *copying_head(target_cfg, target_params))

    class Flags:  # what load_eagle3 reads of a ServerConfig
        mesh, draft_model = None, str(path)

    head = load_eagle3(Flags, target)
    # K shrinks with the load: 3 drafts a row at 1-2 running requests, 1 at 3-4 (8 // R - 1)
    spec = SpeculativeConfig(method="eagle3", num_tokens=3, max_batch=4, draft_model=str(path), token_budget=8)
    engine = Engine(target, EngineConfig(**TINY_CFG, speculative=spec), draft=head)
    assert engine.draft.kv.k.shape[0] == 1 and engine.draft.aux_layers == (2, 1, 0)
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    yield loop
    loop.stop()


def test_eagle3_greedy_outputs_equal_without_speculation(eagle_loop):
    """64 random greedy prompts of 3-40 tokens (the longest over a prefill chunk), four at a
    time, max_tokens 6-13, every fifth with a stop id from its own output: the same ids and
    finish reasons with the head as without; drafts accepted and rejected; verify steps of
    both widths ran (3 drafts a row, and 1 while 3-4 requests ran: K shrank); a temperature
    request runs to its length with speculative sampling."""
    from tests.support.engine_helpers import generate, request

    rng = random.Random(463)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(64)]

    def reqs(group, stops):
        return [request(prompts[j], max_tokens=13, stop_token_ids=(stops[j],)) if j in stops
                else request(prompts[j], max_tokens=6 + j % 8, ignore_eos=True) for j in group]

    with_stop = [j for j in range(64) if j % 5 == 0]
    full = generate(eagle_loop, [request(prompts[j], max_tokens=13, ignore_eos=True) for j in with_stop])
    stops = {j: ids[rng.randrange(1, 13)] for j, ids in zip(with_stop, full)}
    before = eagle_loop.stats()
    for i in range(0, 64, 4):
        spec, plain = run_both(eagle_loop, lambda: reqs(range(i, i + 4), stops))
        for j, ((ids_s, ev_s), (ids_p, ev_p)) in enumerate(zip(spec, plain)):
            assert ids_s == ids_p, i + j
            assert ev_s[-1].finish_reason == ev_p[-1].finish_reason
            if i + j in stops:
                assert ev_s[-1].finish_reason == "stop" and ids_s[-1] == stops[i + j]
            else:
                assert len(ids_s) == 6 + (i + j) % 8
    after = eagle_loop.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted < drafted
    widths = {k[2] // k[1] - 1 for k in eagle_loop.engine.compile_times if k[0] == "verify"}  # (kind, S, T, P)
    assert widths == {1, 3}
    sampled = generate(eagle_loop, [request(prompts[0], max_tokens=16, ignore_eos=True, temperature=1.0, seed=5)])
    assert len(sampled[0]) == 16 and all(0 <= t < 512 for t in sampled[0])
