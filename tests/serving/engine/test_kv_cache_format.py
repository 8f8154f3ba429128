"""``--kv-cache-dtype`` and ``--kv-cache-bytes``: the page arithmetic (a byte budget holds >= 1.9x
the tokens in int8 / fp8), the engine's real page bytes equal to it, quantized pages through the
engine loop (prefix-cache hits and the host tier carry the scale pages bit for bit), the format
in the prefix-cache key, and the refusals."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.gemma3 import Gemma3
from serving.config.engine_config import EngineConfig, kv_page_bytes
from serving.config.server_config import ServerConfig
from serving.core.kv.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.engine import kv_pages
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from tests.support.tiny_engine import TINY

GEMMA_270M = types.SimpleNamespace(num_layers=18, num_kv_heads=1, head_dim=256, max_position=32768)
LLAMA_8B = types.SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, max_position=8192)


@pytest.mark.parametrize("model_cfg", [GEMMA_270M, LLAMA_8B], ids=["gemma-3-270m", "llama-8b"])
def test_a_byte_budget_holds_at_least_1_9x_the_tokens_in_int8_and_fp8(model_cfg):
    budget = 2 * 2**30
    pages = {fmt: EngineConfig.from_server_config(
        ServerConfig(kv_cache_bytes=budget, kv_cache_dtype=fmt, dtype="bfloat16"), model_cfg).num_pages
        for fmt in ("auto", "bfloat16", "int8", "fp8")}
    assert pages["auto"] == pages["bfloat16"] == budget // kv_page_bytes(model_cfg, 16, "bfloat16")
    for fmt in ("int8", "fp8"):
        assert pages[fmt] >= 1.9 * pages["bfloat16"], (fmt, pages)
        assert pages[fmt] * kv_page_bytes(model_cfg, 16, "bfloat16", fmt) <= budget
    # --num-pages is what counts without a byte budget
    assert EngineConfig.from_server_config(ServerConfig(kv_cache_dtype="int8"), model_cfg).num_pages == 4096


def tiny_loop(fmt: str, host_bytes: int = 0) -> EngineLoop:
    """The host-tier test's shapes (tests/serving/runtime/test_host_kv_cache.py), in a KV format."""
    cfg = EngineConfig(max_slots=4, num_pages=13, max_model_len=96, page_size=8, prefill_chunk=32,
                       min_decode_batch=2, kv_cache_dtype=fmt)
    return EngineLoop(Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg), host_kv_cache_bytes=host_bytes)


def test_engine_page_bytes_are_the_arithmetic_and_payloads_carry_scales(jax_cache):
    for fmt in ("bfloat16", "int8", "fp8"):
        engine = tiny_loop(fmt).engine
        assert kv_pages.page_bytes(engine.kv_cache) == kv_page_bytes(TINY, 8, engine.cfg.kv_dtype, fmt)
        names = kv_pages.payload_names(engine.kv_cache)
        assert names == (("k", "v") if fmt == "bfloat16" else ("k", "k_scale", "v", "v_scale"))
    bf16 = tiny_loop("bfloat16").engine
    with pytest.raises(ValueError, match="do not fit a int8 cache"):
        tiny_loop("int8").engine.write_pages([1], bf16.read_pages([1], 2))


def test_int8_pages_through_the_loop_and_the_host_tier(jax_cache):
    """A prompt's int8 pages, evicted to the host tier (values and scales) and reloaded, give the
    same sampled tokens as the first run; the reloaded pages equal the evicted ones bit for bit."""
    import asyncio

    from tests.support.engine_helpers import collect, request
    from tests.support.tiny_engine import prompt

    lp = tiny_loop("int8", host_bytes=1 << 20)
    lp.start(warmup=False)
    try:
        a = prompt(41, 5)
        sampled = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)
        first_ids, _ = asyncio.run(collect(lp, request(a, **sampled)))
        before = lp.engine.read_pages(lp.kv.lookup_prefix(a, None, 40).page_ids, 16)
        asyncio.run(collect(lp, request(prompt(90, 3), max_tokens=4, ignore_eos=True)))  # evicts a's pages
        assert lp.kv.lookup_prefix(a, None, 40).page_ids == ()
        held = lp.host_kv.get(lp.host_kv.keys()[0])
        assert sorted(held) == ["k", "k_scale", "v", "v_scale"] and held["k"].dtype == np.int8
        again_ids, again = asyncio.run(collect(lp, request(a, **sampled)))
        after = lp.engine.read_pages(lp.kv.lookup_prefix(a, None, 40).page_ids, 16)
    finally:
        lp.stop()
    assert again[-1].host_cached_tokens == 40 and again_ids == first_ids
    for name in ("k", "k_scale", "v", "v_scale"):
        np.testing.assert_array_equal(np.asarray(after[name])[:, :, :5], np.asarray(before[name])[:, :, :5])
    assert np.abs(np.asarray(after["k_scale"])[:, :, :5]).min() > 0  # real scales, not the null page's


