"""``--cpu-kernels``: the backend policy's choice of the int8 dots' integer product per CPU and
setting, the setting's path from the server config, and an engine decoding a tiny random int8
model through the kernels: the same tokens and log probabilities, bitwise, as through XLA's
dot, and a row's result the same alone or in a batch. The same for the bf16 kernel (a tiny
bfloat16 model: XLA's results within float32 summation error, batch-invariant bitwise)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_cpu
from kernels_cpu import Bf16Matmul, Int8Matmul
from model.factory import quantized_copy
from model.gemma3 import Gemma3
from serving.config.engine_config import EngineConfig
from serving.config.server_config import ServerConfig
from serving.core.sched.step_plan import DecodeRow, PrefillRow, SamplingSettings
from serving.engine.backend_policy import (
    CPU_BF16_HEAD_MIN_COLUMNS,
    CPU_BF16_KERNEL_MAX_ROWS,
    CPU_KERNEL_MAX_ROWS,
    BackendPolicy,
)
from serving.engine.cpu_features import CpuFeatures
from serving.engine.engine import Engine
from tests.support.tiny_engine import TINY

AVX2 = CpuFeatures.from_flags({"AVX2": True})
SPR = CpuFeatures.from_flags({"AVX512F": True, "AVX512_SPR": True, "AVX512VNNI": True})
ZEN4 = CpuFeatures.from_flags({"AVX512F": True, "AVX512BF16": True, "AVX512VNNI": True})  # no AMX
needs_kernels = pytest.mark.skipif(not kernels_cpu.available(), reason="the CPU kernels were not built")


@needs_kernels
def test_policy_picks_the_kernel_by_setting_and_cpu(monkeypatch):
    def pick(setting, cpu=SPR, platform="cpu"):
        return BackendPolicy.for_platform(platform, cpu=cpu, quantization="int8", cpu_kernels=setting).int8_matmul

    # "auto": the VNNI path up to 4 rows, the AMX-INT8 tiles above where the CPU has AMX and
    # the library runs them (Linux lent the tiles), else XLA's dot above (the fallback)
    monkeypatch.setattr(kernels_cpu, "isas", lambda: ("avx2", "avx512", "amx", "amx_int8", "scalar"))
    assert pick("auto") == Int8Matmul(max_rows=CPU_KERNEL_MAX_ROWS, amx=True)
    assert pick("auto", ZEN4) == Int8Matmul(max_rows=CPU_KERNEL_MAX_ROWS, amx=False)  # no AMX
    monkeypatch.setattr(kernels_cpu, "isas", lambda: ("avx2", "avx512", "scalar"))  # tiles not lent
    assert pick("auto") == Int8Matmul(max_rows=CPU_KERNEL_MAX_ROWS, amx=False)
    assert pick("auto", AVX2) is None  # the AVX2 path is not measured faster
    assert pick("on", AVX2) == Int8Matmul() and pick("on") == Int8Matmul()
    assert pick("off") is None and pick("on", platform="gpu") is None
    assert BackendPolicy.for_platform("cpu", cpu=SPR).int8_matmul is None  # the library default: off
    policy = BackendPolicy.for_platform("cpu", cpu=SPR, cpu_kernels="on")
    assert policy.compute(dtype=jnp.bfloat16).int8_matmul == Int8Matmul()
    with pytest.raises(ValueError, match="cpu_kernels must be"):
        BackendPolicy.for_platform("cpu", cpu=SPR, cpu_kernels="yes")


@needs_kernels
def test_a_mesh_of_several_devices_keeps_xla_dots(caplog):
    """The kernels have no sharding rule: a multi-device mesh turns them off ("on" says so)."""
    import types

    dev = jax.devices("cpu")[0]
    one, two = (types.SimpleNamespace(devices=np.array([dev] * n, dtype=object)) for n in (1, 2))
    assert BackendPolicy.detect(one, cpu_kernels="on").int8_matmul == Int8Matmul()
    assert BackendPolicy.detect(two, cpu_kernels="auto").int8_matmul is None
    assert BackendPolicy.detect(two, cpu_kernels="on").int8_matmul is None
    assert "serve one device only" in caplog.text


@needs_kernels
def test_the_default_quantization_is_int8_for_a_quantized_file_where_the_kernel_serves_it(monkeypatch):
    """--quantization unset: int8 for a bf16 model whose file stores quantized blocks, on one
    CPU device whose int8 dots get the kernel; "none" for float files, float32 serving,
    --cpu-kernels off, a CPU the kernel is not chosen on, a mesh, an accelerator, and where the
    library is missing."""
    def default(platform="cpu", cpu=SPR, stored=True, dtype="bfloat16", kernels="auto", devices=1):
        return BackendPolicy.default_quantization(platform, cpu, stored_quantized=stored, dtype=dtype,
                                                  cpu_kernels=kernels, devices=devices)

    assert default() == "int8" and default(kernels="on") == "int8" and default(cpu=ZEN4) == "int8"
    assert default(cpu=AVX2) == "none"  # "auto" gives AVX2-only CPUs XLA's dot: bf16 stays
    assert default(cpu=AVX2, kernels="on") == "int8"
    assert default(stored=False) == "none" and default(dtype="float32") == "none"
    assert default(kernels="off") == "none" and default(devices=2) == "none"
    assert default("gpu") == "none" and default("tpu") == "none"
    with pytest.raises(ValueError, match="cpu_kernels must be"):
        default(kernels="always")
    monkeypatch.setattr(BackendPolicy, "cpu_int8_matmul", staticmethod(lambda setting, cpu: None))  # no library
    assert default() == "none"


def test_the_server_resolves_an_unset_quantization(monkeypatch):
    """``with_default_quantization``: an explicit value stays; unset asks the policy with the
    model's storage (the default gemma-3-270m GGUF package: quantized; tiny-random: float)."""
    from serving.cli.bootstrap import with_default_quantization
    from serving.loading.mesh_loader import loaded_quantization

    asked = []

    def policy(platform, cpu=None, **kw):
        asked.append(kw)
        return "int8" if kw["stored_quantized"] else "none"

    monkeypatch.setattr(BackendPolicy, "default_quantization", staticmethod(policy))
    assert ServerConfig().quantization is None and loaded_quantization(ServerConfig()) == "none"
    assert with_default_quantization(ServerConfig(quantization="none")).quantization == "none" and not asked
    assert with_default_quantization(ServerConfig()).quantization == "int8"  # gemma-3-270m
    assert asked[-1] == dict(stored_quantized=True, dtype="bfloat16", cpu_kernels="auto", devices=1)
    assert with_default_quantization(ServerConfig(model="tiny-random")).quantization == "none"
    assert with_default_quantization(ServerConfig(checkpoint="/ckpt")).quantization == "none"
    # drafts from the int8 copy of the served weights: those stay bf16
    n = len(asked)
    drafting = ServerConfig(speculative="draft", draft_model="self:int8", num_speculative_tokens=2)
    assert with_default_quantization(drafting).quantization == "none" and len(asked) == n


