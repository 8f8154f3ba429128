"""The engine loop's side of the host KV tier: pages between the device pool and host memory.

The KV-cache manager records which cached pages were evicted (to save) and
which fresh pages host-tier hits were given (to load); this module moves
them, on the engine loop's thread, ordered with the steps by dispatch order
(``serving.engine.kv_pages``)::

    turn:  save_evicted()        dispatch reads of the evicted pages (before anything
                                 writes them: their new owners' steps, KV-connector writes)
           schedule()            may evict more pages and record loads
           before_dispatch()     save_evicted() again, then write the loads (host -> device)
           dispatch the steps    (they see the loaded pages)
           after_dispatch()      the reads' arrays to numpy, into the HostKVCache:
                                 the device->host copy overlaps the steps just dispatched

Reads and writes move ``chunk_pages`` pages at a time (one compiled program
each way; short chunks are padded with the null page 0). Host-tier changes
are published as KV events (``host_stored``, ``host_removed``).
"""

from __future__ import annotations

import logging

import numpy as np

from serving.core.kv.host_kv_cache import HostKVCache
from serving.core.kv.kv_cache_manager import KVCacheManager
from serving.core.kv.kv_events import KvEventJournal
from serving.engine.kv_pages import chunks

log = logging.getLogger(__name__)

DEFAULT_CHUNK_PAGES = 16
"""Pages per read or write program (the KV connector's default chunk too)."""


class HostTier:
    """Copies evicted pages into a :class:`HostKVCache` and host-tier hits back.

    Args:
      engine: the engine (``read_pages``, ``write_pages``).
      kv: the page manager, built with ``host=cache``.
      cache: the host-memory LRU.
      events: where host-tier changes are published (None: nowhere).
      chunk_pages: pages per copy program.

    Attributes:
      pages_saved: pages copied to host memory (lifetime).
      pages_loaded: pages written back from it (lifetime).
    """

    def __init__(self, engine, kv: KVCacheManager, cache: HostKVCache, events: KvEventJournal | None = None,
                 chunk_pages: int = DEFAULT_CHUNK_PAGES) -> None:
        self.engine, self.kv, self.cache, self.events = engine, kv, cache, events
        self.chunk_pages = chunk_pages
        self._reads: list[tuple[tuple[bytes, ...], dict]] = []  # (keys, payload of device arrays)
        self.pages_saved = 0
        self.pages_loaded = 0

    def warmup(self) -> None:
        """Compiles the read and write programs (a chunk of the null page 0 read and written
        back), so no first host- or disk-tier hit waits for a compile."""
        payload = self.engine.read_pages((), self.chunk_pages)
        self.engine.write_pages((), {name: np.asarray(a) for name, a in payload.items()})

    def save_evicted(self) -> None:
        """Dispatches reads of the pages evicted since the last call (their old contents:
        call it before anything writes them)."""
        evicted = self.kv.take_evicted()
        if not evicted:
            return
        pages = [p for p, _ in evicted]
        keys = [key for _, key in evicted]
        for i, ids in enumerate(chunks(pages, self.chunk_pages)):
            payload = self.engine.read_pages(ids, self.chunk_pages)
            self._reads.append((tuple(keys[i * self.chunk_pages:i * self.chunk_pages + len(ids)]), payload))

    def before_dispatch(self) -> None:
        """Right before a turn's steps: reads what was evicted meanwhile, then writes every
        recorded load from host memory into its fresh page.

        Raises:
          RuntimeError: a load's key left the host tier (the manager checked it at
            allocation; nothing puts between then and now).
        """
        self.save_evicted()
        loads = self.kv.take_loads()
        C = self.chunk_pages
        for start in range(0, len(loads), C):
            part = loads[start:start + C]
            entries = [self.cache.get(key) for _, key in part]
            if any(e is None for e in entries):
                raise RuntimeError("a host-tier page was dropped before it was loaded")
            payload = {name: _stack([e[name] for e in entries], C) for name in entries[0]}
            self.engine.write_pages([p for p, _ in part], payload)
            self.pages_loaded += len(part)

    def after_dispatch(self) -> None:
        """After a turn's steps are dispatched: the pending reads' pages into the host cache."""
        reads, self._reads = self._reads, []
        stored, removed = [], []
        for keys, payload in reads:
            payload = {name: np.asarray(a) for name, a in payload.items()}
            for i, key in enumerate(keys):
                new, evicted = self.cache.put(key, {name: np.ascontiguousarray(a[:, :, i])
                                                    for name, a in payload.items()})
                if new:
                    stored.append(key)
                    self.pages_saved += 1
                removed += evicted
        if self.events is not None and (stored or removed):
            # The net change (a page may be stored and evicted within one turn).
            self.events.publish(host_stored=[h for h in stored if h in self.cache],
                                host_removed=[h for h in removed if h not in self.cache])


def _stack(pages: list[np.ndarray], chunk_pages: int) -> np.ndarray:
    """[layers, kv_heads, chunk_pages, ...]: the pages (each [layers, kv_heads, ...]), then zeros."""
    first = pages[0]
    out = np.zeros(first.shape[:2] + (chunk_pages,) + first.shape[2:], first.dtype)
    for i, p in enumerate(pages):
        out[:, :, i] = p
    return out


def host_kv_stats(cache: HostKVCache | None) -> dict[str, int]:
    """The host tier's counters as ``EngineStats`` fields (``host_kv_*``); {} without one."""
    if cache is None:
        return {}
    return dict(host_kv_hits=cache.hits, host_kv_stores=cache.stores, host_kv_evictions=cache.evictions,
                host_kv_usage_bytes=cache.usage_bytes, host_kv_capacity_bytes=cache.capacity_bytes)
