"""A checkpoint written on a 1x4x1 mesh restores bit-equal on 1x2x2 and on one device."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from model.checkpoint import load_config, restore_params, save_checkpoint
from model.config import ModelConfig
from model.factory import abstract_params, build_model
from serving.loading.model_registry import known_models
from sharding.mesh import MeshConfig, build_mesh
from sharding.placement import abstract_targets, place_params
from sharding.rules import ShardingRules


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-llama"])
def test_checkpoint_restores_across_meshes(tmp_path, name):
    cfg = ModelConfig.from_dict(known_models()[name]["config"])
    rules = ShardingRules.default()
    model = build_model(cfg, rngs=nnx.Rngs(3))
    state = place_params(nnx.state(model, nnx.Param), build_mesh(MeshConfig(1, 4, 1)), rules)
    written = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    assert any(len(a.sharding.device_set) == 4 and not a.sharding.is_fully_replicated
               for a in written.values())
    save_checkpoint(tmp_path / "ckpt", cfg, written, tokenizer_model=b"spm")
    assert load_config(tmp_path / "ckpt") == cfg
    layout = abstract_params(cfg)
    for mesh in (build_mesh(MeshConfig(1, 2, 2)), None):
        restored = restore_params(tmp_path / "ckpt", abstract_targets(layout, mesh, rules))
        assert set(restored) == set(written)
        for k, a in restored.items():
            want = abstract_targets(layout, mesh, rules)[k].sharding
            assert a.sharding.is_equivalent_to(want, a.ndim), k
            np.testing.assert_array_equal(np.asarray(a), np.asarray(written[k]), err_msg=k)
        # each device holds only its shard
        if mesh is not None:
            wg = restored["w_gate"]
            assert wg.addressable_shards[0].data.shape != wg.shape
