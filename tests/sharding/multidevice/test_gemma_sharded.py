"""Gemma 3 270M (real weights) on a 1x4x1 mesh against one device: logits and a served completion."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from model.gemma3 import Gemma3
from serving.engine.engine import Engine, EngineConfig
from serving.runtime.engine_loop import EngineLoop
from sharding.mesh import MeshConfig, build_mesh
from tests.support.engine_helpers import generate, request
from tests.support.sharded_forward import assert_close, run_steps

pytestmark = pytest.mark.gemma


@pytest.fixture(scope="module")
def gemma(gemma_params):
    cfg, params = gemma_params
    return Gemma3(cfg, params=params, dtype=jnp.float32)


def test_gemma_logits_1x4x1_match_one_device(gemma):
    """Heads and vocabulary split 4 ways, the single KV head replicated."""
    one = run_steps(gemma, prompt_len=14, rows=2)
    four = run_steps(gemma, build_mesh(MeshConfig(1, 4, 1)), prompt_len=14, rows=2)
    assert_close(four, one, 1e-4, "gemma-3-270m on 1x4x1")


def _serve(gemma, mesh, prompt):
    cfg = EngineConfig(max_slots=2, num_pages=64, max_model_len=512, prefill_chunk=32,
                       min_decode_batch=1)
    loop = EngineLoop(Engine(gemma, cfg, mesh=mesh))
    loop.start(warmup=False)
    try:
        return generate(loop, [request(prompt["ids"], max_tokens=24, ignore_eos=True)])[0]
    finally:
        loop.stop()


def test_served_greedy_completion_on_1x4x1_is_the_reference_continuation(gemma, golden):
    """The served greedy ids on the mesh are the reference's own: the prompt has no near tie in
    its first 24 steps, so they must equal the golden ids exactly (one device does the same in
    tests/serving/engine/test_engine_gemma.py; no one-device engine is compiled here)."""
    prompt = next(p for p in golden["prompts"] if p["name"] == "english")
    assert min(prompt["greedy"]["step_top1_top2_margin"][:24]) >= 1e-2
    four = _serve(gemma, build_mesh(MeshConfig(1, 4, 1)), prompt)
    assert four == prompt["greedy"]["ids"][:24]
