"""The scheduler without a model: a fake engine whose next token is a hash of what it reads
from the pages, so a wrong page, a wrong prefix, a lost token or a mixed-up slot changes
the output. The fake engine reads only the plan's rows (slot, positions, token ids, page
ids), as the real one does. Random lifecycles (shared prefixes, cancels, a pool small
enough to preempt) are checked after every step. Then the KV-cache manager's API alone."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.core.kv.kv_cache_manager import NO_HIT, KVCacheManager
from serving.core.sched.sched_request import BATCH, INTERACTIVE, SchedRequest, Status
from serving.core.sched.scheduler import Scheduler
from serving.core.sched.step_plan import SamplingSettings, StepPlan

VOCAB = 61


def next_token(tokens: list[int]) -> int:
    """The fake model: a hash of every prior token and the position."""
    digest = hashlib.blake2b(repr((tokens, len(tokens))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def run_alone(prompt: list[int], max_tokens: int, stop: tuple[int, ...]) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop:
            break
    return out


class FakeEngine:
    """Executes plans against a host-side page store; results come back one step late."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.slot_tokens = [None] * num_slots

    def _write(self, pages, pos, token):
        self.pages[pages[pos // self.page_size]][pos % self.page_size] = token

    def _read(self, pages, length):
        ps = self.page_size
        return [self.pages[pages[p // ps]][p % ps] for p in range(length)]

    def run(self, plan: StepPlan) -> list[tuple[str, int]]:
        """Executes the plan's rows; returns (request_id, sampled token) pairs."""
        out = []
        for row in plan.prefill:
            for i, t in enumerate(row.token_ids):
                self._write(row.page_ids, row.start + i, t)
            if row.samples:
                tok = next_token(self._read(row.page_ids, row.end))
                self.slot_tokens[row.slot] = tok
                out.append((row.request_id, tok))
        for row in plan.decode:
            self._write(row.page_ids, row.position, self.slot_tokens[row.slot])
            tok = next_token(self._read(row.page_ids, row.position + 1))
            self.slot_tokens[row.slot] = tok
            out.append((row.request_id, tok))
        return out


def drive(sched: Scheduler, engine: FakeEngine, arrivals: list[tuple[int, SchedRequest]],
          rng: random.Random, cancel_rate: float, max_steps: int = 20000):
    """Runs the scheduler loop with one step of pipelining, checking invariants every step."""
    pending: list[tuple[str, int]] = []  # the previous step's results
    live: list[SchedRequest] = []
    by_id = {r.request_id: r for _, r in arrivals}
    step = 0
    arrivals = sorted(arrivals, key=lambda a: a[0])

    def read_back(results):
        for rid, tok in results:
            r = by_id[rid]
            if r.status is Status.FINISHED:
                continue
            reason = sched.on_token(r, tok)
            if reason:
                sched.finish(r, reason)

    while arrivals or sched.waiting or sched.running or pending:
        assert step < max_steps, "no progress"
        while arrivals and arrivals[0][0] <= step:
            r = arrivals.pop(0)[1]
            sched.add(r)
            live.append(r)
        if live and rng.random() < cancel_rate:
            victim = rng.choice(live)
            sched.finish(victim, "cancelled")
        live = [r for r in live if r.status is not Status.FINISHED]
        plan = sched.schedule()
        if plan.needs_sync:
            read_back(pending)
            pending = []
            plan = sched.schedule()
            assert not plan.needs_sync
        assert plan.num_tokens <= sched.token_budget
        assert sum(len(c.token_ids) for c in plan.prefill) <= sched.max_prefill_tokens
        check_rows(plan, sched.kv.page_size)
        results = engine.run(plan)
        read_back(pending)
        pending = results
        sched.check_invariants()
        step += 1
    return step


def check_rows(plan: StepPlan, page_size: int) -> None:
    """A plan's rows: one per request, pages covering what they write, no decode row for a
    request preempted while planning (it may be re-admitted in the same pass: a prefill row)."""
    ids = [r.request_id for r in plan.decode + plan.prefill]
    assert len(set(ids)) == len(ids), f"a request has two rows: {ids}"
    assert not {r.request_id for r in plan.decode} & set(plan.preempted), "a preempted request decodes"
    for row in plan.prefill:
        assert row.token_ids and len(row.page_ids) * page_size >= row.end, row
    for row in plan.decode:
        assert len(row.page_ids) * page_size > row.position, row


def pow2_bucket(prefill: int):
    """The engine's prefill token buckets in small: powers of two from 2 up to ``prefill``."""
    def bucket(n: int) -> int:
        b = 2
        while b < n:
            b *= 2
        return min(b, prefill)
    return bucket


def make(num_pages=24, page_size=4, slots=4, budget=12, prefill=8, seqs=2, caching=True, bucketed=False):
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=caching)
    return Scheduler(kv, num_slots=slots, token_budget=budget, max_prefill_tokens=prefill,
                     max_prefill_seqs=seqs, prefill_bucket=pow2_bucket(prefill) if bucketed else None
                     ), FakeEngine(num_pages, page_size, slots)


def random_requests(rng: random.Random, n: int, sched: Scheduler, max_len: int):
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    reqs = []
    for i in range(n):
        prompt = list(rng.choice(prefixes)) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
        max_tokens = rng.randrange(1, 14)
        if sched.pages_needed_alone(len(prompt) + max_tokens) > max_len:
            max_tokens = 1
        stop = tuple(rng.sample(range(VOCAB), rng.randrange(0, 3)))
        r = SchedRequest(f"r{i}", prompt, max_tokens, stop_token_ids=stop,
                         priority=rng.choice([INTERACTIVE, INTERACTIVE, BATCH]),
                         salt=rng.choice([None, None, "tenant-b"]))
        reqs.append((rng.randrange(0, 3 * n), r))
    return reqs


def lifecycle(seed: int, caching: bool, cancel_rate: float, num_pages: int, bucketed: bool = False):
    rng = random.Random(seed)
    sched, engine = make(num_pages=num_pages, caching=caching, bucketed=bucketed)
    arrivals = random_requests(rng, 30, sched, max_len=sched.kv.num_pages - 1)
    drive(sched, engine, arrivals, rng, cancel_rate)
    assert sched.kv.num_free == sched.kv.num_pages - 1, "every page is free or cached at the end"
    for _, r in arrivals:
        assert r.status is Status.FINISHED
        if r.finish_reason != "cancelled":
            assert r.output_ids == run_alone(r.prompt_ids, r.max_tokens, r.stop_token_ids), r
            assert r.finish_reason == ("stop" if r.output_ids[-1] in r.stop_token_ids else "length")
    return [r for _, r in arrivals], sched


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), caching=st.booleans(),
       cancel_rate=st.sampled_from([0.0, 0.05]), num_pages=st.sampled_from([12, 16, 24]),
       bucketed=st.booleans())
def test_random_lifecycles(seed, caching, cancel_rate, num_pages, bucketed):
    lifecycle(seed, caching, cancel_rate, num_pages, bucketed)


def test_random_lifecycles_exercise_preemption_and_prefix_hits():
    """The property test's traffic does preempt and does hit the cache (else it proves little)."""
    preemptions = hits = 0
    for seed in range(10):
        reqs, sched = lifecycle(seed, True, 0.0, 12)
        preemptions += sum(r.num_preemptions for r in reqs)
        hits += sched.kv.hits
    assert preemptions > 0 and hits > 0


def test_preemption_happens_and_outputs_match():
    rng = random.Random(1)
    sched, engine = make(num_pages=14, slots=4)
    reqs = [SchedRequest(f"r{i}", [rng.randrange(VOCAB) for _ in range(9)], 20) for i in range(4)]
    drive(sched, engine, [(0, r) for r in reqs], rng, 0.0)
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.output_ids == run_alone(r.prompt_ids, 20, ())


def test_prefix_hits_are_reported_and_scoped_by_salt():
    rng = random.Random(2)
    sched, engine = make(num_pages=40)
    system = [rng.randrange(VOCAB) for _ in range(13)]  # 3 full pages of 4
    first = SchedRequest("a", system + [1, 2], 3)
    drive(sched, engine, [(0, first)], rng, 0.0)
    same = SchedRequest("b", system + [3], 3)
    other_tenant = SchedRequest("c", system + [3], 3, salt="other")
    drive(sched, engine, [(0, same), (0, other_tenant)], rng, 0.0)
    assert first.cached_tokens == 0
    assert same.cached_tokens == 12
    assert other_tenant.cached_tokens == 0
    assert same.output_ids == run_alone(same.prompt_ids, 3, ())


def test_a_waiting_prompt_joins_a_step_when_its_uncached_rest_fits():
    """A waiting prompt that fits no whole step's rest waits (Scheduler._would_split), but
    what counts is its uncached rest: with its first page in the prefix cache it joins."""
    rng = random.Random(5)
    sched, engine = make(num_pages=40, budget=12, prefill=8, seqs=2)
    system = [rng.randrange(VOCAB) for _ in range(4)]  # one page of 4
    drive(sched, engine, [(0, SchedRequest("warm", system + [1], 1))], rng, 0.0)
    sched.add(SchedRequest("x", [rng.randrange(VOCAB) for _ in range(5)], 2))
    sched.add(SchedRequest("cached", system + [2, 3, 4], 2))  # 7 tokens, 4 cached: 3 left of 3
    plan = sched.schedule()
    assert [(r.request_id, r.start, len(r.token_ids)) for r in plan.prefill] == [("x", 0, 5), ("cached", 4, 3)]
    sched.check_invariants()
    sched2, _ = make(num_pages=40, budget=12, prefill=8, seqs=2)
    sched2.add(SchedRequest("x", [rng.randrange(VOCAB) for _ in range(5)], 2))
    sched2.add(SchedRequest("cold", system + [2, 3, 4], 2))  # nothing cached: 7 of 3 left
    plan = sched2.schedule()
    assert [r.request_id for r in plan.prefill] == ["x"]


def test_full_hit_recomputes_the_last_token():
    rng = random.Random(3)
    sched, engine = make(num_pages=40)
    prompt = [rng.randrange(VOCAB) for _ in range(8)]  # exactly two pages
    a = SchedRequest("a", prompt, 4)
    drive(sched, engine, [(0, a)], rng, 0.0)
    b = SchedRequest("b", list(prompt), 4)
    drive(sched, engine, [(0, b)], rng, 0.0)
    assert b.cached_tokens == 4  # at most prompt - 1 tokens, in whole pages
    assert b.output_ids == a.output_ids == run_alone(prompt, 4, ())


def test_batch_priority_waits_for_interactive_and_is_preempted_first():
    rng = random.Random(4)
    sched, engine = make(num_pages=14, slots=2)
    batch = SchedRequest("batch", [rng.randrange(VOCAB) for _ in range(9)], 20, priority=BATCH)
    inter = SchedRequest("inter", [rng.randrange(VOCAB) for _ in range(9)], 20, priority=INTERACTIVE)
    drive(sched, engine, [(0, batch), (1, inter)], rng, 0.0)
    assert inter.num_preemptions == 0
    assert batch.num_preemptions >= 1
    assert batch.output_ids == run_alone(batch.prompt_ids, 20, ())


def test_open_slots_are_the_free_slots_unless_the_queue_head_waits_for_pages():
    sched, _ = make(num_pages=9, page_size=4, slots=4, budget=40, prefill=32)  # 8 usable pages
    assert sched.num_open_slots == 4
    big = SchedRequest("big", list(range(1, 25)), 8)  # 6 pages for its prompt, 7 once it decodes
    sched.add(big)
    sched.schedule()
    assert sched.num_open_slots == 3
    sched.add(SchedRequest("next", list(range(1, 13)), 4))  # needs 3 pages; 1 is free
    sched.schedule()
    assert len(sched.running) == 1 and sched.num_open_slots == 0
    sched.finish(big, "cancelled")
    sched.schedule()
    assert len(sched.running) == 1 and sched.num_open_slots == 3


def test_rows_carry_sampling_positions_and_pages():
    sched, _ = make(num_pages=24, page_size=4, prefill=8)
    s = SamplingSettings(temperature=0.7, top_k=5, top_p=0.9, seed=123)
    r = SchedRequest("a", list(range(1, 11)), 3, sampling=s)  # 10 prompt tokens, chunks of 8
    sched.add(r)
    first, second = sched.schedule(), sched.schedule()
    assert [(x.start, len(x.token_ids), x.samples, x.sampling) for x in first.prefill + second.prefill] == [
        (0, 8, False, s), (8, 2, True, s)]
    assert len(first.prefill[0].page_ids) == 2 and len(second.prefill[0].page_ids) == 3
    third = sched.schedule()  # one token behind, sampled on device: a decode row
    (row,) = third.decode
    assert (row.request_id, row.slot, row.position, row.sampling) == ("a", r.slot, 10, s)
    assert row.page_ids == sched.kv.page_ids("a") and len(row.page_ids) == 3
    sched.check_invariants()


# -- the KV-cache manager's API --------------------------------------------------


def full(kv: KVCacheManager, rid: str, tokens: list[int], salt=None) -> None:
    """Allocates pages for all of tokens and caches them, as a request that computed them."""
    assert kv.allocate_pages(rid, len(tokens))
    kv.cache_pages(rid, tokens, len(tokens), salt)


def test_allocate_says_no_and_takes_nothing():
    kv = KVCacheManager(num_pages=6, page_size=4)  # 5 usable pages
    assert kv.allocate_pages("a", 9)  # 3 pages
    assert kv.page_ids("a") == (1, 2, 3) and kv.num_free == 2
    assert not kv.allocate_pages("b", 12)  # 3 more: only 2 free
    assert kv.page_ids("b") == () and kv.num_free == 2 and kv.request_ids() == ["a"]
    assert not kv.allocate_pages("b", 8, watermark=1)  # 2 would leave 0 < 1 free
    assert kv.num_free == 2
    assert kv.allocate_pages("a", 13)  # grows by one page
    assert kv.allocate_pages("a", 16)  # already covered: takes nothing
    assert kv.page_ids("a") == (1, 2, 3, 4) and kv.num_free == 1
    kv.check_invariants()


def test_free_releases_tail_first_and_is_idempotent():
    kv = KVCacheManager(num_pages=8, page_size=4)
    assert kv.allocate_pages("a", 12) and kv.allocate_pages("b", 4)
    kv.free("a")
    kv.free("a")  # holds nothing: no-op
    kv.free("never-seen")
    assert kv.page_ids("a") == () and kv.num_free == 6 and kv.request_ids() == ["b"]
    kv.check_invariants()
    # Freed pages are reused least recently freed first: a's tail (3), then 2, then 1.
    assert kv.allocate_pages("c", 4 * 6)
    assert kv.page_ids("c") == (5, 6, 7, 3, 2, 1)
    kv.check_invariants()


def test_prefix_lookup_and_acquiring_evictable_pages():
    kv = KVCacheManager(num_pages=8, page_size=4)
    prompt = list(range(10, 20))  # 2 full pages + 2 tokens
    full(kv, "a", prompt)
    kv.free("a")  # its 2 cached pages are free but keep their content
    assert kv.num_free == 7
    hit = kv.lookup_prefix(prompt + [7], None, max_tokens=len(prompt))
    assert hit.num_tokens == 8 and len(hit.page_ids) == 2 and kv.num_free == 7  # no references
    assert kv.lookup_prefix(prompt, "other-tenant", max_tokens=10) == NO_HIT
    assert kv.lookup_prefix(prompt, None, max_tokens=7).num_tokens == 4  # whole pages only
    # Holding the hit's 2 unheld pages uses up free pages too: 2 + 6 fresh > 7 free (6 alone fit).
    assert not kv.allocate_pages("b", 8 + 4 * 6, prefix=hit)
    assert kv.num_free == 7 and kv.page_ids("b") == ()
    assert kv.allocate_pages("b", 11, prefix=hit)
    assert kv.page_ids("b")[:2] == hit.page_ids and len(kv.page_ids("b")) == 3 and kv.num_free == 4
    assert kv.num_cached_tokens("b") == 8
    # A second request shares the held pages: only its fresh page leaves the free queue.
    assert kv.allocate_pages("c", 9, prefix=kv.lookup_prefix(prompt, None, 10))
    assert kv.page_ids("c")[:2] == hit.page_ids and kv.num_free == 3
    kv.check_invariants()
    with pytest.raises(ValueError, match="already holds"):
        kv.allocate_pages("c", 12, prefix=hit)
    kv.free("b")
    kv.free("c")
    kv.check_invariants()


def test_a_stale_prefix_hit_is_refused():
    kv = KVCacheManager(num_pages=3, page_size=4)  # 2 usable pages
    full(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    hit = kv.lookup_prefix([1, 2, 3, 4, 5], None, 5)
    assert hit.num_tokens == 4
    assert kv.allocate_pages("b", 8)  # evicts the cached page
    kv.free("b")
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_pages("c", 5, prefix=hit)
    kv.check_invariants()


def test_cache_pages_extends_the_chained_keys_incrementally():
    kv = KVCacheManager(num_pages=10, page_size=4)
    tokens = list(range(30, 43))  # 3 full pages + 1 token
    assert kv.allocate_pages("a", len(tokens))
    kv.cache_pages("a", tokens[:6], 6, None)  # 1 full page known
    assert kv.num_cached_tokens("a") == 4
    kv.cache_pages("a", tokens, 5, None)  # 1 full page computed: nothing new
    assert kv.num_cached_tokens("a") == 4
    kv.cache_pages("a", tokens, 13, None)
    assert kv.num_cached_tokens("a") == 12
    # The incremental keys name the same pages as hashing the whole prefix at once.
    hit = kv.lookup_prefix(tokens, None, max_tokens=13)
    assert hit.page_ids == kv.page_ids("a")[:3]
    # A second request with the same tokens (computed privately) keeps its duplicates private.
    assert kv.allocate_pages("b", len(tokens))
    kv.cache_pages("b", tokens, 13, None)
    assert kv.lookup_prefix(tokens, None, 13).page_ids == hit.page_ids
    kv.check_invariants()
    with pytest.raises(ValueError, match="fewer than"):
        kv.cache_pages("a", tokens + [0] * 8, 21, None)
    kv.free("a")
    kv.free("b")
    kv.check_invariants()


def test_without_prefix_caching_nothing_is_hashed_or_found():
    kv = KVCacheManager(num_pages=6, page_size=4, enable_prefix_caching=False)
    full(kv, "a", list(range(9)))
    assert kv.num_cached_tokens("a") == 8  # offered, not registered
    kv.free("a")
    assert kv.lookup_prefix(list(range(9)), None, 9) == NO_HIT
    kv.check_invariants()


def test_check_invariants_catches_a_miscounted_page():
    kv = KVCacheManager(num_pages=6, page_size=4)
    assert kv.allocate_pages("a", 8)
    kv.check_invariants()
    kv._ref_count[kv.page_ids("a")[0]] += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref count 2, held by 1"):
        kv.check_invariants()


def test_an_interactive_request_takes_a_batch_requests_slot_at_once():
    """With every slot running batch work, an interactive arrival preempts the newest batch
    request in the next step rather than waiting for one to finish; the batch request
    resumes once a slot frees and its output is unchanged."""
    rng = random.Random(5)
    sched, engine = make(num_pages=40, slots=2, budget=16, prefill=8)
    batches = [SchedRequest(f"batch{i}", [rng.randrange(VOCAB) for _ in range(5)], 30, priority=BATCH)
               for i in range(2)]
    inter = SchedRequest("inter", [rng.randrange(VOCAB) for _ in range(5)], 4, priority=INTERACTIVE)
    by_id = {r.request_id: r for r in [*batches, inter]}

    def step() -> StepPlan:  # no pipelining: each step's tokens are read back at once
        plan = sched.schedule()
        for rid, tok in engine.run(plan):
            sched.on_token(by_id[rid], tok)
        return plan

    for b in batches:
        sched.add(b)
    for _ in range(4):  # both batch requests run and decode
        step()
    assert [r.request_id for r in sched.running] == ["batch0", "batch1"]
    sched.add(inter)
    plan = step()
    assert plan.preempted == ["batch1"] and inter.status is Status.RUNNING
    assert [r.request_id for r in plan.prefill] == ["inter"]
    sched.check_invariants()
    # a waiting batch request never preempts: it waits for a free slot
    late = SchedRequest("late", [1, 2, 3], 4, priority=BATCH)
    by_id["late"] = late
    sched.add(late)
    assert step().preempted == [] and late.status is Status.WAITING


def test_interactive_arrivals_preempt_batch_slots_and_outputs_match():
    rng = random.Random(6)
    sched, engine = make(num_pages=60, slots=3, budget=16, prefill=8)
    arrivals = [(0, SchedRequest(f"b{i}", [rng.randrange(VOCAB) for _ in range(6)], 25, priority=BATCH))
                for i in range(3)]
    arrivals += [(3 + 4 * i, SchedRequest(f"i{i}", [rng.randrange(VOCAB) for _ in range(6)], 5))
                 for i in range(4)]
    drive(sched, engine, arrivals, rng, 0.0)
    by_id = {r.request_id: r for _, r in arrivals}
    assert sum(by_id[f"b{i}"].num_preemptions for i in range(3)) >= 1
    assert all(by_id[f"i{i}"].num_preemptions == 0 for i in range(4))
    for r in by_id.values():
        assert r.output_ids == run_alone(r.prompt_ids, r.max_tokens, ())
