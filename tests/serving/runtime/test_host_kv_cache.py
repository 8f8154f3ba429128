"""The host KV tier: its LRU, the page manager's evict/lookup/load records, the engine loop
reloading evicted and preempted pages, the KV events and the router's weighing."""

from __future__ import annotations

import numpy as np
import pytest

from serving.core.kv.host_kv_cache import HostKVCache
from serving.core.kv.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.core.kv.kv_events import KvEventJournal


def page(fill: float, shape=(2, 1, 4, 8)) -> dict[str, np.ndarray]:
    return {"k": np.full(shape, fill, np.float32), "v": np.full(shape, -fill, np.float32)}


PAGE_BYTES = 2 * 2 * 1 * 4 * 8 * 4  # k and v of page()


# -- HostKVCache -------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_within_capacity():
    c = HostKVCache(3 * PAGE_BYTES)
    for i in range(3):
        assert c.put(bytes([i]), page(i)) == (True, [])
    assert c.get(b"\x00")["k"][0, 0, 0, 0] == 0  # touch 0: 1 is now least recently used
    stored, evicted = c.put(b"\x03", page(3))
    assert stored and evicted == [b"\x01"]
    assert c.keys() == [b"\x02", b"\x00", b"\x03"]
    assert c.usage_bytes == 3 * PAGE_BYTES and c.capacity_bytes == 3 * PAGE_BYTES
    assert (c.hits, c.stores, c.evictions) == (1, 4, 1)
    assert c.get(b"\x01") is None and c.misses == 1


def test_put_of_a_held_key_only_touches_and_too_big_is_not_stored():
    c = HostKVCache(2 * PAGE_BYTES)
    c.put(b"a", page(1))
    c.put(b"b", page(2))
    assert c.put(b"a", page(9)) == (False, [])  # same key, same content: kept, now newest
    assert c.keys() == [b"b", b"a"] and c.get(b"a")["k"][0, 0, 0, 0] == 1
    assert c.put(b"big", page(1, shape=(2, 1, 4, 64))) == (False, [])
    assert len(c) == 2 and c.stores == 2
    assert "a" not in c and b"a" in c and c.contains(b"b")
    with pytest.raises(ValueError):
        HostKVCache(-1)


def test_zero_capacity_holds_nothing():
    c = HostKVCache(0)
    assert c.put(b"a", page(1)) == (False, []) and len(c) == 0


# -- KVCacheManager with a host tier --------------------------------------------------------


