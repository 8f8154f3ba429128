"""The persistent XLA compilation cache, so a restart does not recompile the step programs."""

from __future__ import annotations

import os

import jax

from serving.config.server_config import cache_dir


def enable_compilation_cache() -> None:
    """Persists compiled XLA programs under ``$XLASERVE_DATA_DIR/cache/jax``, every size of
    entry and compile time included.

    ``JAX_COMPILATION_CACHE_DIR`` in the environment wins (``.ci/run`` may set it).
    """
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_dir("jax")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
