"""The batching loop on the tiny-random model: slots, pages, finish reasons, cancellation, errors."""

from __future__ import annotations

import asyncio

import pytest

from serving.contract.engine_client import EngineOverloadedError, EngineRequest, RequestRejectedError, SamplingParams
from serving.runtime.turn_profile import PARTS
from tests.support.engine_helpers import collect, generate, request
from tests.support.tiny_engine import TINY, all_pages_free, make_loop, prompt


@pytest.fixture(scope="module")
def loop(jax_cache):
    loop = make_loop()
    loop.start(warmup=False)
    yield loop
    loop.stop()


def test_max_tokens_finishes_with_length(loop):
    ids, events = asyncio.run(collect(loop, request(prompt(5), max_tokens=7, ignore_eos=True)))
    assert len(ids) == 7
    assert events[-1].finish_reason == "length"
    assert events[-1].completion_tokens == 7 and events[-1].prompt_tokens == 5
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert all_pages_free(loop)


def test_stop_token_finishes_with_stop(loop):
    """A stop id that the greedy output reaches after other tokens (the tiny model's outputs
    are runs of one token: the first of eight prompts whose output changes token) ends the
    request there, the stop token included."""
    prompts = [prompt(6, offset) for offset in range(8)]
    outs = generate(loop, [request(p, max_tokens=10, ignore_eos=True) for p in prompts])
    switch = [(i, j) for i, ids in enumerate(outs) for j in range(1, len(ids)) if ids[j] not in ids[:j]]
    assert switch, outs
    i, j = switch[0]
    ids, events = asyncio.run(collect(loop, request(prompts[i], max_tokens=10, stop_token_ids=(outs[i][j],))))
    assert ids == outs[i][:j + 1]
    assert events[-1].finish_reason == "stop"


def test_more_requests_than_slots_all_complete(loop):
    reqs = [request(prompt(3 + i, i), max_tokens=5 + i % 4, ignore_eos=True) for i in range(12)]
    outs = generate(loop, reqs)
    assert [len(o) for o in outs] == [5 + i % 4 for i in range(12)]
    assert all_pages_free(loop)


def test_long_prompt_is_chunked_and_matches_single_chunk():
    """A 100-token prompt in 16-token chunks gives the same greedy ids as in one 128 chunk."""
    outs = []
    for chunk in (16, 128):
        lp = make_loop(prefill_chunk=chunk)
        lp.start(warmup=False)
        try:
            outs.append(generate(lp, [request(prompt(100), max_tokens=8, ignore_eos=True)])[0])
        finally:
            lp.stop()
    assert outs[0] == outs[1]


def test_ragged_prefill_packs_sequences_like_one_at_a_time():
    reqs = lambda: [request(prompt(n, n), max_tokens=6, ignore_eos=True) for n in (3, 17, 9, 30)]
    results = []
    for seqs in (1, 4):
        lp = make_loop(max_prefill_seqs=seqs, prefill_chunk=64)
        lp.start(warmup=False)
        try:
            results.append(generate(lp, reqs()))
        finally:
            lp.stop()
    assert results[0] == results[1]


def test_cancel_stops_within_a_step_and_frees_pages(loop):
    plans = []
    loop.on_step = plans.append

    async def main():
        req = request(prompt(4), max_tokens=200, ignore_eos=True)
        got = []
        async for ev in loop.submit(req):
            got.append(ev)
            if len(got) == 3:
                planned_at_cancel = len(plans)
                await loop.cancel(req.request_id)
            if ev.finish_reason:
                break
        return req.request_id, got, planned_at_cancel

    try:
        rid, events, planned_at_cancel = asyncio.run(main())
    finally:
        loop.on_step = None
    assert events[-1].finish_reason == "cancelled"
    # At most the step being planned when the cancel arrived still ran it.
    after = [p for p in plans[planned_at_cancel:] if any(r.request_id == rid for r in p.decode)]
    assert len(after) <= 1
    assert events[-1].completion_tokens < 200  # usage so far is reported
    assert all_pages_free(loop)


def test_abandoned_stream_is_cancelled(loop):
    async def main():
        req = request(prompt(4), max_tokens=200, ignore_eos=True)
        stream = loop.submit(req)
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if all_pages_free(loop):
                return True
            await asyncio.sleep(0.02)
        return False

    assert asyncio.run(main())


