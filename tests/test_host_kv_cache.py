"""The host KV tier: its LRU, the page manager's evict/lookup/load records, the engine loop
reloading evicted and preempted pages, the KV events and the router's weighing."""

from __future__ import annotations

import numpy as np
import pytest

from serving.host_kv_cache import HostKVCache
from serving.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.kv_events import KvEventJournal


def page(fill: float, shape=(2, 1, 4, 8)) -> tuple[np.ndarray, np.ndarray]:
    return np.full(shape, fill, np.float32), np.full(shape, -fill, np.float32)


PAGE_BYTES = 2 * 2 * 1 * 4 * 8 * 4  # k and v of page()


# -- HostKVCache -------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_within_capacity():
    c = HostKVCache(3 * PAGE_BYTES)
    for i in range(3):
        assert c.put(bytes([i]), *page(i)) == (True, [])
    assert c.get(b"\x00")[0][0, 0, 0, 0] == 0  # touch 0: 1 is now least recently used
    stored, evicted = c.put(b"\x03", *page(3))
    assert stored and evicted == [b"\x01"]
    assert c.keys() == [b"\x02", b"\x00", b"\x03"]
    assert c.usage_bytes == 3 * PAGE_BYTES and c.capacity_bytes == 3 * PAGE_BYTES
    assert (c.hits, c.stores, c.evictions) == (1, 4, 1)
    assert c.get(b"\x01") is None and c.misses == 1


def test_put_of_a_held_key_only_touches_and_too_big_is_not_stored():
    c = HostKVCache(2 * PAGE_BYTES)
    c.put(b"a", *page(1))
    c.put(b"b", *page(2))
    assert c.put(b"a", *page(9)) == (False, [])  # same key, same content: kept, now newest
    assert c.keys() == [b"b", b"a"] and c.get(b"a")[0][0, 0, 0, 0] == 1
    assert c.put(b"big", *page(1, shape=(2, 1, 4, 64))) == (False, [])
    assert len(c) == 2 and c.stores == 2
    assert "a" not in c and b"a" in c and c.contains(b"b")
    with pytest.raises(ValueError):
        HostKVCache(-1)


def test_zero_capacity_holds_nothing():
    c = HostKVCache(0)
    assert c.put(b"a", *page(1)) == (False, []) and len(c) == 0


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
        host.put(k, *page(0))
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
        host.put(k, *page(1))
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
    host.put(keys[0], *page(0))
    host.put(keys[2], *page(0))  # key 1 missing: 2 is unreachable
    hit = kv.lookup_prefix(ids, None, max_tokens=19)
    assert hit.page_ids == () and hit.host_keys == (keys[0],) and hit.num_tokens == 4
    assert kv.lookup_prefix(ids, None, max_tokens=3).num_tokens == 0


def test_a_host_hit_that_left_the_host_tier_is_stale():
    host = HostKVCache(PAGE_BYTES)
    kv = manager(host=host)
    ids = tokens(9)
    keys = prompt_page_hashes(ids, 4, None)
    host.put(keys[0], *page(0))
    hit = kv.lookup_prefix(ids, None, max_tokens=8)
    host.put(b"other", *page(0))  # evicts keys[0]
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_pages("r", 9, prefix=hit)
    kv.check_invariants()


def test_a_host_hit_that_does_not_fit_takes_nothing():
    host = HostKVCache(1 << 20)
    kv = manager(num_pages=4, host=host)  # 3 usable pages
    ids = tokens(16)
    for k in prompt_page_hashes(ids, 4, None)[:3]:
        host.put(k, *page(0))
    hit = kv.lookup_prefix(ids, None, max_tokens=15)
    assert len(hit.host_keys) == 3
    assert not kv.allocate_pages("r", 16, prefix=hit)  # 4 pages needed
    assert kv.take_loads() == [] and kv.num_free == 3
