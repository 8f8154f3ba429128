"""``xlaserve convert`` then serving from the checkpoint on a 1x2x2 mesh: the same greedy
completion as the random model on one device (MoE experts split over the expert axis)."""

from __future__ import annotations

from flax import nnx

from model.config import ModelConfig
from model.factory import build_model
from serving.cli import main
from serving.engine import Engine, EngineConfig
from serving.engine_loop import EngineLoop
from serving.model_registry import known_models
from serving.server_config import load_server_config
from serving.sharding_cli import load_for_serving
from tests.engine_helpers import generate, request

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
