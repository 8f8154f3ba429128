"""Several prompts per prefill step: the blocked ragged XLA prefill, its block table, batch
invariance when packed, the scheduler's packing and the engine end to end.

The attention cases reuse tests/kernels/test_paged_attention_xla.py's NaN-poisoned paged cache and
float64 reference (T = 16 tokens, S = 4 rows, 6 pages of 4 per row), forcing every block
size so chunks span one, several and partial blocks.
"""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dot_rows import DotRows
from kernels_pallas.paged_attention_xla import paged_prefill_attention_xla, prefill_query_blocks
from serving.config.engine_config import EngineConfig, prefill_page_bucket, prefill_rows_bucket
from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.core.sched.sched_request import SchedRequest
from serving.core.sched.scheduler import Scheduler
from tests.support.paged_attention_harness import SCALE, P, PagedCache, S, T, _i32, _round, run_prefill

CPU_DOT_ROWS = DotRows(min_rows=4, tile=16)  # serving.engine.backend_policy's on the AMX test machine


@functools.lru_cache(maxsize=None)
def blocked_fn(block_q=None, soft_cap=None, ordered_sums=False, dot_rows=DotRows()):
    def f(q, kp, vp, cu, kv_lens, table, num_seqs, w, lay):
        return paged_prefill_attention_xla(q, kp, vp, cu, kv_lens, table, num_seqs, scale=SCALE,
                                           sliding_window=w, soft_cap=soft_cap, ordered_sums=ordered_sums,
                                           block_q=block_q, dot_rows=dot_rows)
    return jax.jit(f)


# -- the block table ----------------------------------------------------------------------


def test_query_blocks_cover_every_packing():
    """The static block count covers any split of T tokens into at most S rows."""
    rng = random.Random(0)
    for tokens, seqs in ((16, 4), (64, 32), (512, 32), (512, 8), (32, 1)):
        for bq in (None, 1, 2, 8, 16, tokens):
            bq_, blocks = prefill_query_blocks(tokens, seqs, bq)
            for _ in range(200):
                rows = rng.randint(1, min(seqs, tokens))
                cuts = sorted(rng.sample(range(1, tokens + 1), rows))  # row ends, the last may be < T
                lens = np.diff([0] + cuts)
                assert sum(-(-n // bq_) for n in lens) <= blocks, (tokens, seqs, bq_, lens)
    assert prefill_query_blocks(512, 1) == (512, 1)  # one row: the single-sequence form
    assert prefill_query_blocks(16, 4, 4) == (4, 7)
    # The rule never picks a block whose dots DotRows would pad (1 query head per KV head: >= 4 tokens).
    bq, _ = prefill_query_blocks(128, 32, group=1, dot_rows=CPU_DOT_ROWS)
    assert CPU_DOT_ROWS.count(bq) == bq
    with pytest.raises(ValueError, match="block_q"):
        prefill_query_blocks(16, 4, 0)
    with pytest.raises(ValueError, match="max_seqs"):
        prefill_query_blocks(16, 0)


def test_prefill_page_bucket_and_seqs_clamp():
    cfg = EngineConfig(max_slots=8, page_size=16, num_pages=64, max_model_len=1024)
    assert cfg.max_prefill_seqs == 8  # the default (32) is clamped: each row takes a slot
    assert [prefill_page_bucket(n, cfg) for n in (1, 4, 5, 33, 64)] == [4, 4, 8, 64, 64]
    with pytest.raises(ValueError, match="max_prefill_seqs"):
        EngineConfig(max_prefill_seqs=0)
    # Rows (S): from 16 prompts a step, a step of up to 4 computes 4 rows of logits, more take
    # all 16; below 16, one bucket (a program fewer per shape to compile).
    wide = EngineConfig(max_slots=16, page_size=16, num_pages=64, max_model_len=1024)
    assert [prefill_rows_bucket(n, wide) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
    assert [prefill_rows_bucket(n, cfg) for n in (1, 4, 5, 8)] == [8, 8, 8, 8]


# -- attention against the per-sequence reference -------------------------------------------


@pytest.mark.parametrize("block_q", [1, 2, 4, 16, None])
@pytest.mark.parametrize("num_heads,kv_heads,soft_cap", [(4, 1, None), (8, 2, 5.0)])
def test_packed_matches_per_sequence_reference(block_q, num_heads, kv_heads, soft_cap):
    """Mixed lengths, chunks starting mid-sequence (a prefix hit or a later chunk), a
    chunk ending on a page, a 1-token row and padding rows/tokens, with and without a
    sliding window: each row equals attention over that sequence alone."""
    rng = np.random.default_rng(block_q or 0)
    fn = blocked_fn(block_q, soft_cap)
    for num_seqs, q_lens, kv_lens, window in (
            (3, [5, 6, 1], [5, 14, 4], None),       # from 0, mid-sequence, one token at a page end
            (4, [7, 1, 3, 5], [20, 9, 3, 24], 3),   # four rows, a sliding window of 3
            (2, [9, 7], [9, 16], 6),                # padding rows after two
            (1, [16], [24], None)):                 # one row filling the step, after a prefix of 8
        run_prefill(rng, num_seqs, q_lens, kv_lens, num_heads, kv_heads, jnp.float32, window=window,
                    soft_cap=soft_cap, fn=fn)


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 1), (4, 2)])
def test_bf16_token_output_is_the_same_packed_or_alone(num_heads, kv_heads):
    """ordered_sums (the batch-invariant mode): each row's tokens, packed with three other
    rows (S = 4), bitwise equal the same row alone, both in a 4-row step and in a 1-row
    program (S = 1: one block per step), with the CPU policy's DotRows."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [5, 2, 6, 3], [5, 9, 22, 3]
    cache = PagedCache(rng, kv_lens, kv_heads, jnp.bfloat16)
    q = jnp.asarray(_round(2.0 * rng.standard_normal((T, num_heads, 32)), jnp.bfloat16), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    packed_fn = blocked_fn(None, None, True, CPU_DOT_ROWS)
    packed = np.asarray(packed_fn(q, cache.k_pages, cache.v_pages, _i32(cu), _i32(kv_lens),
                                  _i32(cache.page_table), _i32(4), _i32(0), None).astype(jnp.float32))
    for s in range(4):
        alone_q = jnp.zeros_like(q).at[:q_lens[s]].set(q[cu[s]:cu[s + 1]])
        cu_alone = np.full(S + 1, q_lens[s], np.int32)
        cu_alone[0] = 0
        kv_alone = np.zeros(S, np.int32)
        kv_alone[0] = kv_lens[s]
        table_alone = np.zeros((S, P), np.int32)
        table_alone[0] = cache.page_table[s]
        alone = packed_fn(alone_q, cache.k_pages, cache.v_pages, _i32(cu_alone), _i32(kv_alone),
                          _i32(table_alone), _i32(1), _i32(0), None)
        one_row = packed_fn(alone_q, cache.k_pages, cache.v_pages, _i32([0, q_lens[s]]), _i32(kv_lens[s:s + 1]),
                            _i32(cache.page_table[s:s + 1]), _i32(1), _i32(0), None)
        want = packed[cu[s]:cu[s + 1]]
        assert np.array_equal(np.asarray(alone.astype(jnp.float32))[:q_lens[s]], want), f"row {s}, 4-row step"
        assert np.array_equal(np.asarray(one_row.astype(jnp.float32))[:q_lens[s]], want), f"row {s}, 1-row step"


# -- the scheduler --------------------------------------------------------------------------


def test_scheduler_packs_up_to_max_prefill_seqs_within_the_budget():
    """Seven waiting 6-token prompts, 3 rows and 16 prompt tokens per step: the first step
    packs two whole prompts; the third, which would need 6 of the 4 tokens left, waits for
    the next step rather than filling this one with its first chunk (Scheduler._would_split)."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=8, token_budget=24, max_prefill_tokens=16, max_prefill_seqs=3)
    for i in range(7):
        sched.add(SchedRequest(f"r{i}", [10 * i + j for j in range(6)], max_tokens=4))
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in plan.prefill] == [("r0", 6), ("r1", 6)]
    assert [r.samples for r in plan.prefill] == [True, True]
    sched.check_invariants()
    plan = sched.schedule()  # two decode rows, then the next two whole prompts
    assert [r.request_id for r in plan.decode] == ["r0", "r1"]
    assert [(r.request_id, len(r.token_ids)) for r in plan.prefill] == [("r2", 6), ("r3", 6)]
    assert plan.num_tokens <= 24
    sched.check_invariants()


