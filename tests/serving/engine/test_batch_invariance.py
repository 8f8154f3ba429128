"""Batch invariance in bfloat16 on the tiny-random model: a row's numbers never depend on its batch.

The backend policy's batch-invariant mode (``serving.engine.backend_policy``) sums the
RMSNorm means and the attention softmax in the fixed order of
``kernels_pallas.ordered_sum``. Here: that sum's own properties, RMSNorm of one
row among 1..256 rows, and the decoder end to end: a token's logits and K/V
bitwise the same whether its prompt was prefilled in one chunk or two (another
token bucket) or the token was decoded alone or among other rows, as a
preempted request's recomputation needs. Real-model checks: tests/serving/engine/test_engine_gemma.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas.attention import AttentionConfig
from kernels_pallas.dot_rows import DotRows
from kernels_pallas.kv_storage import from_storage
from kernels_pallas.ordered_sum import ordered_sum
from model.config import ModelConfig
from model.gemma3 import Gemma3
from model.kv_cache import KVCache
from model.layers import rms_norm
from serving.config.config_files import read_config
from serving.config.engine_config import EngineConfig
from serving.core.sched.step_plan import DecodeRow, PrefillRow
from serving.engine.backend_policy import BackendPolicy
from serving.engine.step_batch import DecodeBatch, PrefillBatch

TINY = ModelConfig.from_dict(read_config("models.yaml")["tiny-random"]["config"])
TINY_GROUP2 = dataclasses.replace(TINY, num_kv_heads=2)  # 2 query heads per KV head, as Qwen3 0.6B
INVARIANT = BackendPolicy.for_platform("cpu").compute(dtype=jnp.bfloat16)


def test_ordered_sum_fixed_order_and_zero_padding():
    x = np.random.default_rng(0).standard_normal((300, 640)).astype(np.float32)
    f = jax.jit(ordered_sum)
    alone = np.asarray(f(x[:1]))
    assert np.array_equal(np.asarray(f(x))[:1], alone)  # one row among 300
    padded = np.concatenate([x[:1], np.zeros((1, 1408), np.float32)], axis=1)  # 640 -> 2048 columns
    assert np.array_equal(np.asarray(f(padded)), alone)
    np.testing.assert_allclose(np.asarray(f(x)), x.sum(-1), rtol=1e-5, atol=1e-4)
    assert f(jnp.ones((2, 1))).shape == (2,) and ordered_sum(jnp.ones((3, 5)), keepdims=True).shape == (3, 1)


def test_rms_norm_of_a_row_does_not_depend_on_its_batch():
    """The same row alone and at the first and last place of 2..256 rows (XLA:CPU sums
    a [rows, 64] array in another order from 64 rows up)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((256, 64)) * 3, jnp.float32)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    f = jax.jit(lambda x: rms_norm(x, scale, 1e-6, INVARIANT))
    alone = np.asarray(f(x[:1]))[0]
    for rows in (2, 8, 63, 64, 256):
        for at in (0, rows - 1):
            out = np.asarray(f(x[:rows].at[at].set(x[0])))[at]
            assert np.array_equal(out, alone), f"row {at} of {rows}"


def test_dot_rows_counts():
    rows = DotRows(4, 16)
    assert [rows.count(m) for m in (1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 32, 33, 100)] == \
        [4, 4, 4, 4, 5, 16, 20, 20, 20, 20, 32, 36, 100]
    assert [DotRows(3).count(m) for m in (1, 3, 17)] == [3, 3, 17] and DotRows().count(1) == 1
    x = jnp.arange(6.0).reshape(3, 2)
    assert np.array_equal(rows.pad(x), [[0, 1], [2, 3], [4, 5], [4, 5]])
    assert rows.pad(jnp.ones((16, 2))).shape == (16, 2)
    with pytest.raises(ValueError, match="min_rows"):
        DotRows(0)
    with pytest.raises(ValueError, match="tile"):
        DotRows(4, 2)