def tokens(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def manager(num_pages=6, host=None, events=None) -> KVCacheManager:
    return KVCacheManager(num_pages, 4, host=host, events=events)


def fill(kv: KVCacheManager, rid: str, ids: list[int]) -> None:
    """A request computes ``ids`` whole, offers its pages and ends."""
    assert kv.allocate_pages(rid, len(ids))
    kv.cache_pages(rid, ids, len(ids), None)
    kv.free(rid)


def test_evicted_cached_pages_are_recorded_for_the_host_tier_before_reuse():
    host = HostKVCache(1 << 20)
    kv = manager(host=host)
    a = tokens(12)
    fill(kv, "a", a)  # 3 cached pages, then free (5 usable pages)
    assert kv.take_evicted() == []
    assert kv.allocate_pages("b", 20)  # all 5 pages: a's 3 cached ones evicted
    evicted = kv.take_evicted()
    keys = prompt_page_hashes(a, 4, None)
    assert sorted(k for _, k in evicted) == sorted(keys)
    assert all(p in kv.page_ids("b") for p, _ in evicted)
    assert kv.take_evicted() == []  # taken once
    kv.check_invariants()


def test_a_key_the_host_already_holds_is_not_saved_again():
    host = HostKVCache(1 << 20)
    kv = manager(host=host)
    a = tokens(12)
    fill(kv, "a", a)
    for k in prompt_page_hashes(a, 4, None):
        host.put(k, page(0))
    assert kv.allocate_pages("b", 20)
    assert kv.take_evicted() == []


def test_no_host_tier_records_nothing():
    kv = manager()
    fill(kv, "a", tokens(12))
    assert kv.allocate_pages("b", 20)
    assert kv.take_evicted() == [] and kv.take_loads() == []


def test_lookup_continues_into_the_host_tier_and_allocate_records_loads():
    host = HostKVCache(1 << 20)
    events = KvEventJournal()
    kv = manager(num_pages=8, host=host, events=events)
    ids = tokens(17)
    keys = prompt_page_hashes(ids, 4, None)
    fill(kv, "a", ids[:8])  # pages 0-1 on device
    for k in keys[2:4]:  # pages 2-3 in the host tier only
        host.put(k, page(1))
    hit = kv.lookup_prefix(ids, None, max_tokens=16)
    assert hit.keys == tuple(keys[:2]) and hit.host_keys == tuple(keys[2:4])
    assert len(hit.page_ids) == 2 and hit.num_tokens == 16
    assert kv.allocate_pages("r", 17, prefix=hit)
    held = kv.page_ids("r")
    assert held[:2] == hit.page_ids and len(held) == 5
    assert kv.take_loads() == [(held[2], keys[2]), (held[3], keys[3])]
    assert kv.num_cached_tokens("r") == 16
    # Loaded pages are cached on device from now on: a later lookup hits them there.
    again = kv.lookup_prefix(ids, None, max_tokens=16)
    assert again.page_ids == held[:4] and again.host_keys == ()
    assert set(keys[:4]) <= events.cached()
    kv.check_invariants()


def test_host_hit_stops_at_the_first_key_in_neither_tier_and_respects_max_tokens():
    host = HostKVCache(1 << 20)
    kv = manager(num_pages=8, host=host)
    ids = tokens(20)
    keys = prompt_page_hashes(ids, 4, None)
    host.put(keys[0], page(0))
    host.put(keys[2], page(0))  # key 1 missing: 2 is unreachable
    hit = kv.lookup_prefix(ids, None, max_tokens=19)
    assert hit.page_ids == () and hit.host_keys == (keys[0],) and hit.num_tokens == 4
    assert kv.lookup_prefix(ids, None, max_tokens=3).num_tokens == 0


def test_a_host_hit_that_left_the_host_tier_is_stale():
    host = HostKVCache(PAGE_BYTES)
    kv = manager(host=host)
    ids = tokens(9)
    keys = prompt_page_hashes(ids, 4, None)
    host.put(keys[0], page(0))
    hit = kv.lookup_prefix(ids, None, max_tokens=8)
    host.put(b"other", page(0))  # evicts keys[0]
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_pages("r", 9, prefix=hit)
    kv.check_invariants()


def test_a_host_hit_that_does_not_fit_takes_nothing():
    host = HostKVCache(1 << 20)
    kv = manager(num_pages=4, host=host)  # 3 usable pages
    ids = tokens(16)
    for k in prompt_page_hashes(ids, 4, None)[:3]:
        host.put(k, page(0))
    hit = kv.lookup_prefix(ids, None, max_tokens=15)
    assert len(hit.host_keys) == 3
    assert not kv.allocate_pages("r", 16, prefix=hit)  # 4 pages needed
    assert kv.take_loads() == [] and kv.num_free == 3


# -- the engine loop with a host tier (tiny-random, float32) ------------------------------------


def host_loop(host_bytes: int = 1 << 24, **overrides):
    """A loop in test_engine_loop's preemption shape (12 usable pages of 8 tokens)."""
    import jax.numpy as jnp
    from flax import nnx

    from model.gemma3 import Gemma3
    from serving.engine.engine import Engine, EngineConfig
    from serving.runtime.engine_loop import EngineLoop
    from tests.support.tiny_engine import TINY

    cfg = EngineConfig(**{**dict(max_slots=4, num_pages=13, max_model_len=96, page_size=8,
                                 prefill_chunk=32, min_decode_batch=2), **overrides})
    return EngineLoop(Engine(Gemma3(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0)), cfg),
                      host_kv_cache_bytes=host_bytes)


