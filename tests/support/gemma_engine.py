"""The Gemma 3 270M engine the golden and structured-output tests run: its sizes and loop."""

from __future__ import annotations

import jax.numpy as jnp

from model.gemma3 import Gemma3
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop

# Small pool; prefill chunk 256 so the 712-token prompt takes three chunks; one decode
# bucket of 8 rows, so alone and batched runs share their compiled programs.
CFG = EngineConfig(max_slots=8, num_pages=768, max_model_len=2048, prefill_chunk=256, min_decode_batch=8)


def make_loop(gemma_params, dtype, **overrides) -> EngineLoop:
    """As the server builds it: the KV cache in the serving dtype (overrides: EngineConfig fields)."""
    import dataclasses

    cfg, params = gemma_params
    engine_cfg = dataclasses.replace(CFG, kv_dtype=jnp.dtype(dtype).name, **overrides)
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=dtype), engine_cfg))
    loop.start(warmup=False)
    return loop
