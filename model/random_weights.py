"""Random weights for tests and benchmarks, drawn on the host.

The model modules' ``init_random_params`` draw from one ``numpy.random.Generator`` seeded by
a single key of the caller's ``nnx.Rngs`` params stream, rather than one
``jax.random.normal`` per tensor: each distinct shape of an eager ``jax.random.normal`` (and
of the scaling that follows it) compiles its own XLA program, ~85 programs for the test suite's
tiny models (about 100 s of its compile time on 2 cores, 2026-12-06), where numpy compiles
nothing. The same ``Rngs`` seed gives the same weights. Under tracing (``jax.eval_shape`` of
a model, ``model.factory.abstract_params``) the draws are ``jax.random`` ones, traced, never run.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


class RandomWeights:
    """float32 draws in call order from one generator seeded by ``rngs.params()``."""

    def __init__(self, rngs: nnx.Rngs):
        key = self._key = rngs.params()
        self._gen = None
        bits = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        try:
            self._gen = np.random.default_rng(np.asarray(bits, np.uint32).ravel().tolist())
        except jax.errors.TracerArrayConversionError:
            pass  # traced (jax.eval_shape): jax.random draws below

    def _standard_normal(self, shape: tuple[int, ...]):
        if self._gen is None:  # traced: shapes only
            self._key, key = jax.random.split(self._key)
            return jax.random.normal(key, shape, jax.numpy.float32)
        return self._gen.standard_normal(shape, np.float32)

    def normal(self, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        """N(0, 1) / sqrt(fan_in), float32 ``shape``."""
        return jax.numpy.asarray(self._standard_normal(shape) / np.float32(np.sqrt(fan_in)))

    def norm_scale(self, shape: tuple[int, ...]) -> jax.Array:
        """1 + 0.1 * N(0, 1), float32 ``shape`` (an RMSNorm scale near 1)."""
        return jax.numpy.asarray(np.float32(1.0) + np.float32(0.1) * self._standard_normal(shape))
