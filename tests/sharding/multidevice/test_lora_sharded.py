"""LoRA on a mesh (8 fake CPU devices): the adapter stacks sharded like the projections they
adapt, and a mixed batch of base and adapter requests through the engine loop gives the
single-device engine's greedy ids (hf_tiny's Llama, float32, tests/data/lora_tiny)."""

from __future__ import annotations

import asyncio
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from sharding.mesh import MeshConfig, build_mesh
from tests.support.engine_helpers import collect, request
from tests.support.paths import TEST_DATA

LORA = TEST_DATA / "lora_tiny"
ADAPTERS = {"a4": str(LORA / "llama_r4"), "a8": str(LORA / "llama_r8")}
CFG = EngineConfig(max_slots=8, num_pages=64, max_model_len=64, page_size=8, prefill_chunk=64,
                   min_decode_batch=4, kv_dtype="float32", max_loras=2, max_lora_rank=8)
_single: dict = {}


def _engine(mesh=None) -> Engine:
    cfg, params = load_hf_checkpoint(TEST_DATA / "hf_tiny" / "llama", progress=False)
    return Engine(build_model(cfg, params=params, dtype=jnp.float32), CFG, mesh=mesh)


def _serve(engine: Engine) -> tuple[list[list[int]], np.ndarray]:
    """Six concurrent requests, base and both adapters twice (prompts of 5-10 tokens): the
    greedy ids of each and the log probability of every token, [6 x 8] float32."""
    rng = np.random.default_rng(0)
    names = [None, "a4", "a8", "a8", None, "a4"]
    reqs = [dataclasses.replace(request(rng.integers(3, 250, 5 + i).tolist(), max_tokens=8, ignore_eos=True,
                                        logprobs=0), lora_name=n) for i, n in enumerate(names)]
    loop = EngineLoop(engine, lora_modules=ADAPTERS)
    loop.start(warmup=False)

    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in reqs))

    try:
        out = asyncio.run(main())
    finally:
        loop.stop()
    logprobs = np.array([[lp.logprob for ev in events for lp in ev.logprobs] for _, events in out], np.float32)
    return [ids for ids, _ in out], logprobs


def _reference() -> tuple[list[list[int]], np.ndarray]:
    if "ref" not in _single:
        _single["ref"] = _serve(_engine())
    return _single["ref"]


@pytest.mark.parametrize("mesh", ["2x2x1", "1x4x1"])  # tensor=2 with a data axis; tensor=4 over 2 KV heads
def test_mixed_adapters_on_a_mesh_equal_one_device(mesh):
    d, t, e = map(int, mesh.split("x"))
    engine = _engine(build_mesh(MeshConfig(d, t, e)))
    got, logprobs = _serve(engine)
    ref, ref_logprobs = _reference()
    assert got == ref, mesh
    assert logprobs.shape == (6, 8)
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=1e-5, atol=1e-5)  # float32, other reduction orders
    assert len({tuple(i) for i in got[:3]}) == 3  # base, a4 and a8 differ: the adapters were applied
    spec = {p: (_axes(a.sharding.spec), _axes(b.sharding.spec)) for p, (a, b) in engine.lora_stacks.items()}
    split = "tensor"
    # column-parallel: b over its output features; row-parallel: a over its input features
    kv_split = split if 2 % t == 0 else None  # two KV heads: whole heads only
    for p in ("wq", "wk", "wv", "w_gate", "w_up"):
        out = kv_split if p in ("wk", "wv") else split
        assert spec[p] == ((None,) * 4, (None, None, None, out)), (p, spec[p])
    for p in ("wo", "w_down"):
        assert spec[p] == ((None, None, split, None), (None,) * 4), (p, spec[p])


def _axes(spec: P) -> tuple:
    """A [L, S, ., .] stack's PartitionSpec as 4 entries (trailing Nones made explicit)."""
    return tuple(spec) + (None,) * (4 - len(spec))


def test_one_kv_head_keeps_k_and_v_stacks_whole_like_their_projections():
    """Two KV heads over tensor=4 cannot split in whole heads: k/v's b stays replicated,
    as the K/V projections do (``replicate_if_indivisible``), though 2 x 12 features would divide."""
    from sharding.placement import lora_shardings
    from sharding.rules import ShardingRules

    engine = _engine()
    mesh = build_mesh(MeshConfig(1, 4, 1))
    sh = lora_shardings(engine.lora_stacks, engine.model_cfg, mesh, ShardingRules.default())
    assert _axes(sh["wk"][1].spec) == _axes(sh["wv"][1].spec) == (None,) * 4
    assert _axes(sh["wq"][1].spec) == (None, None, None, "tensor")
