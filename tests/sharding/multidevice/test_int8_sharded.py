"""int8 weights on a mesh (8 fake CPU devices): the int8 values and their scales place by the
float weights' logical axes, and the sharded logits equal the unsharded int8 ones."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from model.config import ModelConfig
from model.factory import build_model
from serving.loading.model_registry import known_models
from sharding.mesh import MeshConfig, build_mesh
from sharding.placement import place_params
from sharding.rules import ShardingRules
from tests.support.sharded_forward import assert_close, run_steps


def _int8_llama():
    cfg = ModelConfig.from_dict(known_models()["tiny-llama"]["config"])
    return build_model(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, quantization="int8")


def test_int8_values_and_scales_shard_by_the_logical_axes():
    mesh = build_mesh(MeshConfig(1, 4, 1))
    placed = place_params(nnx.state(_int8_llama(), nnx.Param), mesh, ShardingRules.default())
    wq, wq_scale = placed["wq"].get_value(), placed["wq_scale"].get_value()
    assert wq.dtype == jnp.int8 and wq_scale.dtype == jnp.float32
    spec, scale_spec = tuple(wq.sharding.spec) + (None,) * 4, tuple(wq_scale.sharding.spec) + (None,) * 4
    assert spec[2] == scale_spec[2] == "tensor"  # [layers, embed, heads, head_dim]: heads split
    assert scale_spec[1] is None  # the scales' contraction axis (size 1) is not split
    assert wq.addressable_shards[0].data.shape[2] == wq.shape[2] // 4


@pytest.mark.parametrize("mesh", ["1x2x1", "1x4x1"])
def test_int8_sharded_logits_match_unsharded(mesh):
    model = _int8_llama()
    d, t, e = map(int, mesh.split("x"))
    assert_close(run_steps(model, build_mesh(MeshConfig(d, t, e))), run_steps(model), 1e-4,
                 f"tiny-llama int8 on {mesh}")
