"""shard-plan's parameter and KV bytes equal the real arrays' per-device shard bytes."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from model.config import ModelConfig
from model.factory import build_model
from model.kv_cache import KVCache
from serving.loading.model_registry import known_models
from sharding.mesh import MeshConfig, build_mesh
from sharding.placement import kv_cache_sharding, place_params, sharded_zeros
from sharding.plan import device_spec, plan
from sharding.rules import ShardingRules


def _device_bytes(arrays) -> dict:
    out: dict = {}
    for a in arrays:
        for s in a.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


@pytest.mark.parametrize("mesh", ["1x4x1", "1x2x2", "2x2x2", "1x1x8"])
@pytest.mark.parametrize("name,dtype", [("tiny-llama", "float32"), ("tiny-moe", "bfloat16"),
                                        ("tiny-random", "bfloat16")])
def test_plan_bytes_equal_real_shards(name, dtype, mesh):
    cfg = ModelConfig.from_dict(known_models()[name]["config"])
    mc = MeshConfig(*map(int, mesh.split("x")))
    m = build_mesh(mc)
    rules = ShardingRules.default()
    model = build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype))
    placed = place_params(nnx.state(model, nnx.Param), m, rules)
    per_device = _device_bytes(v.get_value() for _, v in nnx.to_flat_state(placed))
    slots, max_len = 4, 64
    p = plan(cfg, mc, device_spec("v5e"), slots=slots, max_len=max_len, page_size=16,
             dtype=dtype, rules=rules)
    assert len(per_device) == mc.size
    assert set(per_device.values()) == {p.param_bytes}, (per_device, p.param_bytes)
    assert p.param_bytes_total == sum(per_device.values())
    shape = KVCache.shape(cfg, p.kv_pages, 16)
    kv = sharded_zeros(shape, jnp.dtype(dtype), kv_cache_sharding(shape, m, rules))
    assert set(_device_bytes([kv, kv]).values()) == {p.kv_bytes}


def test_plan_rejects_a_mesh_that_does_not_divide_heads():
    cfg = ModelConfig.from_dict(known_models()["tiny-llama"]["config"])
    with pytest.raises(ValueError, match="does not divide"):
        plan(cfg, MeshConfig(1, 3, 1), device_spec("h100"))
