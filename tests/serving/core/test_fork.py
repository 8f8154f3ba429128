"""``n`` choices of one prompt without a model: the KV-cache manager's fork and the
scheduler's admission of children (``parent_id``), on a fake engine whose next token is a
hash of what it reads from the pages and of the row's seed, so a wrong shared page, a
missing or wrong page copy, or a child sampling with its parent's seed changes the output.
Every row's writes are checked to land in pages its request holds alone, and the invariants
after every step."""

from __future__ import annotations

import hashlib
import random

import pytest

from serving.core.kv.kv_cache_manager import KVCacheManager, PageCopy
from serving.core.sched.sched_request import SchedRequest, Status
from serving.core.sched.scheduler import Scheduler
from serving.core.sched.step_plan import SamplingSettings, StepPlan

VOCAB = 61


def next_token(tokens: list[int], seed: int) -> int:
    """The fake model: a hash of every prior token, the position and the row's seed."""
    digest = hashlib.blake2b(repr((tokens, len(tokens), seed)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def run_alone(prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(tokens, seed))
        tokens.append(out[-1])
    return out


class FakeEngine:
    """Runs plans against a host page store (copies first, as the engine's prefill step does);
    asserts every write lands in a page its request holds alone."""

    def __init__(self, kv: KVCacheManager, num_slots: int):
        self.kv = kv
        self.pages = [[None] * kv.page_size for _ in range(kv.num_pages)]
        self.slot_tokens = [None] * num_slots

    def _write(self, pages, pos, token):
        page = pages[pos // self.kv.page_size]
        assert self.kv._ref_count[page] == 1, f"a write into page {page}, held {self.kv._ref_count[page]} times"
        self.pages[page][pos % self.kv.page_size] = token

    def _read(self, pages, length):
        ps = self.kv.page_size
        return [self.pages[pages[p // ps]][p % ps] for p in range(length)]

    def run(self, plan: StepPlan) -> list[tuple[str, int]]:
        copies = [r.page_copy for r in plan.prefill if r.page_copy is not None]
        before = {c.src: list(self.pages[c.src]) for c in copies}  # copies read the old cache
        for c in copies:
            self.pages[c.dst] = list(before[c.src])
        out = []
        for row in plan.prefill:
            for i, t in enumerate(row.token_ids):
                self._write(row.page_ids, row.start + i, t)
            if row.samples:
                tok = next_token(self._read(row.page_ids, row.end), row.sampling.seed)
                self.slot_tokens[row.slot] = tok
                out.append((row.request_id, tok))
        for row in plan.decode:
            self._write(row.page_ids, row.position, self.slot_tokens[row.slot])
            tok = next_token(self._read(row.page_ids, row.position + 1), row.sampling.seed)
            self.slot_tokens[row.slot] = tok
            out.append((row.request_id, tok))
        return out


def drive(sched: Scheduler, arrivals: list[tuple[int, SchedRequest]], cancels=(), max_steps=5000):
    """Runs the loop with one step of pipelining (as the engine loop does); ``cancels`` are
    (step, request id). Returns every plan."""
    engine = FakeEngine(sched.kv, sched.num_slots)
    by_id = {r.request_id: r for _, r in arrivals}
    arrivals = sorted(arrivals, key=lambda a: a[0])  # stable: a parent listed first is added first
    cancels = sorted(cancels)
    pending, plans, step = [], [], 0

    def read_back(results):
        for rid, tok in results:
            r = by_id[rid]
            if r.status is not Status.FINISHED:
                reason = sched.on_token(r, tok)
                if reason:
                    sched.finish(r, reason)

    while arrivals or sched.waiting or sched.running or pending:
        assert step < max_steps, "no progress"
        while arrivals and arrivals[0][0] <= step:
            sched.add(arrivals.pop(0)[1])
        while cancels and cancels[0][0] <= step:
            sched.finish(by_id[cancels.pop(0)[1]], "cancelled")
        plan = sched.schedule()
        if plan.needs_sync:
            read_back(pending)
            pending = []
            plan = sched.schedule()
        plans.append(plan)
        results = engine.run(plan)
        read_back(pending)
        pending = results
        sched.check_invariants()
        step += 1
    assert sched.kv.num_free == sched.kv.num_pages - 1, "every page is free or cached at the end"
    return plans


def make(num_pages=40, page_size=4, slots=4, budget=24, prefill=16, seqs=2, caching=True):
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=caching)
    return Scheduler(kv, num_slots=slots, token_budget=budget, max_prefill_tokens=prefill,
                     max_prefill_seqs=seqs)


def family(name: str, prompt: list[int], n: int, max_tokens: int, seed: int, **kw) -> list[SchedRequest]:
    """A parent and n - 1 children with seeds seed + index, as the gateway submits them."""
    return [SchedRequest(f"{name}{i}", list(prompt), max_tokens, sampling=SamplingSettings(1.0, seed=seed + i),
                         parent_id=None if i == 0 else f"{name}0", **kw) for i in range(n)]


def prompt_of(n: int, salt: int = 0) -> list[int]:
    rng = random.Random(salt)
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- the KV-cache manager's fork ---------------------------------------------------


def computed(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    assert kv.allocate_pages(rid, len(tokens))
    kv.cache_pages(rid, tokens, len(tokens), None)


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_full_pages_and_copies_the_partial_one(caching):
    kv = KVCacheManager(num_pages=10, page_size=4, enable_prefix_caching=caching)
    prompt = prompt_of(11)  # pages of 4, 4, 3 tokens
    computed(kv, "p", prompt)
    parent = kv.page_ids("p")
    copies = kv.fork("c", "p", num_computed=10, num_tokens=11)
    child = kv.page_ids("c")
    assert child[:2] == parent[:2] and child[2] not in parent and len(child) == 3
    assert copies == (PageCopy(parent[2], child[2]),)
    assert [kv._ref_count[p] for p in parent] == [2, 2, 1] and kv.num_free == 5
    assert kv.num_cached_tokens("c") == 8
    kv.check_invariants()
    kv.free("p")  # the child keeps the shared pages
    assert kv.page_ids("c") == child and [kv._ref_count[p] for p in child] == [1, 1, 1]
    kv.check_invariants()
    # The child's pages extend its keys like the parent's: its own later pages are cacheable.
    kv.cache_pages("c", prompt + [5], 12, None)
    assert kv.num_cached_tokens("c") == 12
    kv.free("c")
    assert kv.num_free == 9
    kv.check_invariants()
    if caching:  # the parent's pages were cached under the keys the child continued
        assert kv.lookup_prefix(prompt + [5, 6], None, 13).num_tokens == 12


def test_fork_on_a_page_boundary_copies_nothing_and_freeing_the_child_keeps_the_parent():
    kv = KVCacheManager(num_pages=10, page_size=4)
    prompt = prompt_of(9)
    computed(kv, "p", prompt)
    assert kv.fork("c", "p", num_computed=8, num_tokens=12) == ()
    assert kv.page_ids("c")[:2] == kv.page_ids("p")[:2] and len(kv.page_ids("c")) == 3
    kv.free("c")
    assert [kv._ref_count[p] for p in kv.page_ids("p")] == [1, 1, 1]
    kv.check_invariants()


def test_fork_says_no_and_takes_nothing():
    kv = KVCacheManager(num_pages=6, page_size=4)  # 5 usable pages
    computed(kv, "p", prompt_of(11))  # 3 pages
    assert kv.fork("c", "p", 10, 11, watermark=2) is None  # 1 fresh page would leave 1 < 2 free
    assert kv.page_ids("c") == () and kv.num_free == 2
    assert kv.fork("c", "p", 10, 20) is None  # 3 fresh pages: only 2 free
    assert kv.page_ids("c") == () and kv.num_free == 2
    kv.check_invariants()
    assert kv.fork("c", "p", 10, 16) is not None  # 2 fresh pages fit
    assert kv.num_free == 0
    kv.check_invariants()
    with pytest.raises(ValueError, match="already holds"):
        kv.fork("p", "p", 4, 8)
    with pytest.raises(ValueError, match="does not hold"):
        kv.fork("d", "p", 13, 14)  # more than the parent's pages hold
    with pytest.raises(ValueError, match="must exceed"):
        kv.fork("d", "p", 10, 10)
    kv.check_invariants()


def test_check_invariants_catches_a_write_target_that_is_shared():
    kv = KVCacheManager(num_pages=10, page_size=4)
    computed(kv, "p", prompt_of(11))
    kv.fork("c", "p", 10, 11)
    kv.check_invariants()
    held = kv._held["c"]
    held.num_cached, held.keys = 1, held.keys[:1]  # the second shared page now counts as the child's to write
    with pytest.raises(AssertionError, match="uncached page .* is shared"):
        kv.check_invariants()


# -- the scheduler's admission of children -------------------------------------------


@pytest.mark.parametrize("prompt_len", [11, 9])  # 10 computed: a partial page; 8: a page boundary
def test_children_compute_only_the_last_prompt_token_and_sample_with_their_seeds(prompt_len):
    sched = make()
    prompt = prompt_of(prompt_len)
    fam = family("f", prompt, 3, max_tokens=6, seed=40)
    plans = drive(sched, [(0, r) for r in fam])
    for i, r in enumerate(fam):
        assert r.output_ids == run_alone(prompt, 6, 40 + i), r.request_id
    rows = [row for p in plans for row in p.prefill]
    assert sum(len(row.token_ids) for row in rows) == prompt_len + 2
    assert [(row.request_id, row.start, len(row.token_ids)) for row in rows] == [
        ("f0", 0, prompt_len), ("f1", prompt_len - 1, 1), ("f2", prompt_len - 1, 1)]
    assert [row.page_copy is not None for row in rows] == [False] + [(prompt_len - 1) % 4 != 0] * 2
    assert [r.cached_tokens for r in fam] == [0, prompt_len - 1, prompt_len - 1]
    assert sched.kv.hits == 2 * (prompt_len - 1)


def test_a_chunked_parent_prompt_is_waited_for_and_children_keep_their_slots():
    """Slots 3: while the parent's 30-token prompt is chunked, its 2 children keep the other
    two slots, so a later request waits instead of taking one; then both children fork."""
    sched = make(slots=3, prefill=8, budget=12)
    prompt = prompt_of(30, 1)
    fam = family("f", prompt, 3, max_tokens=4, seed=7)
    other = SchedRequest("x", prompt_of(5, 2), 4)
    plans = drive(sched, [(0, r) for r in fam] + [(0, other)])
    first_x = next(i for i, p in enumerate(plans) if any(r.request_id == "x" for r in p.prefill))
    forks = [i for i, p in enumerate(plans) for r in p.prefill if r.request_id in ("f1", "f2")]
    assert len(forks) == 2 and first_x > max(forks)
    assert sum(len(r.token_ids) for p in plans for r in p.prefill if r.request_id.startswith("f")) == 32
    for i, r in enumerate(fam):
        assert r.output_ids == run_alone(prompt, 4, 7 + i)
    assert other.output_ids == run_alone(other.prompt_ids, 4, 0)


def test_a_parent_that_finishes_at_once_still_shares_its_prompt():
    """max_tokens 1: the parent is gone one step after its prompt; one prefill row per step
    (max_prefill_seqs 1), so the second child forks from the first."""
    sched = make(seqs=1)
    prompt = prompt_of(14, 3)
    fam = family("f", prompt, 3, max_tokens=1, seed=1)
    fam[1].max_tokens = fam[2].max_tokens = 5
    plans = drive(sched, [(0, r) for r in fam])
    rows = [r for p in plans for r in p.prefill]
    assert [(r.request_id, r.start) for r in rows] == [("f0", 0), ("f1", 13), ("f2", 13)]
    assert fam[0].output_ids == run_alone(prompt, 1, 1)
    assert [r.output_ids for r in fam[1:]] == [run_alone(prompt, 5, 2), run_alone(prompt, 5, 3)]


def test_a_parent_cancelled_before_the_fork_leaves_the_first_child_to_compute_the_prompt():
    sched = make(prefill=8, budget=12)
    prompt = prompt_of(22, 4)
    fam = family("f", prompt, 3, max_tokens=5, seed=20)
    plans = drive(sched, [(0, r) for r in fam], cancels=[(1, "f0")])  # after one 8-token chunk
    assert fam[0].finish_reason == "cancelled"
    rows = [r for p in plans for r in p.prefill if r.request_id != "f0"]
    # f1 starts from the parent's cached 8 tokens and computes the rest; f2 forks from f1.
    assert [(r.request_id, r.start) for r in rows] == [("f1", 8), ("f1", 16), ("f2", 21)]
    assert [r.output_ids for r in fam[1:]] == [run_alone(prompt, 5, 21), run_alone(prompt, 5, 22)]


def test_a_parent_gone_before_its_children_arrive_makes_them_ordinary():
    sched = make()
    prompt = prompt_of(10, 5)
    parent, child = family("f", prompt, 2, max_tokens=2, seed=0)
    drive(sched, [(0, parent)])
    drive(sched, [(0, child)])
    assert child.parent_id is None and child.cached_tokens == 8  # a prefix hit, not a fork
    unknown = SchedRequest("u", prompt_of(6, 6), 2, parent_id="nobody")
    other_prompt = family("g", prompt, 2, max_tokens=2, seed=0)
    other_prompt[1].prompt_ids = prompt_of(10, 7)
    drive(sched, [(0, unknown)] + [(0, r) for r in other_prompt])
    assert unknown.parent_id is None and other_prompt[1].parent_id is None
    assert other_prompt[1].output_ids == run_alone(other_prompt[1].prompt_ids, 2, 1)


def pressure(seed: int) -> list[SchedRequest]:
    """Families and ordinary requests in a pool that must preempt, with random cancels:
    every request that was not cancelled gives its tokens run alone."""
    rng = random.Random(seed)
    sched = make(num_pages=16, slots=4, prefill=8, budget=12, caching=seed % 2 == 0)
    arrivals, cancels = [], []
    for f in range(5):
        prompt = prompt_of(rng.randrange(3, 19), 100 * seed + f)
        at = rng.randrange(0, 20)
        for r in family(f"f{f}-", prompt, rng.randrange(2, 5), max_tokens=rng.randrange(1, 22), seed=f * 10):
            arrivals.append((at, r))
        if rng.random() < 0.3:
            cancels.append((at + rng.randrange(0, 6), f"f{f}-{rng.randrange(0, 2)}"))
    for i in range(4):
        arrivals.append((rng.randrange(0, 20), SchedRequest(f"x{i}", prompt_of(rng.randrange(2, 12), i), 12)))
    drive(sched, arrivals, cancels)
    reqs = [r for _, r in arrivals]
    for r in reqs:
        if r.finish_reason != "cancelled":
            assert r.output_ids == run_alone(r.prompt_ids, r.max_tokens, r.sampling.seed), r.request_id
    return reqs


def test_pool_pressure_preempts_children_and_they_fork_again():
    preempted_children = forks = 0
    for seed in range(12):
        reqs = pressure(seed)
        preempted_children += sum(r.num_preemptions for r in reqs if r.parent_id is not None)
        forks += sum(1 for r in reqs if r.parent_id is not None and r.cached_tokens == len(r.prompt_ids) - 1)
    assert preempted_children > 0 and forks > 0


@pytest.mark.parametrize("steps, refork", [(3, True), (12, False)])
def test_a_preempted_child_forks_again_unless_its_own_cached_pages_reach_further(steps, refork):
    """Preempted after 3 tokens, a child re-forks (start P - 1); after 12, its own full pages
    in the prefix cache hold more than the prompt, so the hit serves it instead."""
    sched = make(seqs=2)
    engine = FakeEngine(sched.kv, sched.num_slots)
    prompt = prompt_of(10, 8)
    parent, child = family("f", prompt, 2, max_tokens=30, seed=3)
    sched.add(parent)
    sched.add(child)
    pending = []
    for _ in range(steps):
        plan = sched.schedule()
        results = engine.run(plan)
        for rid, tok in pending:
            sched.on_token(parent if rid == "f0" else child, tok)
        pending = results
    for rid, tok in pending:
        sched.on_token(parent if rid == "f0" else child, tok)
    sched._preempt(child, StepPlan())
    sched.check_invariants()
    (row,) = [r for r in sched.schedule().prefill if r.request_id == "f1"]
    sched.check_invariants()
    if refork:
        assert row.start == len(prompt) - 1 and row.page_copy is not None
    else:
        assert row.start > len(prompt) and row.start % 4 == 0 and row.page_copy is None
    assert row.samples  # it reaches the child's last known token
