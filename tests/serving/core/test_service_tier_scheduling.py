"""The scheduler's three classes (priority, default, flex) and the flex starvation guard.

Steps are driven by hand: every sampled token is read back (token 5) before the next
plan, so preemption never waits for in-flight tokens.
"""

from __future__ import annotations

from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.core.sched.sched_request import BATCH, INTERACTIVE, PRIORITIES, PRIORITY, SchedRequest, Status
from serving.core.sched.scheduler import Scheduler


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(slots: int, **guard) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    return Scheduler(kv, num_slots=slots, token_budget=32, max_prefill_tokens=16, max_prefill_seqs=4, **guard)


def step(sched: Scheduler) -> list[str]:
    """Plans one step, reads back its tokens; returns the ids preempted."""
    plan = sched.schedule()
    assert not plan.needs_sync
    by_id = {r.request_id: r for r in sched.running}
    for rid in [r.request_id for r in plan.decode] + [r.request_id for r in plan.prefill if r.samples]:
        req = by_id[rid]
        if sched.on_token(req, 5):
            sched.finish(req, "length")
    sched.check_invariants()
    return plan.preempted


def req(rid: str, priority: int, max_tokens: int = 50) -> SchedRequest:
    return SchedRequest(rid, [1, 2, 3, 4, 5, 6], max_tokens, priority=priority)


def test_the_tier_names_map_to_three_classes():
    assert PRIORITIES == {"priority": PRIORITY, "default": INTERACTIVE, "interactive": INTERACTIVE,
                          "flex": BATCH, "batch": BATCH}
    assert PRIORITY < INTERACTIVE < BATCH


def test_priority_takes_the_slot_of_flex_work_first_then_of_default_work():
    sched = make(slots=2)
    d, f = req("d", INTERACTIVE), req("f", BATCH)
    sched.add(d)
    sched.add(f)
    step(sched)
    assert {r.request_id for r in sched.running} == {"d", "f"}
    p1 = req("p1", PRIORITY)
    sched.add(p1)
    assert step(sched) == ["f"]  # the flex request gives way, the default one runs on
    assert {r.request_id for r in sched.running} == {"d", "p1"}
    p2 = req("p2", PRIORITY)
    sched.add(p2)
    assert step(sched) == ["d"]  # then default work gives way to priority work
    assert {r.request_id for r in sched.running} == {"p1", "p2"}
    assert f.status is d.status is Status.WAITING
    queue = sorted(sched.waiting, key=lambda r: (r.priority, r.arrival))  # the admission order
    assert [r.request_id for r in queue] == ["d", "f"]  # default ahead of flex


def test_default_work_never_takes_a_priority_requests_slot():
    sched = make(slots=1)
    p = req("p", PRIORITY)
    sched.add(p)
    step(sched)
    sched.add(req("d", INTERACTIVE))
    assert step(sched) == [] and sched.running == [p]


def test_a_flex_request_preempted_more_than_n_times_is_protected():
    sched = make(slots=1, starvation_preemptions=1)
    f = req("f", BATCH)
    sched.add(f)
    step(sched)
    for i in range(2):  # each default arrival takes f's slot and finishes
        d = req(f"d{i}", INTERACTIVE, max_tokens=1)
        sched.add(d)
        assert step(sched) == ["f"]
        while d.status is not Status.FINISHED:
            step(sched)
        step(sched)  # f is admitted again (after its 2nd preemption: promoted first)
        assert f.status is Status.RUNNING and f.protected == (i == 1)
    assert f.protected and f.priority == INTERACTIVE and f.status is Status.RUNNING
    sched.add(req("d2", INTERACTIVE))
    assert step(sched) == [] and sched.running == [f]  # default work no longer takes its slot
    assert sched.starvation.num_protected == 1


def test_a_flex_request_waiting_longer_than_t_goes_ahead_of_later_default_work():
    clock = Clock()
    sched = make(slots=1, starvation_seconds=30.0, clock=clock)
    d0 = req("d0", INTERACTIVE, max_tokens=2)
    sched.add(d0)
    step(sched)
    f = req("f", BATCH, max_tokens=2)
    sched.add(f)
    clock.t += 10
    d1 = req("d1", INTERACTIVE, max_tokens=2)
    sched.add(d1)
    while d0.status is not Status.FINISHED:
        step(sched)
    step(sched)  # admits the next
    assert sched.running and sched.running[0] is d1 and not f.protected  # 10 s: still flex, d1 first
    while d1.status is not Status.FINISHED:
        step(sched)
    d2 = req("d2", INTERACTIVE, max_tokens=2)
    sched.add(d2)
    clock.t += 25  # f has waited 35 s > 30: protected, and older than d2
    step(sched)
    assert f.protected and sched.running == [f]


def test_without_the_guard_flex_work_waits_behind_every_default_request():
    clock = Clock()
    sched = make(slots=1, clock=clock)
    sched.add(req("d0", INTERACTIVE, max_tokens=2))
    f = req("f", BATCH)
    sched.add(f)
    sched.add(req("d1", INTERACTIVE, max_tokens=2))
    clock.t += 1e6
    for _ in range(4):
        step(sched)
    assert not f.protected and f.priority == BATCH