def test_a_waiting_prompt_starts_in_the_padding_of_the_steps_bucket():
    """The same seven prompts with the engine's buckets (16 tokens here): the two whole
    prompts fill 12 of the step's 16 computed tokens, so the third starts in the 4 padding
    tokens the step computes anyway, and its last 2 tokens come in the next step: the seven
    prompts take three steps of 16 tokens, against four without the buckets."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=8, token_budget=24, max_prefill_tokens=16, max_prefill_seqs=3,
                      prefill_bucket=lambda n: 8 if n <= 8 else 16)
    for i in range(7):
        sched.add(SchedRequest(f"r{i}", [10 * i + j for j in range(6)], max_tokens=4))
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.samples) for r in plan.prefill] == [
        ("r0", 6, True), ("r1", 6, True), ("r2", 4, False)]
    sched.check_invariants()
    plan = sched.schedule()  # r2's last 2 tokens, then two whole prompts (3 rows a step)
    assert [r.request_id for r in plan.decode] == ["r0", "r1"]
    assert [(r.request_id, r.start, len(r.token_ids), r.samples) for r in plan.prefill] == [
        ("r2", 4, 2, True), ("r3", 0, 6, True), ("r4", 0, 6, True)]
    sched.check_invariants()
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in plan.prefill] == [("r5", 6), ("r6", 6)]
    sched.check_invariants()
    # Not when the third row would take the step into a larger row bucket (2 -> 3 rows).
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=8, token_budget=24, max_prefill_tokens=16, max_prefill_seqs=3,
                      prefill_bucket=lambda n: 8 if n <= 8 else 16, prefill_rows=lambda n: 2 if n <= 2 else 3)
    for i in range(3):
        sched.add(SchedRequest(f"r{i}", [10 * i + j for j in range(6)], max_tokens=4))
    assert [r.request_id for r in sched.schedule().prefill] == ["r0", "r1"]


def test_a_prompt_longer_than_a_step_starts_in_the_rest_of_one_and_the_first_is_chunked():
    """What still splits: the step's first prompt when it exceeds the step, and a waiting
    prompt longer than ``max_prefill_tokens`` (it is chunked wherever it starts)."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, num_slots=8, token_budget=24, max_prefill_tokens=16, max_prefill_seqs=3)
    sched.add(SchedRequest("short", list(range(6)), max_tokens=4))
    sched.add(SchedRequest("long", list(range(100, 140)), max_tokens=4))
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids)) for r in plan.prefill] == [("short", 6), ("long", 10)]
    sched.check_invariants()
    kv2 = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched2 = Scheduler(kv2, num_slots=8, token_budget=24, max_prefill_tokens=16, max_prefill_seqs=3)
    sched2.add(SchedRequest("first", list(range(20)), max_tokens=4))
    plan = sched2.schedule()
    assert [(r.request_id, len(r.token_ids), r.samples) for r in plan.prefill] == [("first", 16, False)]
