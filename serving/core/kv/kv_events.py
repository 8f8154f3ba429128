"""KV events: which prefix-cache pages an engine holds, for routers to follow.

The KV-cache manager (``serving.core.kv.kv_cache_manager``) publishes, in the engine
loop's thread, the chained page hashes it adds to its prefix cache (a full,
computed page offered to the cache) and removes from it (a cached page evicted
for reuse). A router that follows these knows which prompt prefixes each
replica can serve from cache, as NVIDIA Dynamo's KV router and SGLang's
cache-aware router do (Dynamo's ``kv_cache_routing.md`` describes the events).

Batches are numbered consecutively. A subscriber starts from a snapshot of
every cached hash as of some number, then receives each later batch in order;
one that falls too far behind has batches dropped, which it notices as a gap
in the numbers and answers by subscribing again (a fresh snapshot)::

    subscribe()  -> snapshot @ seq 41 {h0, h1, h7}
    batch 42: stored [h8]        -> {h0, h1, h7, h8}
    batch 43: removed [h1]       -> {h0, h7, h8}
    batch 45: ...                -> gap (44 lost): resubscribe

Tiers: with a host KV tier (``serving.core.kv.host_kv_cache``), batches also name the
hashes copied into host memory (``host_stored``) and dropped from it
(``host_removed``); a page may be in both tiers. A router weighs a host-tier
hit below a device hit (it is reloaded, not recomputed, but not free).

The hashes carry the request's prefix-cache salt (a tenant scope), so they
reveal no prompt and match only requests of the same scope.

No JAX here; thread-safe: the engine thread publishes, asyncio tasks (the
gRPC engine service) subscribe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Iterable

DEFAULT_SUBSCRIBER_QUEUE = 4096
"""Batches one subscriber may fall behind before later ones are dropped for it."""


@dataclasses.dataclass(frozen=True)
class KvEventBatch:
    """One change to the cached page set.

    Attributes:
      seq: consecutive from 1 (0: the empty cache before any batch).
      stored: page hashes now cached (16-byte chained keys).
      removed: page hashes no longer cached.
      host_stored: page hashes now in the host tier.
      host_removed: page hashes no longer in the host tier.
      snapshot: True for a subscription's first batch: ``stored`` and
        ``host_stored`` are then the whole cached sets of each tier as of
        ``seq`` (and the removed lists are empty).
    """

    seq: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    snapshot: bool = False
    host_stored: tuple[bytes, ...] = ()
    host_removed: tuple[bytes, ...] = ()


class KvSubscription:
    """Batches for one subscriber, from the engine thread to its asyncio loop.

    Attributes:
      snapshot: the first batch (``snapshot=True``).
      dropped: batches lost because the subscriber fell behind (it will see a gap).
    """

    def __init__(self, journal: "KvEventJournal", snapshot: KvEventBatch, max_queue: int) -> None:
        self.snapshot = snapshot
        self.dropped = 0
        self._journal = journal
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self._max_queue = max_queue

    def _offer(self, batch: KvEventBatch) -> None:  # the engine thread
        try:
            self._loop.call_soon_threadsafe(self._put, batch)
        except RuntimeError:  # the subscriber's loop is closed
            self._journal.unsubscribe(self)

    def _put(self, batch: KvEventBatch) -> None:
        if self._queue.qsize() >= self._max_queue:
            self.dropped += 1
            return
        self._queue.put_nowait(batch)

    async def next(self) -> KvEventBatch:
        """The next batch after the snapshot (waits for one)."""
        return await self._queue.get()

    def close(self) -> None:
        self._journal.unsubscribe(self)


class KvEventJournal:
    """The set of cached page hashes, its change batches and their subscribers.

    Args:
      max_subscriber_queue: batches a subscriber may have unread before
        further ones are dropped for it.
    """

    def __init__(self, max_subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE) -> None:
        self._lock = threading.Lock()
        self._cached: set[bytes] = set()
        self._host: set[bytes] = set()
        self._seq = 0
        self._subscribers: list[KvSubscription] = []
        self.max_subscriber_queue = max_subscriber_queue

    @property
    def seq(self) -> int:
        """The number of the last batch published (0: none yet)."""
        return self._seq

    def publish(self, stored: Iterable[bytes] = (), removed: Iterable[bytes] = (),
                host_stored: Iterable[bytes] = (), host_removed: Iterable[bytes] = ()) -> None:
        """Records one change (nothing when all are empty) and offers it to every subscriber.
        Within each tier, ``removed`` applies before ``stored``."""
        stored, removed = tuple(stored), tuple(removed)
        host_stored, host_removed = tuple(host_stored), tuple(host_removed)
        if not (stored or removed or host_stored or host_removed):
            return
        with self._lock:
            self._seq += 1
            self._cached.difference_update(removed)
            self._cached.update(stored)
            self._host.difference_update(host_removed)
            self._host.update(host_stored)
            batch = KvEventBatch(self._seq, stored, removed, host_stored=host_stored, host_removed=host_removed)
            subscribers = list(self._subscribers)
        for sub in subscribers:
            sub._offer(batch)

    def subscribe(self) -> KvSubscription:
        """A new subscription (call on the subscriber's event loop): its snapshot, then every later batch."""
        with self._lock:
            sub = KvSubscription(self, KvEventBatch(self._seq, tuple(self._cached), snapshot=True,
                                                    host_stored=tuple(self._host)),
                                 self.max_subscriber_queue)
            self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def cached(self) -> frozenset[bytes]:
        """The cached page hashes now (the device tier)."""
        with self._lock:
            return frozenset(self._cached)

    def host_cached(self) -> frozenset[bytes]:
        """The page hashes in the host tier now."""
        with self._lock:
            return frozenset(self._host)
