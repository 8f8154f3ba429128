"""A bounded host-memory LRU of KV pages, keyed by their prefix-cache page hashes.

The second tier under the device prefix cache (``serving.core.kv.kv_cache_manager``):
a page evicted from the device pool (cached pages of finished or preempted
requests, reused for others) is copied here, under the same chained key
(``page_hash``), and a later prefix hit reloads it instead of recomputing it.
``serving.runtime.host_tier_steps`` moves the pages between the tiers; this module
only holds them::

    device prefix cache  --evicted page (k, v)-->  HostKVCache  --prefix hit-->  fresh device page
                                                   (LRU, <= capacity_bytes)
                                                         |
                                            evicted: spill(key, entry) -> the disk tier, if any

An entry is one page of every layer: a payload of named numpy arrays, one page
of what ``serving.engine.kv_pages.read_pages`` returns: "k" and "v", each
``[layers, kv_heads, page_size, head_dim]`` in the cache's storage dtype, and for a
quantized KV cache (int8, fp8) also "k_scale" and "v_scale", each
``[layers, kv_heads, page_size]`` float32. The tier keeps and returns whatever
arrays a payload holds. The bound counts the ``nbytes`` of every array of every
entry; storing past it evicts the least recently used entries (stored or read) first, handing each
to ``spill`` (the disk tier, ``serving.core.kv.disk_kv_store``, under
``serving.runtime.disk_tier_steps``).
(A page's key carries its KV format, ``kv_cache_manager.page_hash``, so a payload
is never found by a cache of another format.)

No JAX here. Thread-safe (a lock): the engine loop's thread puts and gets,
metrics scrapes read the counters.
"""

from __future__ import annotations

import collections
import threading
from typing import Mapping

import numpy as np

Payload = Mapping[str, np.ndarray]
"""One page of every layer: named arrays ("k", "v"[, "k_scale", "v_scale"])."""


def payload_bytes(page: Payload) -> int:
    """Bytes of every array of a page payload."""
    return sum(a.nbytes for a in page.values())

GIB = 1 << 30


class HostKVCache:
    """Byte-bounded LRU of page hash -> page payload (named arrays).

    Args:
      capacity_bytes: most bytes of page arrays held (>= 0; 0 holds nothing).
      spill: called as ``spill(key, entry)`` with each entry evicted to make room (``entry``:
        the arrays :meth:`put` stored, k then v), after the lock is released: the disk tier
        (``serving.runtime.disk_tier_steps``) writes them there. None: they are dropped.

    Attributes (lifetime counters, in pages):
      hits: entries read by :meth:`get` (pages reloaded instead of recomputed).
      misses: :meth:`get` calls that found nothing.
      stores: entries added by :meth:`put`.
      evictions: entries dropped to make room.

    Raises:
      ValueError: a negative capacity.
    """

    def __init__(self, capacity_bytes: int, spill=None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.spill = spill
        self.usage_bytes = 0
        self.hits = self.misses = self.stores = self.evictions = 0
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[bytes, Payload] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is held (neither counted nor touched in the LRU order)."""
        return key in self._entries

    contains = __contains__  # (the callable ``KVCacheManager(host=...)`` asks)

    def keys(self) -> list[bytes]:
        """The held keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: bytes) -> Payload | None:
        """The page's payload (``"k"``, ``"v"`` each ``[layers, kv_heads, page_size, head_dim]``,
        and any scale pages), now the most recently used; None if not held. Counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: bytes, page: Payload) -> tuple[bool, list[bytes]]:
        """Stores one page's payload (the arrays are kept, not copied), evicting least recently
        used entries until it fits. A key already held is only touched (same key: same content).

        Returns:
          (whether ``key`` was newly stored, the keys evicted to make room). A page larger
          than the whole capacity is not stored and evicts nothing.
        """
        size = payload_bytes(page)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return False, []
            if size > self.capacity_bytes:
                return False, []
            evicted, spilled = [], []
            while self.usage_bytes + size > self.capacity_bytes:
                old, entry = self._entries.popitem(last=False)
                self.usage_bytes -= payload_bytes(entry)
                self.evictions += 1
                evicted.append(old)
                spilled.append((old, entry))
            self._entries[key] = page
            self.usage_bytes += size
            self.stores += 1
        if self.spill is not None:
            for old, entry in spilled:
                self.spill(old, entry)
        return True, evicted

    def items(self) -> list[tuple[bytes, Payload]]:
        """(key, entry) of every held page, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries.items())
