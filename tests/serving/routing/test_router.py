"""The router's decisions over stand-in replicas (no gRPC, no engine): cache affinity by the
engine's own page hashes and salt, cost against load, the imbalance guard, parents, failover."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serving.contract.engine_client import EngineOverloadedError, EngineStats
from serving.core.kv.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.routing.router import Router
from serving.rpc import engine_pb2 as pb
from tests.support.router_fakes import PS, FakeReplica, drain, prompt, req


def test_router_hashes_as_the_engine_prefix_cache_does():
    """The keys the KV-cache manager stores for a prompt are the ones the router looks up."""
    kv = KVCacheManager(num_pages=32, page_size=PS)
    p = prompt(5 * PS + 3)
    assert kv.allocate_pages("a", len(p))
    kv.cache_pages("a", p, len(p), "salt-1")
    assert set(prompt_page_hashes(p, PS, "salt-1")) == set(kv._page_of)
    assert not set(prompt_page_hashes(p, PS, "salt-2")) & set(kv._page_of)


def test_kv_aware_follows_the_cached_prefix_of_the_same_salt():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b])
    p = prompt(64 * PS)  # a 1024-token prefix
    b.cache(p, salt="tenant-1")
    for k in range(4):
        r, reason, hit = router.pick(req(p + [k + 1] * 9, salt="tenant-1"))
        assert (r, reason, hit) == (b, "cache_hit", 64)
    # Another tenant's requests never match tenant-1's pages.
    _, reason, hit = router.pick(req(p, salt="tenant-2"))
    assert (reason, hit) == ("load", 0)


def test_a_burst_of_one_prefix_stays_together_before_any_kv_event():
    """Requests routed while the first of their prefix is still computing (no KV event yet)
    follow it: its prompt counts as pending on its replica; other prefixes go elsewhere."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b])
    a.gate = b.gate = asyncio.Event()
    p, q = prompt(64 * PS), prompt(64 * PS, offset=3)

    async def burst():
        gens = [router.submit(req(p + [k + 1] * 4, f"p{k}")) for k in range(4)]
        gens += [router.submit(req(q + [k + 1] * 4, f"q{k}")) for k in range(4)]
        for g in gens:
            await anext(g)
        a.gate.set()
        for g in gens:
            async for _ in g:
                pass

    asyncio.run(burst())
    assert sorted(a.served) in (["p0", "p1", "p2", "p3"], ["q0", "q1", "q2", "q3"])
    assert router._pending[id(a)] == {} and router._pending[id(b)] == {}


def test_cost_weighs_pages_to_prefill_against_load():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], prefill_weight=1.0)
    p = prompt(8 * PS)
    a.cache(p)
    a.load = EngineStats(waiting_prompt_tokens=5 * PS)  # cheaper than prefilling 8 pages on b
    assert router.pick(req(p))[0] is a
    a.load = EngineStats(waiting_prompt_tokens=20 * PS)  # dearer
    assert router.pick(req(p))[:2] == (b, "load")


def test_imbalance_guard_spills_a_hot_prefix():
    """With the cache weighted far above load, only the guard moves requests off the replica
    holding the hot prefix: once it runs 3 more than the other."""
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], prefill_weight=100.0, balance_abs=2, balance_rel=1.5)
    p = prompt(16 * PS)
    a.cache(p)
    a.gate = b.gate = asyncio.Event()

    async def flood():
        gens = [router.submit(req(p, f"hot-{i}")) for i in range(8)]
        firsts = [await anext(g) for g in gens]  # all 8 in flight together
        a.gate.set()
        for g in gens:
            async for _ in g:
                pass
        return firsts

    asyncio.run(flood())
    reasons = {reason for (_, reason) in router.decisions}
    assert "imbalance" in reasons and "cache_hit" in reasons
    assert a.served[:3] == ["hot-0", "hot-1", "hot-2"] and "hot-3" in b.served
    assert len(a.served) + len(b.served) == 8
    assert router._inflight == {}


def test_choices_follow_their_parent():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.gate = b.gate = asyncio.Event()

    async def main():
        parent = router.submit(req(prompt(20), "p0"))
        await anext(parent)
        where = a if a.served else b
        for j in range(1, 4):
            r, reason, _ = router.pick(req(prompt(20), f"p{j}", parent="p0"))
            assert (r, reason) == (where, "parent")
        a.gate.set()
        async for _ in parent:
            pass

    asyncio.run(main())


def test_round_robin_and_least_load():
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    rr = Router([a, b, c], policy="round-robin")
    assert [rr.pick(req(prompt(4)))[0] for _ in range(6)] == [a, b, c, a, b, c]
    ll = Router([a, b, c], policy="least-load")
    a.load, b.load, c.load = EngineStats(num_running=3), EngineStats(num_running=1), EngineStats(num_running=2)
    assert {ll.pick(req(prompt(4)))[0] for _ in range(3)} == {b}


def test_down_replicas_are_skipped_and_none_up_is_overload():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.up = False
    assert {router.pick(req(prompt(4)))[0] for _ in range(4)} == {b}
    b.up = False
    assert not router.is_ready()
    with pytest.raises(EngineOverloadedError, match="no engine replica"):
        asyncio.run(drain(router, req(prompt(4))))


def test_a_replica_failing_before_the_first_event_is_retried_elsewhere():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.fail_before_first = True
    evs = [asyncio.run(drain(router, req(prompt(4), f"x{i}"))) for i in range(2)]
    for e in evs:
        assert [ev.replica for ev in e] == [b.url, b.url] and e[-1].finish_reason == "length"
    assert router.decisions[(b.url, "retry")] == 1  # the request that tried a first


def test_an_overloaded_replica_passes_the_request_on_and_all_overloaded_is_503():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.overloaded = True
    for i in range(2):
        evs = asyncio.run(drain(router, req(prompt(4), f"o{i}")))
        assert evs[-1].replica == b.url
    assert a.up  # overloaded is not down
    b.overloaded = True
    with pytest.raises(EngineOverloadedError, match="queue full"):
        asyncio.run(drain(router, req(prompt(4), "o9")))


def test_cancel_aborts_on_the_serving_replica():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.gate = b.gate = asyncio.Event()

    async def main():
        g = router.submit(req(prompt(4), "c1"))
        await anext(g)
        await router.cancel("c1")
        a.gate.set()
        await g.aclose()

    asyncio.run(main())
    assert a.aborted + b.aborted == ["c1"]


def test_replicas_of_different_models_are_refused():
    other = pb.ModelInfo(model="m", tokenizer_id="other", page_size=PS)
    with pytest.raises(ValueError, match="tokenizer_id"):
        Router([FakeReplica("a"), FakeReplica("b", other)])


def test_metrics_per_replica_and_decisions():
    a, b = FakeReplica("a"), FakeReplica("b")
    router = Router([a, b], policy="round-robin")
    a.load = EngineStats(num_running=2, prefix_cache_queries=100, prefix_cache_hits=25, kv_cache_usage=0.5)
    b.up = False
    asyncio.run(drain(router, req(prompt(4))))
    reg = CollectorRegistry()
    reg.register(router.collector("m"))
    text = generate_latest(reg).decode()
    assert f'xlaserve:replica_up{{model_name="m",replica="{a.url}"}} 1.0' in text
    assert f'xlaserve:replica_up{{model_name="m",replica="{b.url}"}} 0.0' in text
    assert f'xlaserve:replica_prefix_cache_hit_rate{{model_name="m",replica="{a.url}"}} 0.25' in text
    assert f'xlaserve:router_decisions_total{{model_name="m",reason="round_robin",replica="{a.url}"}} 1.0' in text
