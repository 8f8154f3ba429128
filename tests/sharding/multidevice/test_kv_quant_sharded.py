"""Quantized KV pages on a mesh (8 fake CPU devices): the int8 values and their scale pages split
alike (pages over data, KV heads over tensor where they divide it), and the engine loop's greedy
ids equal the single-device int8 engine's (tiny-random, float32)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.gemma3 import Gemma3
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from sharding.mesh import MeshConfig, build_mesh
from tests.support.engine_helpers import generate, request
from tests.support.tiny_engine import TINY, prompt

CFG = EngineConfig(max_slots=4, num_pages=64, max_model_len=64, page_size=8, prefill_chunk=32,
                   min_decode_batch=4, kv_dtype="float32", kv_cache_dtype="int8")


def _greedy(mesh) -> tuple[list[list[int]], object]:
    loop = EngineLoop(Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), CFG, mesh=mesh))
    loop.start(warmup=False)
    try:
        ids = generate(loop, [request(prompt(20, i), max_tokens=6, ignore_eos=True) for i in range(4)])
        return ids, loop.engine.kv_cache.k
    finally:
        loop.stop()


def test_int8_pages_on_a_mesh_give_the_single_device_ids():
    single, _ = _greedy(None)
    sharded, k = _greedy(build_mesh(MeshConfig.parse("data=2,tensor=4")))
    assert k.data.dtype == jnp.int8 and k.scale.sharding.spec == P(*k.data.sharding.spec[:4])
    assert k.scale.sharding.spec[2] == "data"
    assert sharded == single
