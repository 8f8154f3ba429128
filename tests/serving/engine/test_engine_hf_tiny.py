"""The engine on a tiny Hugging Face checkpoint of an architecture added in issue 30 (tests/data/
hf_tiny/gemma2: attention soft-cap, alternating sliding windows): served through the engine
loop (its backend policy, paged KV cache, a decode batch of two), float32 greedy ids equal
transformers' up to the first near-tie. (Qwen2 and Phi-3 run the Llama decoder, whose engine
path other tests cover; their parity is tests/model/test_hf_checkpoint.py's.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop
from tests.support.hf_tiny_parity import agree_until_near_tie, golden
from tests.support.engine_helpers import generate, request
from tests.support.paths import TEST_DATA


@pytest.mark.parametrize("case", ["gemma2"])
def test_engine_greedy_matches_transformers(case):
    ref = golden(case)
    cfg, params = load_hf_checkpoint(TEST_DATA / "hf_tiny" / case, progress=False)
    model = build_model(cfg, params=params, dtype=jnp.float32)
    engine_cfg = EngineConfig(max_slots=2, num_pages=16, max_model_len=64, page_size=8,
                              prefill_chunk=16, min_decode_batch=2, kv_dtype="float32")
    loop = EngineLoop(Engine(model, engine_cfg))
    loop.start(warmup=False)
    try:
        n = len(ref["greedy"]["ids"])
        pair = generate(loop, [request(ref["prompt"], max_tokens=n, ignore_eos=True),
                               request(ref["prompt"][:9], max_tokens=4, ignore_eos=True)])[0]
    finally:
        loop.stop()
    assert agree_until_near_tie(pair, ref, f"{case} engine, batched") >= 6
