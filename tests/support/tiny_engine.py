"""The tiny-random engine loop many test files build: its model config, a loop of the usual test
shapes (:func:`make_loop`), prompts, and whether every page is free."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.gemma3 import Gemma3
from serving.config.config_files import read_config
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.runtime.engine_loop import EngineLoop

TINY = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])


def make_loop(**overrides) -> EngineLoop:
    """A float32 tiny-random loop, not started (overrides: EngineConfig fields, ``max_waiting``,
    ``enable_prefix_caching``)."""
    max_waiting = overrides.pop("max_waiting", 256)
    caching = overrides.pop("enable_prefix_caching", True)
    cfg = EngineConfig(**{**dict(max_slots=4, num_pages=64, max_model_len=256, page_size=8,
                                 prefill_chunk=32, min_decode_batch=2), **overrides})
    model = Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return EngineLoop(Engine(model, cfg), max_waiting=max_waiting, enable_prefix_caching=caching)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [2] + [(7 * i + offset) % 400 + 100 for i in range(n - 1)]


def all_pages_free(loop: EngineLoop) -> bool:
    return loop.kv.num_free == loop.cfg.num_pages - 1