def test_self_int8_drafts_of_int8_weights_are_refused():
    """An int8-served model drafting from its own int8 weights with the whole vocabulary (the
    tiny one is under the default draft vocabulary) would verify each draft with the same
    model: a clear error at start (tests/serving/core/test_speculative_draft_vocab.py: with a
    smaller draft vocabulary it drafts)."""
    import jax.numpy as jnp
    from flax import nnx

    from model.gemma3 import Gemma3
    from serving.config.engine_config import EngineConfig
    from serving.config.speculative_config import SpeculativeConfig
    from serving.engine.engine import Engine
    from tests.support.tiny_engine import TINY

    model = Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0), quantization="int8")
    spec = SpeculativeConfig(method="draft", num_tokens=2, max_batch=4, draft_model="self:int8")
    with pytest.raises(ValueError, match="--quantization none"):
        Engine(model, EngineConfig(max_slots=4, num_pages=64, max_model_len=256, page_size=8, prefill_chunk=32,
                                   min_decode_batch=2, speculative=spec))


def test_server_setting():
    assert ServerConfig().cpu_kernels == "auto"
    with pytest.raises(ValueError, match="cpu_kernels must be auto, on or off"):
        ServerConfig(cpu_kernels="always")


@dataclasses.dataclass(frozen=True)
class _Counted(Int8Matmul):
    """Int8Matmul that counts the products traced through it."""

    def __call__(self, x, w, contract, layer=None):
        _TRACED.append((x.shape, w.shape))
        return super().__call__(x, w, contract, layer)