def test_evicted_prefix_reloads_from_the_host_tier_with_identical_output(jax_cache):
    import asyncio

    from tests.support.engine_helpers import collect, request
    from tests.support.tiny_engine import prompt

    lp = host_loop()
    plans = []
    lp.on_step = plans.append
    lp.start(warmup=False)
    try:
        a = prompt(41, 5)  # 5 full pages of 8 tokens, then one more
        sampled = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7)
        first_ids, first = asyncio.run(collect(lp, request(a, **sampled)))
        assert first[-1].cached_tokens == 0 and first[-1].host_cached_tokens == 0
        pages = lp.kv.lookup_prefix(a, None, 40).page_ids
        assert len(pages) == 5
        k0, v0 = (np.asarray(x)[:, :, :5] for x in lp.engine.read_pages(pages, 16).values())
        # 90 + 4 tokens need all 12 pages: every cached page of a is evicted.
        asyncio.run(collect(lp, request(prompt(90, 3), max_tokens=4, ignore_eos=True)))  # (the loop is idle)
        assert lp.kv.lookup_prefix(a, None, 40).page_ids == ()
        assert lp.host_kv.stores >= 5 and lp.kv_events.host_cached() >= set(prompt_page_hashes(a, 8, None))
        n = len(plans)
        again_ids, again = asyncio.run(collect(lp, request(a, **sampled)))
        reloaded = lp.kv.lookup_prefix(a, None, 40).page_ids
        k1, v1 = (np.asarray(x)[:, :, :5] for x in lp.engine.read_pages(reloaded, 16).values())
    finally:
        lp.stop()
    np.testing.assert_array_equal(k1, k0)  # bit for bit, in other pages
    np.testing.assert_array_equal(v1, v0)
    assert again_ids == first_ids
    assert again[-1].cached_tokens == 40 and again[-1].host_cached_tokens == 40
    assert lp.host_kv.hits == 5 and lp.stats().host_kv_hits == 5
    assert lp.host_tier.pages_loaded == 5
    rows = [r for p in plans[n:] for r in p.prefill]
    assert rows[0].start == 40 and sum(len(r.token_ids) for r in rows) == 1  # only the last prompt token


def test_a_preempted_request_resumes_from_host_pages_without_recomputing(jax_cache):
    from tests.support.engine_helpers import generate, request
    from tests.support.tiny_engine import prompt

    reqs = lambda: [request(prompt(20, i), max_tokens=30, ignore_eos=True) for i in range(4)]
    # 12 pages of 8 tokens: each request needs 7 alone, so four at once must preempt.
    lp = host_loop()
    plans, events = [], {}
    lp.on_step = plans.append
    lp.start(warmup=False)

    async def run(r):
        from tests.support.engine_helpers import collect
        ids, evs = await collect(lp, r)
        events[r.request_id] = evs[-1]
        return ids

    import asyncio

    async def main():
        return await asyncio.gather(*(run(r) for r in reqs()))

    try:
        crowded = asyncio.run(main())
    finally:
        lp.stop()
    preempted = {rid for p in plans for rid in p.preempted}
    assert preempted
    resumed = [rid for rid in preempted if events[rid].host_cached_tokens > 0]
    assert resumed, "no preempted request reloaded pages from the host tier"
    for rid in resumed:
        after = next(i for i, p in enumerate(plans) if rid in p.preempted)
        rows = [r for p in plans[after + 1:] for r in p.prefill if r.request_id == rid]
        assert rows[0].start >= events[rid].host_cached_tokens > 0  # the reloaded prefix is not computed
        assert events[rid].num_preemptions >= 1
    assert lp.host_kv.hits > 0
    # The same crowd without a host tier (recomputing; it equals each request run alone,
    # tests/serving/runtime/test_engine_loop.py): the same outputs.
    without = host_loop(host_bytes=0)
    without.start(warmup=False)
    try:
        assert crowded == generate(without, reqs())
    finally:
        without.stop()


# -- KV events and the router ---------------------------------------------------------------------


