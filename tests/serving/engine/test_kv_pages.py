"""Whole KV pages out of and into the device cache (``serving.engine.kv_pages``), and pinned holders."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.gemma3 import Gemma3
from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.engine.engine import Engine, EngineConfig
from tests.support.tiny_engine import TINY


def test_pages_read_back_bit_for_bit_and_land_where_written(jax_cache):
    cfg = EngineConfig(max_slots=2, num_pages=16, max_model_len=64, page_size=8, prefill_chunk=32,
                       min_decode_batch=2, kv_dtype="bfloat16")
    engine = Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg)
    shape = engine.kv_cache.k.shape
    rng = np.random.default_rng(0)
    k = rng.integers(0, 2**15, (shape[0], shape[1], 4, shape[3], shape[4])).astype(engine.kv_cache.k.dtype)
    v = (k[::-1] + 1).astype(k.dtype)
    engine.write_pages([3, 9, 5], {"k": k, "v": v})  # the 4th row goes to the null page
    out = engine.read_pages([9, 5, 3], 4)
    assert list(out) == ["k", "v"]
    rk, rv = np.asarray(out["k"]), np.asarray(out["v"])
    assert rk.shape == k.shape and rk.dtype == k.dtype
    np.testing.assert_array_equal(rk[:, :, :3], k[:, :, [1, 2, 0]])
    np.testing.assert_array_equal(rv[:, :, :3], v[:, :, [1, 2, 0]])
    untouched = np.asarray(engine.kv_cache.k)[:, :, [1, 2, 4, 6, 7, 8, 10]]
    assert not untouched.any(), "a write reached a page it was not given"
    with pytest.raises(ValueError, match="do not fit"):
        engine.read_pages([1, 2, 3], 2)


def test_pinned_pages_outlive_their_request():
    kv = KVCacheManager(num_pages=9, page_size=4)
    assert kv.allocate_pages("r", 14)
    kv.cache_pages("r", list(range(14)), 14, salt=None)
    pages = kv.pin("xfer", "r", 3)
    assert pages == kv.page_ids("r")[:3]
    kv.free("r")
    kv.check_invariants()
    assert kv.num_free == 8 - 3 and kv.request_ids() == [] and kv.pinned_ids() == ["xfer"]
    hit = kv.lookup_prefix(list(range(14)), None, 13)
    assert hit.page_ids == pages, "pinned pages stay in the prefix cache"
    kv.free("xfer")
    kv.check_invariants()
    assert kv.num_free == 8
    with pytest.raises(ValueError, match="offered"):
        kv.pin("x2", "nobody", 1)
