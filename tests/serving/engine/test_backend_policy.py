"""The backend policy's stored parameters: a CPU engine stores a bfloat16 model's stacked
weights as their uint16 bits in the loaded buffers, not in copies (two copies of the weights
at start-up otherwise: the model keeps the bfloat16 arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from serving.engine.backend_policy import BackendPolicy
from serving.loading.model_registry import load_model


def test_cpu_stores_bfloat16_stacked_weights_as_their_bits_in_place():
    model, _ = load_model("tiny-llama", dtype="bfloat16", progress=False)
    state = nnx.state(model, nnx.Param)
    stored = BackendPolicy.for_platform("cpu").store_params(state)
    before, after = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(stored))
    converted = 0
    for path, v in before.items():
        value, kept = v.get_value(), after[path].get_value()
        stacked = (v.get_metadata().get("logical_axes") or ())[:1] == ("layers",)
        if stacked and value.dtype == jnp.bfloat16:
            converted += 1
            assert kept.dtype == jnp.uint16, path
            assert kept.unsafe_buffer_pointer() == value.unsafe_buffer_pointer(), path  # no copy
            np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(kept, jnp.bfloat16)),
                                          np.asarray(value), err_msg=str(path))
        else:
            assert kept is value, path
    assert converted >= 7  # wq, wk, wv, wo, w_gate, w_up, w_down
