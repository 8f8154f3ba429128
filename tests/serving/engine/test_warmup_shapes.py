"""What ``Engine.warmup`` compiles: every prefill shape a stream of fresh prompts reaches.

A compile during serving stalls every stream for seconds, so after warmup a closed loop of
fresh prompts of up to one chunk (no prefix-cache hits) must find each of its prefill steps'
programs compiled: the steps of whole prompts packed together, those whose prompt started in
another step's bucket padding (``Scheduler._padding``) and so ends in a chunk of fewer tokens
than its page-table width, and both row buckets (``prefill_rows_bucket``).
"""

from __future__ import annotations

import random

import pytest

from serving.core.sched.sched_request import SchedRequest, Status
from serving.engine.step_batch import PrefillBatch
from tests.support.tiny_engine import make_loop


@pytest.mark.slow(50)
def test_after_warmup_a_closed_loop_of_fresh_prompts_compiles_nothing():
    """After ``warmup``, a closed loop of fresh prompts compiles no prefill program.

    Slow: the warmup itself compiles every prefill shape of a 16-slot engine (both row buckets,
    each token bucket and page-table width): the one test of the warmup, so cold by design."""
    # 4-token pages: prefill page-table widths of 16 and 32 pages (64 and 128 tokens).
    loop = make_loop(max_slots=16, page_size=4, num_pages=512, max_model_len=256, prefill_chunk=128,
                     enable_prefix_caching=False)
    engine, sched, cfg = loop.engine, loop.scheduler, loop.cfg
    engine.warmup(decode=False)
    warm = {key for key in engine.compile_times if key[0] == "prefill"}
    assert {key[3] for key in warm} == {4, 16}  # both row buckets

    rng = random.Random(0)
    lengths = [rng.randrange(5, 128) for _ in range(32)] + [rng.randrange(3, 12) for _ in range(8)]
    waiting = [SchedRequest(f"r{i}", [2] + [rng.randrange(3, 400) for _ in range(n)], max_tokens=3)
               for i, n in enumerate(lengths)]  # popped from the end: 8 short prompts arrive first
    live: list[SchedRequest] = []
    seen, continued = set(), 0
    while waiting or live:
        while waiting and len(live) < 16:  # a closed loop of 16 streams
            live.append(waiting.pop())
            sched.add(live[-1])
        plan = sched.schedule()
        if plan.prefill:
            key = PrefillBatch.from_rows(plan.prefill, cfg).shape_key
            assert key in warm, f"{key} compiles while serving: {[(r.start, r.end) for r in plan.prefill]}"
            seen.add(key)
            continued += any(r.start > 0 for r in plan.prefill)
        by_id = {r.request_id: r for r in live}
        for row in [r for r in plan.prefill if r.samples] + plan.decode:
            req = by_id[row.request_id]
            reason = sched.on_token(req, 5)
            if reason:
                sched.finish(req, reason)
        live = [r for r in live if r.status is not Status.FINISHED]
    assert continued > 0, "no prompt started in another step's padding: the test proves little"
    assert {key[3] for key in seen} == {4, 16}