_TRACED: list = []
CFG = EngineConfig(max_slots=4, num_pages=32, max_model_len=128, page_size=16, prefill_chunk=32,
                   min_decode_batch=1, kv_dtype="bfloat16")
LOGPROBS = SamplingSettings(logprobs=2)


def _out(out) -> tuple:
    return tuple(np.asarray(x) for x in (out.tokens, out.logprob, out.top_logprobs))


@needs_kernels
def test_engine_decodes_the_same_through_the_kernels():
    """A tiny bfloat16 Gemma 3 as int8 ("int8x2" dots): a prefill and a 1-row decode step
    through the kernel (the layers' int8 matrices handed over in their stacks) and through
    XLA's dot are equal bitwise, and the 1-row step's row
    equals each row of a 3-row step from the same cache (batch invariance). The kernel as the
    server's "auto" routes it (tests/kernels_cpu compare every path with XLA's dot): its VNNI
    path up to 4 int8 rows (the 1-row step), above them its AMX-INT8 tiles where this CPU lends
    them (the prefill and the 3-row step), else XLA's dot."""
    model = quantized_copy(Gemma3(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    xla = BackendPolicy.for_platform("cpu", quantization="int8", cpu_kernels="off")
    assert xla.quantized_dot == "int8x2"
    _TRACED.clear()
    routed = _Counted(max_rows=CPU_KERNEL_MAX_ROWS, amx="amx_int8" in kernels_cpu.isas())
    kernel = Engine(model, CFG, policy=dataclasses.replace(xla, int8_matmul=routed))
    plain = Engine(model, CFG, policy=xla)

    prompt = tuple([2] + [(7 * i) % 400 + 100 for i in range(12)])
    prefill = [PrefillRow("a", 0, 0, prompt, (1,), True, LOGPROBS)]
    first = _out(kernel.prefill(prefill))
    assert all(np.array_equal(a, b) for a, b in zip(first, _out(plain.prefill(prefill))))
    assert _TRACED, "the engine's steps did not call the kernel"
    # the layer matrices reach it as their [L, ...] stacks (read in place), the head as [V, D]
    assert {len(w) for _, w in _TRACED} == {2, 3}
    assert all(w[0] == TINY.num_layers for _, w in _TRACED if len(w) == 3)

    def decode(engine, rows):
        engine.state = jax.tree.map(jnp.copy, start)
        return _out(engine.decode([DecodeRow("a", 0, len(prompt), (1,), LOGPROBS)] * rows))

    start = jax.tree.map(jnp.copy, kernel.state)
    one = decode(kernel, 1)
    for a, b in zip(one, decode(plain, 1)):
        np.testing.assert_array_equal(a, b)
    for a1, a3 in zip(one, decode(kernel, 3)):
        assert a3.shape[0] >= 3  # the bucket's rows
        for r in range(3):
            np.testing.assert_array_equal(a1[0], a3[r])


@needs_kernels
def test_policy_picks_the_bf16_kernel_by_setting_and_invariance(monkeypatch):
    def pick(setting, cpu=SPR, invariant=None):
        return BackendPolicy.for_platform("cpu", cpu=cpu, cpu_kernels=setting,
                                          batch_invariant=invariant).bf16_matmul

    # bf16 serving is batch-invariant by default: the output head's dot in the AMX path where
    # the library runs it (at every row count, chosen by the weight's shape), else XLA's dot
    head = Bf16Matmul(isa="amx", contracts=(1,), min_columns=CPU_BF16_HEAD_MIN_COLUMNS)
    monkeypatch.setattr(kernels_cpu, "isas", lambda: ("avx2", "avx512", "amx", "scalar"))
    assert pick("auto") == head and pick("auto", ZEN4) is None and pick("auto", AVX2) is None
    monkeypatch.setattr(kernels_cpu, "isas", lambda: ("avx2", "avx512", "scalar"))  # tiles not lent
    assert pick("auto") is None
    assert pick("auto", invariant=False) == Bf16Matmul(max_rows=CPU_BF16_KERNEL_MAX_ROWS)
    assert pick("auto", AVX2, invariant=False) is None
    assert pick("on") == Bf16Matmul() and pick("on", AVX2) == Bf16Matmul()
    assert pick("off", invariant=False) is None
    policy = BackendPolicy.for_platform("cpu", cpu=SPR, cpu_kernels="on")
    assert policy.compute(dtype=jnp.bfloat16).bf16_matmul == Bf16Matmul()


@dataclasses.dataclass(frozen=True)
class _CountedBf16(Bf16Matmul):
    """Bf16Matmul that counts the products traced through it."""

    def __call__(self, x, w, contract):
        _TRACED.append((x.shape, w.shape))
        return super().__call__(x, w, contract)


@needs_kernels
@pytest.mark.parametrize("served", ["every", "head"])
def test_engine_decodes_bf16_through_the_kernel(served):
    """A tiny random bfloat16 Gemma 3 with every 2-D matmul in the bf16 kernel ("every", as
    ``--cpu-kernels on``), or only its output head's ("head", as the batch-invariant "auto" on an
    AMX CPU; the AMX path where Linux lends the tiles, the tiny vocabulary let through):
    prefill and a 1-row decode step give XLA's tokens and log probabilities within float32
    summation error (the kernel sums in another order), and the 1-row step's row equals each
    row of a 3-row step from the same cache bitwise (batch invariance)."""
    model = Gemma3(TINY, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    xla = BackendPolicy.for_platform("cpu", cpu_kernels="off")
    assert xla.batch_invariant and xla.bf16_matmul is None
    _TRACED.clear()
    counted = _CountedBf16() if served == "every" else _CountedBf16(
        isa="amx" if "amx" in kernels_cpu.isas() else "auto", contracts=(1,))
    kernel = Engine(model, CFG, policy=dataclasses.replace(xla, bf16_matmul=counted))
    plain = Engine(model, CFG, policy=xla)

    prompt = tuple([2] + [(7 * i) % 400 + 100 for i in range(12)])
    prefill = [PrefillRow("a", 0, 0, prompt, (1,), True, LOGPROBS)]
    first, want = _out(kernel.prefill(prefill)), _out(plain.prefill(prefill))
    assert _TRACED, "the engine's steps did not call the kernel"
    if served == "head":
        assert {w for _, w in _TRACED} == {(TINY.vocab_size, TINY.hidden_size)}, _TRACED
    np.testing.assert_array_equal(first[0], want[0])
    np.testing.assert_allclose(first[1], want[1], atol=2e-2)

    def decode(engine, rows):
        engine.state = jax.tree.map(jnp.copy, start)
        return _out(engine.decode([DecodeRow("a", 0, len(prompt), (1,), LOGPROBS)] * rows))

    start = jax.tree.map(jnp.copy, kernel.state)
    one, ref = decode(kernel, 1), decode(plain, 1)
    np.testing.assert_array_equal(one[0], ref[0])
    np.testing.assert_allclose(one[1], ref[1], atol=2e-2)
    np.testing.assert_allclose(one[2], ref[2], atol=2e-2)
    for a1, a3 in zip(one, decode(kernel, 3)):
        assert a3.shape[0] >= 3
        for r in range(3):
            np.testing.assert_array_equal(a1[0], a3[r])
