"""The engine loop's side of the disk KV tier: pages between host memory and files.

Under the host tier (``serving.runtime.host_tier_steps``) sits a
``serving.core.kv.disk_kv_store.DiskKVStore``. Pages reach it three ways, none on the
engine loop's time (the store's writer thread writes the files):

  * the host tier evicts them (``HostKVCache(spill=...)``: :meth:`DiskTier.spill`);
  * the loop stops (a restart, a rolled deployment): :meth:`DiskTier.save_all` copies the
    device prefix cache's pages and the host tier's into the store and waits for the files.

A new request whose prompt prefix continues on disk past what the device and host tiers
hold waits outside the scheduler while a reader thread reads those pages (files checked:
model, format, checksum); once read, the loop puts them into the host tier and queues the
request, whose prefix lookup then finds them there and loads them as host-tier hits::

    submit --> park(): keys after the device/host hit found on disk? --no--> scheduler
                  | yes: reader thread reads the files
                  v
    each turn: ready(): read pages -> HostKVCache (host_stored events) -> scheduler

A page that cannot be read (gone, torn, corrupt, foreign) ends the run of read pages: the
rest of the prompt is computed. The request's ``disk_cached_tokens`` are the tokens of the
pages read for it. Requests through a LoRA adapter, a KV transfer, or without a prefix
lookup (prompt log probabilities, penalties) skip the disk tier.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

import numpy as np

from serving.core.kv.disk_kv_store import DiskKVStore
from serving.core.kv.host_kv_cache import HostKVCache
from serving.core.kv.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.core.kv.kv_events import KvEventJournal

log = logging.getLogger(__name__)

@dataclasses.dataclass(eq=False)
class _Parked:
    seq: object
    keys: list[bytes]
    future: concurrent.futures.Future


class DiskTier:
    """Writes host-tier evictions to a :class:`DiskKVStore` and reads prefixes back.

    Args:
      store: the page files.
      cache: the host tier (built with ``spill=disk_tier.spill``; see :meth:`attach`).
      kv: the page manager (prefix lookups, the device cache's pages).
      events: where pages read into the host tier are published (None: nowhere).
      wake: called (from the reader thread) when a request's pages are read: wakes the loop.
      readers: reader threads.

    Attributes:
      pages_read: pages read from disk into the host tier (lifetime).
    """

    def __init__(self, store: DiskKVStore, kv: KVCacheManager, events: KvEventJournal | None = None,
                 wake=None, readers: int = 2) -> None:
        self.store, self.kv, self.events, self.wake = store, kv, events, wake
        self.cache: HostKVCache | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="xlaserve-kv-disk-reader")
        self._parked: dict[str, _Parked] = {}
        self.pages_read = 0

    def attach(self, cache: HostKVCache) -> None:
        """Makes ``cache`` the host tier above: its evictions come here."""
        self.cache = cache
        cache.spill = self.spill

    def spill(self, key: bytes, entry: dict) -> None:
        """A page the host tier evicted (its payload of named arrays: ``k``, ``v`` and a quantized
        format's ``k_scale``, ``v_scale``): queued for the writer (called on the loop's thread)."""
        self.store.put(key, dict(entry))

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def park(self, seq) -> bool:
        """Starts reading the disk pages a new request's prefix continues with; returns whether
        it did (the request then waits for :meth:`ready`) or the request can be queued now."""
        r = seq.sched
        if not r.prefix_cache or self.cache is None or len(self.store) == 0:
            return False
        parent = self._parked.get(r.parent_id) if r.parent_id is not None else None
        if parent is not None:  # one of n choices: queued with its parent (after it), as one family
            self._parked[seq.req.request_id] = _Parked(seq, parent.keys, parent.future)
            return True
        tokens = r.prompt_ids
        hit = self.kv.lookup_prefix(tokens, r.salt, len(tokens) - 1, r.images)
        have = len(hit.page_ids) + len(hit.host_keys)
        keys = []
        for key in prompt_page_hashes(tokens[:len(tokens) - 1], self.kv.page_size, r.salt, r.images,
                                      self.kv.kv_format)[have:]:
            if key in self.cache:  # (in host memory already: found there)
                continue
            if not self.store.contains(key):
                break
            keys.append(key)
        if not keys:
            return False
        fut = self._pool.submit(self._read, keys)
        self._parked[seq.req.request_id] = _Parked(seq, keys, fut)
        if self.wake is not None:
            fut.add_done_callback(lambda _: self.wake())
        return True

    def _read(self, keys: list[bytes]) -> list[tuple[bytes, dict]]:
        """Reads pages in order up to the first that cannot be read (reader thread)."""
        out = []
        for key in keys:
            arrays = self.store.read(key)
            if arrays is None:
                break
            out.append((key, arrays))
        return out

    def ready(self) -> list:
        """The parked requests whose pages are read, now in the host tier (loop thread)."""
        done = [p for p in self._parked.values() if p.future.done()]
        stored = []
        for p in done:
            del self._parked[p.seq.req.request_id]
            try:
                pages = p.future.result()
            except Exception:  # a bug in reading: the request computes its prompt
                log.exception("KV disk tier: reading a prefix failed")
                pages = []
            for key, arrays in pages:
                new, _ = self.cache.put(key, dict(arrays))
                if new:
                    stored.append(key)
            self.pages_read += len(pages)
            p.seq.disk_cached_tokens = len(pages) * self.kv.page_size
        if self.events is not None and stored:
            self.events.publish(host_stored=[k for k in stored if k in self.cache])
        return [p.seq for p in done]

    def drop(self, request_id: str) -> bool:
        """A parked request ends (cancelled): forgets it. Returns whether it was parked."""
        return self._parked.pop(request_id, None) is not None

    def save_all(self, engine, chunk_pages: int, timeout: float = 60.0) -> int:
        """Copies the device prefix cache's pages and the host tier's into the store and waits
        for the writes (the loop is stopping; on its thread, after its last step). Returns the
        pages queued."""
        t0 = time.perf_counter()
        n = 0
        for key, entry in self.cache.items() if self.cache is not None else ():
            n += self.store.put(key, dict(entry))
        device = [(p, key) for p, key in self.kv.cached_pages() if not self.store.contains(key)]
        for start in range(0, len(device), chunk_pages):
            part = device[start:start + chunk_pages]
            arrays = {name: np.asarray(a) for name, a in engine.read_pages([p for p, _ in part], chunk_pages).items()}
            for i, (_, key) in enumerate(part):
                n += self.store.put(key, {name: a[:, :, i].copy() for name, a in arrays.items()})
        ok = self.store.flush(timeout)
        log.info("KV disk tier: %d pages saved in %.1f s%s", n, time.perf_counter() - t0,
                 "" if ok else " (writes still pending at the timeout)")
        return n

    def close(self) -> None:
        """Stops the readers and the store's writer (after its queue is written)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()


def model_identity(model_cfg, *parts: object) -> str:
    """A served model's identity for the page files' headers: its name, a digest of its
    config, and ``parts`` (the weights' source, dtype, quantization) joined with ``|``."""
    import hashlib

    digest = hashlib.blake2b(repr(model_cfg).encode(), digest_size=8).hexdigest()
    return "|".join([f"{getattr(model_cfg, 'name', type(model_cfg).__name__)}:{digest}", *map(str, parts)])


def disk_kv_stats(store: DiskKVStore | None) -> dict:
    """The disk tier's counters as ``EngineStats`` fields (``disk_kv_*``); {} without one."""
    if store is None:
        return {}
    return dict(disk_kv_hits=store.hits, disk_kv_stores=store.stores, disk_kv_evictions=store.evictions,
                disk_kv_usage_bytes=store.usage_bytes, disk_kv_capacity_bytes=store.max_bytes,
                disk_kv_bytes_read=store.bytes_read, disk_kv_bytes_written=store.bytes_written,
                disk_kv_read_seconds=store.read_seconds, disk_kv_reads=store.reads,
                disk_kv_corrupt_files=store.corrupt_files, disk_kv_foreign_files=store.foreign_files,
                disk_kv_dropped_pages=store.dropped_pages)
