"""The Gemma 3 270M engine the golden and structured-output tests run: its sizes and loop."""

from __future__ import annotations

import jax.numpy as jnp

from model.gemma3 import Gemma3
from serving.config.engine_config import EngineConfig
from serving.config.server_config import ServerConfig
from serving.engine.backend_policy import BackendPolicy
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop

# Small pool; prefill chunk 256 so the 712-token prompt takes three chunks; one decode
# bucket of 8 rows, so alone and batched runs share their compiled programs.
CFG = EngineConfig(max_slots=8, num_pages=768, max_model_len=2048, prefill_chunk=256, min_decode_batch=8)

# CFG as ``xlaserve serve`` / ``engine`` flags, for the Gemma servers of tests/e2e: one shape family
# for every Gemma test, so a program one test compiled is loaded from the persistent compilation
# cache by the others (in-process engines and servers alike). ``--skip-warmup``: each server
# compiles only the shapes its tests reach (tests/serving/engine/test_warmup_shapes.py checks
# the warmup itself).
SERVER_ARGS = ["--max-slots", "8", "--num-pages", "768", "--max-model-len", "2048", "--prefill-chunk", "256",
               "--min-decode-batch", "8", "--skip-warmup"]


def make_loop(gemma_params, dtype, **overrides) -> EngineLoop:
    """As the server builds it: the KV cache in the serving dtype, the backend policy of the
    server's default ``--cpu-kernels auto`` (in bfloat16 on an AMX CPU: the output head in
    ``kernels_cpu``'s kernel); overrides: EngineConfig fields."""
    import dataclasses

    cfg, params = gemma_params
    engine_cfg = dataclasses.replace(CFG, kv_dtype=jnp.dtype(dtype).name, **overrides)
    policy = BackendPolicy.detect(cpu_kernels=ServerConfig().cpu_kernels)
    loop = EngineLoop(Engine(Gemma3(cfg, params=params, dtype=dtype), engine_cfg, policy=policy))
    loop.start(warmup=False)
    return loop