def test_kv_events_name_the_host_tier_and_the_replica_index_follows():
    import asyncio

    from serving.rpc.remote_engine import ReplicaKvIndex

    journal = KvEventJournal()
    journal.publish(stored=[b"d1"], host_stored=[b"h1", b"h2"])

    async def main():
        sub = journal.subscribe()
        journal.publish(removed=[b"d1"], host_stored=[b"d1"], host_removed=[b"h1"])
        return sub.snapshot, await sub.next()

    snap, batch = asyncio.run(main())
    assert set(snap.stored) == {b"d1"} and set(snap.host_stored) == {b"h1", b"h2"}
    assert batch.host_stored == (b"d1",) and batch.host_removed == (b"h1",)
    assert journal.host_cached() == {b"d1", b"h2"} and journal.cached() == set()
    index = ReplicaKvIndex()
    index.reset(snap.seq, snap.stored, snap.host_stored)
    assert index.apply(batch.seq, batch.stored, batch.removed, batch.host_stored, batch.host_removed)
    assert index.keys == set() and index.host_keys == {b"d1", b"h2"}
    assert index.matched_tiers([b"d1", b"h2", b"x"]) == (0, 2)


def test_router_weighs_a_host_tier_page_below_a_device_page():
    from serving.routing.router import HOST_PAGE_WEIGHT, Router
    from tests.support.router_fakes import PS, FakeReplica, prompt, req

    assert HOST_PAGE_WEIGHT == 0.25
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    p = prompt(16 * PS + 3)
    keys = prompt_page_hashes(p, PS, None)
    b.kv_index.host_keys.update(keys)  # all 16 pages in b's host tier: worth 4 device pages
    router = Router([a, c, b])
    assert router.pick(req(p))[:2] == (b, "host_cache_hit")  # better than nothing at all
    a.kv_index.keys.update(keys[:3])  # 3 device pages on a: b still saves more
    assert router.pick(req(p))[:2] == (b, "host_cache_hit")
    a.kv_index.keys.update(keys[:5])  # 5 device pages: a wins
    assert router.pick(req(p)) == (a, "cache_hit", 5)
    # Host pages count only right after the device hit (as the engine's lookup reloads them).
    b.kv_index.host_keys.difference_update(keys[:1])
    assert b.kv_index.matched_tiers(keys) == (0, 0)


def test_host_counts_cross_grpc_and_reach_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from serving.contract.engine_client import EngineStats, TokenEvent
    from serving.gateway.services.metrics import EngineStatsCollector
    from serving.rpc import convert

    ev = TokenEvent("r", (1,), prompt_tokens=50, cached_tokens=40, host_cached_tokens=32)
    back = convert.event_from_proto("r", convert.event_to_proto(ev).tokens)
    assert (back.cached_tokens, back.host_cached_tokens) == (40, 32)
    s = EngineStats(host_kv_hits=5, host_kv_stores=7, host_kv_evictions=2, host_kv_usage_bytes=4096,
                    host_kv_capacity_bytes=1 << 20)
    assert convert.load_from_proto(convert.load_to_proto(s)) == dataclasses_replace_usage(s)
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(lambda: {"m": lambda: s}))
    text = generate_latest(reg).decode()
    for line in ('xlaserve:host_kv_cache_hits_total{model_name="m"} 5.0',
                 'xlaserve:host_kv_cache_stores_total{model_name="m"} 7.0',
                 'xlaserve:host_kv_cache_evictions_total{model_name="m"} 2.0',
                 'xlaserve:host_kv_cache_usage_bytes{model_name="m"} 4096.0',
                 'xlaserve:host_kv_cache_capacity_bytes{model_name="m"} 1.048576e+06'):
        assert line in text, line


def dataclasses_replace_usage(s):
    """``s`` as a Load round trip gives it back (kv_cache_usage is derived from the page counts)."""
    import dataclasses

    return dataclasses.replace(s, kv_cache_usage=0.0)


def test_a_host_tier_without_the_prefix_cache_or_below_zero_is_refused():
    from serving.config.server_config import ServerConfig

    with pytest.raises(ValueError, match="needs the prefix cache"):
        ServerConfig(host_kv_cache_gib=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=">= 0"):
        ServerConfig(host_kv_cache_gib=-1)
    assert ServerConfig(host_kv_cache_gib=0, enable_prefix_caching=False).host_kv_cache_gib == 0