def test_rejects_what_can_never_fit(loop):
    async def submit(req):
        loop.submit(req)

    with pytest.raises(RequestRejectedError, match="context window of 256"):
        asyncio.run(submit(request(prompt(200), max_tokens=100)))
    with pytest.raises(RequestRejectedError, match="empty"):
        asyncio.run(submit(request([], max_tokens=1)))
    with pytest.raises(RequestRejectedError, match="token ids"):
        asyncio.run(submit(request([2, TINY.vocab_size], max_tokens=1)))


def test_a_burst_at_an_idle_loop_fills_the_free_slots_before_it_counts_as_waiting():
    """4 free slots + max_waiting 2: a burst of 6 is accepted (and served), the 7th gets 503."""
    lp = make_loop(max_waiting=2)  # 4 slots; not started yet: the burst sits in the inbox

    async def main():
        streams = [lp.submit(request(prompt(3, i), max_tokens=2, ignore_eos=True)) for i in range(6)]
        with pytest.raises(EngineOverloadedError, match="2 requests"):
            lp.submit(request(prompt(3)))
        lp.start(warmup=False)
        outs = []
        for stream in streams:
            outs.append([t async for ev in stream for t in ev.token_ids])
        return outs

    try:
        assert [len(ids) for ids in asyncio.run(main())] == [2] * 6
    finally:
        lp.stop()


def test_waiting_queue_is_bounded_by_prompt_tokens_too():
    lp = make_loop()
    lp.max_waiting_tokens = 12  # not started: nothing leaves the queue

    async def main():
        for i in range(lp.cfg.max_slots):  # these take the free slots: not waiting
            lp.submit(request(prompt(20, i)))
        lp.submit(request(prompt(8)))
        with pytest.raises(EngineOverloadedError, match="8 prompt tokens"):
            lp.submit(request(prompt(8)))
        lp.submit(request(prompt(4)))

    asyncio.run(main())


def test_draining_refuses_new_requests(loop):
    lp = make_loop()
    lp.drain()
    assert not lp.is_ready()

    async def main():
        with pytest.raises(EngineOverloadedError, match="shutting down"):
            lp.submit(request(prompt(3)))

    asyncio.run(main())


def test_seeded_sampling_is_reproducible(loop):
    s = dict(max_tokens=8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    a = generate(loop, [request(prompt(5), **s)])[0]
    b = generate(loop, [request(prompt(9, 3), max_tokens=8, temperature=1.0, seed=1, ignore_eos=True),
                        request(prompt(5), **s)])[1]
    assert a == b


def run_with(requests_fn, **overrides) -> tuple[list[list[int]], list]:
    """Runs fresh requests on a fresh loop; returns outputs and every step plan."""
    lp = make_loop(**overrides)
    plans = []
    lp.on_step = plans.append
    lp.start(warmup=False)
    try:
        return generate(lp, requests_fn()), plans
    finally:
        lp.stop()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=3)])
def test_preempted_requests_match_running_alone(sampling, jax_cache):
    reqs = lambda: [request(prompt(20, i), max_tokens=30, ignore_eos=True,
                            **{**sampling, **({"seed": 3 + i} if "seed" in sampling else {})})
                    for i in range(4)]
    # 12 pages of 8 tokens: each request needs 7 alone, so four at once must preempt.
    crowded, plans = run_with(reqs, num_pages=13, max_model_len=96)
    assert any(p.preempted for p in plans)
    alone = [run_with(lambda r=r: [r], num_pages=13, max_model_len=96)[0][0] for r in reqs()]
    assert crowded == alone


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=11)])
def test_prefix_cache_hit_matches_uncached(sampling, jax_cache):
    system = prompt(41, 5)  # 5 full pages of 8 tokens, then one more token
    reqs = lambda: [request(system + [300 + i, 301, 302], max_tokens=6, ignore_eos=True, **sampling)
                    for i in range(3)]
    lp = make_loop(num_pages=64)
    lp.start(warmup=False)
    try:
        first = generate(lp, reqs()[:1])
        events = [asyncio.run(collect(lp, r)) for r in reqs()[1:]]
    finally:
        lp.stop()
    cached_outs = first + [ids for ids, _ in events]
    assert [ev[-1].cached_tokens for _, ev in events] == [40, 40]
    uncached, _ = run_with(reqs, enable_prefix_caching=False)
    assert cached_outs == uncached


