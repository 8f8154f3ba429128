"""int8 weights by row count (``--quantization auto``): the backend policy's rows per CPU, and
an engine that runs a step of at most that many token rows with its int8 copy of the weights
and every larger step with the served ones, bitwise as an engine of either format alone would.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import ModelConfig
from model.factory import build_model, quantized_copy
from model.gemma3 import Gemma3
from serving.config.config_files import read_config
from serving.config.engine_config import EngineConfig
from serving.config.server_config import ServerConfig
from serving.core.sched.step_plan import DecodeRow, PrefillRow, SamplingSettings
from serving.engine.backend_policy import BackendPolicy
from serving.engine.cpu_features import CpuFeatures
from serving.engine.engine import Engine
from serving.loading.mesh_loader import loaded_quantization
from tests.support.tiny_engine import TINY

AVX2 = CpuFeatures.from_flags({"AVX2": True})
ZEN4 = CpuFeatures.from_flags({"AVX512F": True, "AVX512BF16": True, "AVX512VNNI": True})
SPR = CpuFeatures.from_flags({"AVX512F": True, "AVX512_SPR": True})


def test_policy_rows_by_cpu_and_batch_invariance_off_with_them():
    auto = {cpu: BackendPolicy.for_platform("cpu", cpu=cpu, quantization="auto") for cpu in (AVX2, ZEN4, SPR)}
    assert {cpu: p.int8_max_rows for cpu, p in auto.items()} == {AVX2: 8, ZEN4: 2, SPR: 32}
    assert not any(p.batch_invariant for p in auto.values())
    assert BackendPolicy.for_platform("gpu", quantization="auto").int8_max_rows == 0
    for q in ("none", "int8"):
        plain = BackendPolicy.for_platform("cpu", cpu=AVX2, quantization=q)
        assert plain.int8_max_rows == 0 and plain.batch_invariant
    with pytest.raises(ValueError, match="batch invariance needs one weight format"):
        BackendPolicy.for_platform("cpu", cpu=AVX2, quantization="auto", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization must be"):
        BackendPolicy.for_platform("cpu", quantization="int4")
    assert "--quantization auto" in BackendPolicy.for_platform("cpu", cpu=AVX2).advice("bfloat16", False)


def test_server_setting_auto_loads_the_served_dtype():
    assert loaded_quantization(ServerConfig(quantization="auto")) == "none"
    assert loaded_quantization(ServerConfig(quantization="int8")) == "int8"
    # a mixture of experts has no int8 copy: the engine refuses it as --quantization int8 is
    moe = build_model(ModelConfig.from_dict(read_config("models.yaml")["tiny-moe"]["config"]),
                      rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="dense models only"):
        quantized_copy(moe)


def test_quantized_copy_shares_the_lookup_table_and_quantizes_the_matmuls():
    model = Gemma3(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    copy = quantized_copy(model)
    assert copy.embed_lookup.get_value() is model.embed_lookup.get_value()
    assert copy.wq.get_value().dtype == jnp.int8 and copy.wq_scale.get_value().dtype == jnp.float32
    assert copy.embed.get_value().dtype == jnp.int8 and model.wq.get_value().dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(copy.wq.get_value() * copy.wq_scale.get_value(), np.float32),
                               np.asarray(model.wq.get_value(), np.float32), atol=0.02)


CFG = EngineConfig(max_slots=4, num_pages=32, max_model_len=128, page_size=16, prefill_chunk=32,
                   min_decode_batch=1, kv_dtype="bfloat16")
LOGPROBS = SamplingSettings(logprobs=2)


def _out(out) -> tuple:
    return tuple(np.asarray(x) for x in (out.tokens, out.logprob, out.top_logprobs))


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_few_row_steps_run_the_int8_copy_and_larger_ones_the_served_weights():
    """int8 up to 2 rows: one prompt prefilled (16 tokens: served weights), then decoded alone
    (1 row: int8) and as 4 rows (bucket 4: served). Each step equals, bitwise, the same step
    of an engine that holds only that format, fed the same KV cache."""
    model = Gemma3(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    policy = BackendPolicy.for_platform("cpu", cpu=ZEN4, quantization="auto")
    single = dataclasses.replace(policy, int8_max_rows=0)  # the same compute, one format
    auto = Engine(model, CFG, policy=policy)
    served = Engine(model, CFG, policy=single)
    int8 = Engine(quantized_copy(model), CFG, policy=single)

    prompt = tuple([2] + [(7 * i) % 400 + 100 for i in range(12)])
    prefill = [PrefillRow("a", 0, 0, prompt, (1,), True, LOGPROBS)]
    first = _out(auto.prefill(prefill))
    assert _same(first, _out(served.prefill(prefill)))

    def decode(rows: int):
        """Each engine's step of `rows` copies of the prompt's next decode row, from the
        auto engine's KV cache and slot tokens."""
        for other in (served, int8):
            other.state = jax.tree.map(jnp.copy, auto.state)
        batch = [DecodeRow("a", 0, len(prompt), (1,), LOGPROBS)] * rows
        return [_out(e.decode(batch)) for e in (auto, served, int8)]

    got, by_served, by_int8 = decode(1)
    assert got[0].shape == (1,) and _same(got, by_int8)
    assert not _same(got, by_served), "int8 and served weights agree: the test cannot tell them apart"
    got, by_served, by_int8 = decode(4)
    assert got[0].shape == (4,) and _same(got, by_served)
    assert not _same(got, by_int8)
    # one program per shape, of the format its rows pick
    assert sorted(k[:2] for k in auto.compile_times) == [("decode", 1), ("decode", 4), ("prefill", 16)]


def test_generate_with_auto_runs_its_decode_steps_on_the_int8_copy(caplog):
    """The CLI path: the setting reaches the policy (bootstrap), the model loads in the served
    dtype (mesh loader), and the engine builds its int8 copy and decodes one row with it."""
    from serving.cli.main import main

    caplog.set_level(logging.INFO)
    assert main(["generate", "hi", "--model", "tiny-random", "--quantization", "auto",
                 "--max-tokens", "3", "--max-slots", "2", "--num-pages", "32", "--max-model-len", "128"]) == 0
    err = caplog.text
    rows = BackendPolicy.for_platform("cpu", quantization="auto").int8_max_rows
    assert f"int8 weights for steps of up to {rows} token rows, bfloat16 above" in err
    assert "compiled ('decode', 1," in err
