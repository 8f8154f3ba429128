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


def test_the_cpu_features_pick_the_invariant_matmul_rows_and_the_advice():
    """Native bf16 dots (AVX512_BF16, or AMX through NumPy's AVX512_SPR group) keep the
    4-row tiles measured on the AMX Xeon; a CPU that widens bf16 pads to 2 rows (measured
    on an AVX2 EPYC, and checked on this host by test_batch_invariance.py with whichever
    the host gets); only a bf16 model that is not int8 on such a CPU draws the advice."""
    from kernels_pallas.dot_rows import DotRows
    from serving.engine.cpu_features import CpuFeatures, host_cpu

    avx2 = CpuFeatures.from_flags({"AVX2": True, "AVX512F": False})
    zen4 = CpuFeatures.from_flags({"AVX512F": True, "AVX512BF16": True, "AVX512VNNI": True})
    spr = CpuFeatures.from_flags({"AVX512F": True, "AVX512_SPR": True})
    assert not avx2.bf16_dot and zen4.bf16_dot and not zen4.amx and spr.amx and spr.bf16_dot
    assert zen4.int8_dot and not avx2.int8_dot and avx2.describe() == "no avx512"
    rows = {f: BackendPolicy.for_platform("cpu", cpu=f).invariant_dot_rows for f in (avx2, zen4, spr)}
    assert rows == {avx2: DotRows(2, 16), zen4: DotRows(4, 16), spr: DotRows(4, 16)}
    assert BackendPolicy.for_platform("cpu").cpu == host_cpu()
    assert BackendPolicy.for_platform("gpu").cpu is None and BackendPolicy.for_platform("gpu").advice("bfloat16", False) is None

    slow = BackendPolicy.for_platform("cpu", cpu=avx2)
    assert "--quantization int8" in slow.advice("bfloat16", quantized=False)
    assert slow.advice("bfloat16", quantized=True) is None and slow.advice("float32", quantized=False) is None
    assert BackendPolicy.for_platform("cpu", cpu=zen4).advice("bfloat16", quantized=False) is None