def test_int8_pages_and_their_scales_cross_a_restart_through_the_disk_tier(jax_cache, tmp_path):
    """int8 pages written to disk when a loop stops (values and scale pages, files labelled int8)
    are read back by a new loop over the same engine and directory: the same sampled tokens, the
    prompt's 40 full-page tokens from disk."""
    import asyncio

    from tests.support.engine_helpers import collect, request
    from tests.support.tiny_engine import prompt

    engine = tiny_loop("int8").engine
    a = prompt(41, 5)
    sampled = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)

    def run_once():
        lp = EngineLoop(engine, host_kv_cache_bytes=1 << 20, kv_disk_dir=str(tmp_path), kv_disk_max_bytes=1 << 26)
        lp.start(warmup=False)
        try:
            return lp, asyncio.run(collect(lp, request(a, **sampled)))
        finally:
            lp.stop()  # every cached page to disk

    first, (want, _) = run_once()
    assert first.disk_kv.kv_format == "int8" and first.disk_kv.stores >= 5
    again, (got, events) = run_once()
    assert got == want and events[-1].disk_cached_tokens == 40 and again.disk_kv.corrupt_files == 0


def test_the_format_is_part_of_the_prefix_cache_key():
    ids = list(range(40))
    plain = prompt_page_hashes(ids, 8, None)
    assert plain == prompt_page_hashes(ids, 8, None, kv_format="")  # unquantized keys as before
    int8, fp8 = prompt_page_hashes(ids, 8, None, kv_format="int8"), prompt_page_hashes(ids, 8, None, kv_format="fp8")
    assert not (set(plain) & set(int8)) and not (set(int8) & set(fp8)) and len(set(int8)) == 5
    kv = KVCacheManager(num_pages=9, page_size=8, kv_format="int8")
    assert kv.allocate_pages("r", 40)
    kv.cache_pages("r", ids, 40, salt=None)
    assert kv.lookup_prefix(ids, None, 40).num_tokens == 40
    assert set(kv._page_of) == set(int8)


def test_bad_kv_cache_settings_are_clear_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, int8, fp8, got 'int4'"):
        ServerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive"):
        ServerConfig(kv_cache_bytes=0)
    with pytest.raises(ValueError, match="at least 2 are needed"):
        EngineConfig.from_server_config(ServerConfig(kv_cache_bytes=1000), GEMMA_270M)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="q8_0")


def test_shard_plan_counts_the_quantized_pages():
    """``shard-plan --kv-dtype int8 | fp8``: the same pages in the bytes ``kv_page_bytes`` gives
    (values and scale pages), which ``--kv-cache-bytes`` divides by."""
    from sharding.mesh import MeshConfig
    from sharding.plan import device_spec, plan

    plans = {fmt: plan(TINY, MeshConfig.parse(""), device_spec("h200"), slots=4, max_len=256, page_size=16,
                       kv_dtype=fmt) for fmt in ("bfloat16", "int8", "fp8")}
    for fmt, p in plans.items():
        assert p.kv_pages == plans["bfloat16"].kv_pages
        assert p.kv_bytes == p.kv_pages * kv_page_bytes(TINY, 16, fmt if fmt == "bfloat16" else "bfloat16", fmt)
    assert plans["int8"].kv_bytes == plans["fp8"].kv_bytes < plans["bfloat16"].kv_bytes