def test_running_streams_never_miss_a_step_while_a_long_prompt_prefills(jax_cache):
    """32 streams decode; a 4k-token prompt arrives; every stream still decodes every step."""
    lp = make_loop(max_slots=33, num_pages=1200, max_model_len=4608, prefill_chunk=256,
                   min_decode_batch=8)
    plans = []
    lp.on_step = plans.append
    lp.start(warmup=False)

    async def main():
        streams = [asyncio.ensure_future(collect(lp, request(prompt(8, i), max_tokens=40, ignore_eos=True)))
                   for i in range(32)]
        while len(plans) < 10:  # let every stream start decoding
            await asyncio.sleep(0.01)
        long = asyncio.ensure_future(collect(lp, request(prompt(4096, 1), max_tokens=2, ignore_eos=True)))
        return await asyncio.gather(*streams), await long

    try:
        outs, (long_ids, _) = asyncio.run(main())
    finally:
        lp.stop()
    assert all(len(ids) == 40 for ids, _ in outs) and len(long_ids) == 2
    chunked = [i for i, p in enumerate(plans) if any(len(c.token_ids) > 100 for c in p.prefill)]
    assert len(chunked) >= 4096 // 256  # the long prompt was cut into chunks
    for i in chunked:
        before = {r.request_id for r in plans[i - 1].decode}
        later = {r.request_id for p in plans[i + 1:] for r in p.decode}
        now = {r.request_id for r in plans[i].decode}
        # A stream that decoded before this chunk and decodes after it also decodes with it.
        assert before & later <= now, f"step {i}: {sorted(before & later - now)} skipped a step"
        assert plans[i].num_tokens <= lp.scheduler.token_budget


def test_rejects_what_can_never_fit_the_cache():
    lp = make_loop(num_pages=8, max_model_len=256)  # 7 usable pages of 8 tokens

    async def submit():
        lp.submit(request(prompt(40), max_tokens=40))

    with pytest.raises(RequestRejectedError, match="needs 10 KV-cache pages but the cache has 7; lower max_tokens"):
        asyncio.run(submit())

    async def submit_long():
        lp.submit(request(prompt(64), max_tokens=1))  # the prompt alone needs 8 pages

    with pytest.raises(RequestRejectedError, match="needs 9 KV-cache pages but the cache has 7; shorten the prompt"):
        asyncio.run(submit_long())


def test_kv_capacity_is_what_a_request_can_hold_alone():
    lp = make_loop(num_pages=8, max_model_len=256)  # 7 usable pages of 8 tokens
    assert lp.kv_capacity_tokens == 56

    async def submit(max_tokens):
        lp.submit(request(prompt(20), max_tokens=max_tokens))

    asyncio.run(submit(36))  # 20 + 36 = 56: accepted (it queues: the loop is not started)
    with pytest.raises(RequestRejectedError, match="KV-cache pages"):
        asyncio.run(submit(37))


def choices(prompt_ids, n: int, seed: int, max_tokens: int, parent_max_tokens=None, salt=None,
            family: bool = True) -> list[EngineRequest]:
    """``n`` seeded choices of one prompt as the gateway submits them (the first is the parent;
    seeds seed + index), or, with ``family`` False, the same as unrelated requests."""
    first = request(prompt_ids)
    return [EngineRequest(
        f"{first.request_id}-{i}", list(prompt_ids),
        SamplingParams(max_tokens=parent_max_tokens if i == 0 and parent_max_tokens else max_tokens,
                       temperature=1.0, seed=seed + i, ignore_eos=True),
        cache_salt=salt if family else f"alone-{i}",
        parent_id=f"{first.request_id}-0" if family and i else None) for i in range(n)]


