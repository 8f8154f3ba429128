"""Mesh and rule configuration on one device: parsing, clear errors, shard-plan's report."""

from __future__ import annotations

import pytest

from serving.cli.main import main
from sharding.mesh import MeshConfig, build_mesh
from sharding.rules import ShardingRules


def test_mesh_parse_and_errors():
    assert MeshConfig.parse("data=1,tensor=4,expert=1") == MeshConfig(1, 4, 1)
    assert MeshConfig.parse("tensor=8").shape == (1, 8, 1)
    assert MeshConfig.parse("") == MeshConfig()
    with pytest.raises(ValueError, match="unknown mesh axes"):
        MeshConfig.parse("model=2")
    with pytest.raises(ValueError, match="must look like"):
        MeshConfig.parse("tensor:2")
    with pytest.raises(ValueError, match="positive"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match=r"needs 3 devices .* only 1 CPU device"):
        build_mesh(MeshConfig(1, 3, 1))


def test_rules_split_replicate_or_refuse():
    rules = ShardingRules.default()
    sizes = {"data": 2, "tensor": 4, "expert": 2}
    assert tuple(rules.spec((8, 64, 8, 16), ("layers", "embed", "heads", "head_dim"), sizes)) == \
        (None, None, "tensor", None)
    # one KV head on tensor=4: replicated, pages over data
    assert tuple(rules.spec((2, 1, 10, 16, 32), ("layers", "kv_heads", "pages", None, "head_dim"),
                            sizes)) == (None, None, "data", None, None)
    assert tuple(rules.spec((2, 8, 64, 32), ("layers", "expert", "embed", "mlp"), sizes)) == \
        (None, "expert", None, "tensor")
    with pytest.raises(ValueError, match="wq: logical axis 'heads' has size 6"):
        rules.spec((2, 64, 6, 16), ("layers", "embed", "heads", "head_dim"), sizes, what="wq")
    assert rules.shard_shape((2, 8, 64, 32), ("layers", "expert", "embed", "mlp"), sizes) == (2, 4, 64, 8)


def test_shard_plan_cli(capsys):
    assert main(["shard-plan", "--model", "llama3-70b", "--mesh", "tensor=8", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "parameters        16.43 GiB" in out and "fits in 141 GiB" in out, out
    assert main(["shard-plan", "--model", "llama3-8b", "--mesh", "tensor=1", "--device", "v5e"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["shard-plan", "--model", "mixtral-8x7b", "--mesh", "tensor=3", "--device", "h200"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_shard_plan_reads_the_default_models_config_from_its_gguf():
    from sharding.plan import load_model_config

    cfg = load_model_config("gemma-3-270m")
    assert (cfg.name, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("gemma-3-270m", 18, 4, 1)
    with pytest.raises(ValueError, match="unknown model config"):
        load_model_config("no-such-model")
