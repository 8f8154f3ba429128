"""``xlaserve convert`` then serving from the checkpoint on a 1x2x2 mesh: the same greedy
completion as the random model on one device (MoE experts split over the expert axis)."""

from __future__ import annotations

from flax import nnx

from model.config import ModelConfig
from model.factory import build_model
from serving.cli.main import main
from serving.config.server_config import load_server_config
from serving.engine.engine import Engine, EngineConfig
from serving.loading.mesh_loader import load_for_serving
from serving.loading.model_registry import known_models
from serving.runtime.engine_loop import EngineLoop
from tests.support.engine_helpers import generate, request

ENGINE = EngineConfig(max_slots=2, num_pages=32, max_model_len=128, prefill_chunk=16, min_decode_batch=1)


def _complete(model, mesh):
    loop = EngineLoop(Engine(model, ENGINE, mesh=mesh))
    loop.start(warmup=False)
    try:
        return generate(loop, [request(list(range(3, 20)), max_tokens=8, ignore_eos=True)])[0]
    finally:
        loop.stop()


def test_convert_then_serve_on_mesh(tmp_path):
    assert main(["convert", "tiny-moe", str(tmp_path / "ckpt"), "--name", "moe-ckpt"]) == 0
    cfg = load_server_config(checkpoint=str(tmp_path / "ckpt"), mesh="data=1,tensor=2,expert=2",
                             dtype="float32")  # the one-device reference below is float32
    model, tok, mesh = load_for_serving(cfg)
    assert model.cfg.name == "moe-ckpt"
    assert dict(mesh.shape) == {"data": 1, "tensor": 2, "expert": 2}
    assert model.w_gate[...].addressable_shards[0].data.shape[1] == 4  # 8 experts / expert=2
    spec = known_models()["tiny-moe"]
    one = build_model(ModelConfig.from_dict(spec["config"]), rngs=nnx.Rngs(int(spec.get("seed", 0))))
    assert _complete(model, mesh) == _complete(one, None)


def test_hf_directory_loads_onto_the_mesh(tmp_path):
    """``serve --model DIR --mesh tensor=2``: the Hugging Face checkpoint's tensors arrive in
    their shardings (each device holding half of a column-split weight), equal to a one-device load."""
    import numpy as np

    from serving.loading.model_registry import load_model
    from tests.support.hf_dir_fixtures import _hf_dir, _params

    d = _hf_dir(tmp_path)
    model, tok, mesh = load_for_serving(load_server_config(model=str(d), mesh="data=1,tensor=2,expert=1",
                                                           dtype="float32"))
    assert model.cfg.name == d.name and dict(mesh.shape)["tensor"] == 2
    sharded = [v for v in jax_leaves(model) if not v.sharding.is_fully_replicated]
    assert sharded and all(len(v.addressable_shards) == 2 and v.addressable_shards[0].data.size * 2 == v.size
                           for v in sharded)
    one, _ = load_model(str(d), progress=False)
    got, want = _params(model), _params(one)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}])[0] == tok.bos_id


def jax_leaves(model):
    from flax import nnx

    return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