@pytest.mark.parametrize("length, parent_max_tokens", [(13, None), (17, None), (13, 1)])
def test_n_choices_compute_the_prompt_once_and_equal_separate_requests(loop, length, parent_max_tokens):
    """3 choices with seeds s, s+1, s+2 give the tokens of 3 separate requests with those seeds;
    the plans compute the prompt once (one full row, then one 1-token row per child) and the
    children report the shared tokens as cached. 13 tokens: the children's last prompt token
    shares a page with 4 computed ones (copied); 17: it starts a page (nothing copied). A parent
    with max_tokens 1 is gone one step after its prompt: the second child forks from the first."""
    p = prompt(length, length + 50 * (parent_max_tokens or 0))  # no prefix hit from another case
    fam = choices(p, 3, seed=100 + length, max_tokens=6, parent_max_tokens=parent_max_tokens)
    plans = []
    loop.on_step = plans.append

    async def main():
        return await asyncio.gather(*(collect(loop, r) for r in fam))

    try:
        results = asyncio.run(main())
    finally:
        loop.on_step = None
    alone = generate(loop, choices(p, 3, seed=100 + length, max_tokens=6, parent_max_tokens=parent_max_tokens,
                                   family=False))
    assert [ids for ids, _ in results] == alone
    assert len({tuple(ids) for ids in alone}) == 3  # the seeds differ
    ids = [r.request_id for r in fam]
    rows = [row for plan in plans for row in plan.prefill if row.request_id in ids]
    assert [(row.request_id, row.start, len(row.token_ids)) for row in rows] == [
        (ids[0], 0, length), (ids[1], length - 1, 1), (ids[2], length - 1, 1)]
    assert [row.page_copy is not None for row in rows] == [False] + [(length - 1) % 8 != 0] * 2
    assert [events[-1].cached_tokens for _, events in results] == [0, length - 1, length - 1]
    assert all_pages_free(loop)


def test_n_choices_under_pool_pressure_match_running_alone(jax_cache):
    """Two families of 3 in the 12-page pool of the preemption test: children are preempted
    and recomputed (or forked again), and every choice still equals its request run alone."""
    fams = lambda family: [r for f in range(2) for r in choices(
        prompt(20, f), 3, seed=10 * f, max_tokens=30, family=family)]
    reqs = fams(True)
    crowded, plans = run_with(lambda: reqs, num_pages=13, max_model_len=96)
    children = {r.request_id for r in reqs if r.parent_id}
    assert any(children & set(p.preempted) for p in plans)
    assert sum(1 for p in plans for row in p.prefill if row.page_copy is not None) >= 2
    lp = make_loop(num_pages=13, max_model_len=96)
    lp.start(warmup=False)
    try:
        alone = [generate(lp, [r])[0] for r in fams(False)]  # one at a time, salts apart
    finally:
        lp.stop()
    assert crowded == alone


def test_turn_profile_counts_each_dispatched_turn_and_what_it_carried(loop):
    """The loop's turn profile (what benchmarks.closed_loop reads off /metrics) agrees with its plans."""
    async def ping():
        await loop.ping()

    before = loop.profile.snapshot()
    plans = []
    loop.on_step = plans.append
    try:
        generate(loop, [request(prompt(4 + 3 * i, 300 + i), max_tokens=6, ignore_eos=True) for i in range(5)])
        asyncio.run(ping())  # the turn that read back the last tokens has ended
    finally:
        loop.on_step = None
    d = {k: v - before[k] for k, v in loop.profile.snapshot().items()}
    assert d["prefill_tokens"] == sum(len(r.token_ids) for p in plans for r in p.prefill) == sum(
        4 + 3 * i for i in range(5))
    assert d["decode_rows"] == sum(len(p.decode) for p in plans) == 5 * 5  # the first token comes from prefill
    assert d["turns.mixed"] == sum(bool(p.prefill and p.decode) for p in plans)
    assert d["turns.prefill"] == sum(bool(p.prefill and not p.decode) for p in plans) >= 1
    assert d["turns.decode"] == sum(bool(p.decode and not p.prefill) for p in plans) >= 1
    assert d["turns.other"] >= 1  # the last read-back, with nothing left to dispatch
    assert all(d[f"seconds.{part}"] >= 0 for part in PARTS)
    assert d["seconds.dispatch_decode"] > 0 and d["seconds.readback_wait"] > 0 and d["seconds.plan"] > 0
    assert loop.stats().turn_profile["decode_rows"] >= before["decode_rows"]