@pytest.mark.parametrize("eq", ["td,de->te", "sd,vd->sv"])
def test_a_bf16_matmul_row_does_not_depend_on_its_row_count(eq):
    """Gemma 3 270M's K/V projection widths (640 -> 256) and a head-like transposed weight:
    each row of 1, 2, 3, 17, 18 and 33 rows bitwise equal to the same row among 64 (on an
    AMX CPU a 1- or 2-row tile runs on another kernel unless the policy pads it)."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((256, 640) if eq == "sd,vd->sv" else (640, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((64, 640)), jnp.float32)
    f = jax.jit(lambda a: INVARIANT.dot(eq, a, w, jnp.bfloat16))
    ref = np.asarray(f(x))
    for m in (1, 2, 3, 17, 18, 33):
        assert np.array_equal(np.asarray(f(x[:m])), ref[:m]), f"{m} rows"


def test_policy_turns_batch_invariance_on_for_low_precision_only():
    policy = BackendPolicy.for_platform("cpu")
    assert INVARIANT.batch_invariant and INVARIANT.attention.batch_invariant
    f32 = policy.compute(dtype=jnp.float32)  # float32 serving computes as it always has
    assert not f32.batch_invariant and not f32.attention.batch_invariant
    assert INVARIANT.dot_rows == INVARIANT.attention.dot_rows == policy.invariant_dot_rows != DotRows()
    plain_attention = dataclasses.replace(INVARIANT.attention, batch_invariant=False, dot_rows=DotRows())
    assert f32 == dataclasses.replace(INVARIANT, batch_invariant=False, attention=plain_attention,
                                      dot_rows=DotRows())
    off = BackendPolicy.for_platform("cpu", batch_invariant=False)
    assert not off.compute(dtype=jnp.bfloat16).batch_invariant
    assert not BackendPolicy.for_platform("cpu", attention_impl="pallas").batch_invariant
    with pytest.raises(ValueError, match="xla"):
        BackendPolicy.for_platform("cpu", attention_impl="pallas", batch_invariant=True)
    with pytest.raises(ValueError, match="xla"):
        AttentionConfig("triton", batch_invariant=True)


# -- the decoder end to end ------------------------------------------------------------

ENGINE = EngineConfig(max_slots=4, num_pages=32, max_model_len=128, page_size=16, prefill_chunk=64,
                      min_decode_batch=1, kv_dtype="bfloat16")


@pytest.fixture(scope="module", params=[TINY, TINY_GROUP2], ids=["group4", "group2"])
def tiny_bf16(request, jax_cache):
    """(graphdef, stored params, KV storage dtype, config) of the tiny-random decoder in
    bfloat16, stored as the CPU policy stores them: its own head layout (4 query heads on
    1 KV head) and 2 query heads per KV head (a decode step's attention dots then have
    2 rows, which the policy pads)."""
    policy = BackendPolicy.for_platform("cpu")
    graphdef, params = nnx.split(Gemma3(request.param, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return graphdef, policy.store_params(params), policy.storage_dtype(jnp.bfloat16), request.param


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, params, kv, batch, tokens, logits_indices):
    md = batch.attention_metadata(ENGINE.page_size)
    return nnx.merge(graphdef, params)(tokens, batch.positions, kv, md, logits_indices, compute=INVARIANT)


def _prefill(model, kv, row: PrefillRow):
    graphdef, params, *_ = model
    b = PrefillBatch.from_rows([row], ENGINE)
    return _forward(graphdef, params, kv, b, b.tokens, b.logits_indices)


def _decode(model, kv, rows: list[DecodeRow], tokens: list[int]):
    graphdef, params, *_ = model
    b = DecodeBatch.from_rows(rows, ENGINE)
    tokens = tokens + [0] * (b.slot_ids.shape[0] - len(tokens))
    return _forward(graphdef, params, kv, b, jnp.asarray(tokens, jnp.int32),
                    jnp.arange(len(tokens), dtype=jnp.int32))


def _seq_kv(kv: KVCache, pages, n: int) -> np.ndarray:
    """[2, layers, kv_heads, n, head_dim] float32: K and V of a sequence's first n positions."""
    slots = [pages[p // ENGINE.page_size] * ENGINE.page_size + p % ENGINE.page_size for p in range(n)]
    out = []
    for c in (kv.k, kv.v):
        c = np.asarray(from_storage(c).astype(jnp.float32))
        out.append(c.reshape(*c.shape[:2], -1, c.shape[-1])[:, :, slots])
    return np.stack(out)


def test_token_logits_and_kv_equal_across_chunking_and_decode_batches(tiny_bf16):
    """Token 39 of a 40-token prompt: prefilled whole (token bucket 64), as the end of a
    second chunk (bucket 32, the first 24 tokens already cached), and decoded alone
    (1 row) or at row 2 of 3 beside two other sequences: bitwise the same logits, and the
    same K/V for all 40 positions."""
    rng = np.random.default_rng(2)
    cfg = tiny_bf16[3]
    seq = [2] + rng.integers(3, cfg.vocab_size, 39).tolist()
    pages, others = (1, 2, 3), [(4, 5), (6, 7)]

    def fresh():
        return KVCache.zeros(cfg, ENGINE.num_pages, ENGINE.page_size, tiny_bf16[2])

    whole_logits, whole_kv = _prefill(tiny_bf16, fresh(), PrefillRow("a", 0, 0, tuple(seq), pages, True))
    ref_logits, ref_kv = np.asarray(whole_logits)[0], _seq_kv(whole_kv, pages, 40)

    _, kv = _prefill(tiny_bf16, fresh(), PrefillRow("a", 0, 0, tuple(seq[:24]), pages, False))
    logits, kv = _prefill(tiny_bf16, kv, PrefillRow("a", 0, 24, tuple(seq[24:]), pages, True))
    assert np.array_equal(np.asarray(logits)[0], ref_logits), "second chunk vs whole prompt: logits"
    assert np.array_equal(_seq_kv(kv, pages, 40), ref_kv), "second chunk vs whole prompt: K/V"

    _, base = _prefill(tiny_bf16, fresh(), PrefillRow("a", 0, 0, tuple(seq[:39]), pages, False))
    logits, kv = _decode(tiny_bf16, base, [DecodeRow("a", 0, 39, pages)], [seq[39]])
    assert np.array_equal(np.asarray(logits)[0], ref_logits), "decode alone vs prefill: logits"
    assert np.array_equal(_seq_kv(kv, pages, 40), ref_kv), "decode alone vs prefill: K/V"

    kv, rows, tokens = base, [], []
    for i, (n, pg) in enumerate(zip((23, 30), others)):
        other = [2] + rng.integers(3, cfg.vocab_size, n - 1).tolist()
        _, kv = _prefill(tiny_bf16, kv, PrefillRow(f"o{i}", i + 1, 0, tuple(other[:-1]), pg, False))
        rows.append(DecodeRow(f"o{i}", i + 1, n - 1, pg))
        tokens.append(other[-1])
    rows.insert(2, DecodeRow("a", 0, 39, pages))
    tokens.insert(2, seq[39])
    logits, kv = _decode(tiny_bf16, kv, rows, tokens)
    assert np.array_equal(np.asarray(logits)[2], ref_logits), "decode among 3 rows vs prefill: logits"
    assert np.array_equal(_seq_kv(kv, pages, 40), ref_kv), "decode among 3 rows vs prefill: K/V"


def test_a_prompt_alone_and_packed_among_six_computes_the_same(tiny_bf16):
    """A prompt prefilled alone (the 4-row bucket, S = 4) and as row 3 of 6 prompts (S = 16,
    ``prefill_rows_bucket``): bitwise the same logits and K/V."""
    graphdef, params, storage, cfg = tiny_bf16
    engine = dataclasses.replace(ENGINE, max_slots=16, max_prefill_seqs=16)
    rng = np.random.default_rng(3)
    seq = [2] + rng.integers(3, cfg.vocab_size, 19).tolist()
    others = [[2] + rng.integers(3, cfg.vocab_size, 7).tolist() for _ in range(5)]

    def run(rows):
        b = PrefillBatch.from_rows(rows, engine)
        kv = KVCache.zeros(cfg, engine.num_pages, engine.page_size, storage)
        return b.page_table.shape[0], *_forward(graphdef, params, kv, b, b.tokens, b.logits_indices)

    row = PrefillRow("a", 0, 0, tuple(seq), (1, 2), True)
    s_alone, alone_logits, alone_kv = run([row])
    packed = [PrefillRow(f"o{i}", i + 1, 0, tuple(o), (3 + i,), True) for i, o in enumerate(others)]
    s_packed, packed_logits, packed_kv = run(packed[:2] + [dataclasses.replace(row, slot=3)] + packed[2:])
    assert (s_alone, s_packed) == (4, 16)
    assert np.array_equal(np.asarray(packed_logits)[2], np.asarray(alone_logits)[0]), "logits"
    assert np.array_equal(_seq_kv(packed_kv, (1, 2), 20), _seq_kv(alone_kv, (1, 2), 20)), "K/V"
