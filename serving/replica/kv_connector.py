"""The KV connector: disaggregated prefill and decode, on the engine loop's side.

Shaped like vLLM's v1 KV connector (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished`` returning transfer params,
``get_finished`` with done sets), over the transports of
``serving.replica.kv_transport``. One request's path::

    gateway/router ──► prefill replica: kv_produce request (max_tokens 1)
                        computes the prompt; at its end request_finished() pins its
                        full prompt pages (KVCacheManager.pin), copies them into
                        layer-stacked chunks and offers them   ──► final event: KvTransferParams
    gateway/router ──► decode replica: request + those params
                        receive(): waiting for KV, its pages reserved (a pinned holder
                        over the pages its own prefix cache lacks), the missing chunks
                        pulled in a worker thread ──► written into the reserved pages,
                        offered to its prefix cache ──► the scheduler admits it with a
                        prefix hit of every transferred page, computes the partial last
                        page and the last prompt token, samples and decodes
                     ──► ReleaseKv: the prefill side frees its pinned pages

Only full pages of the first ``len(prompt) - 1`` tokens move (the decode side
computes the rest, and the last prompt token for its logits: its first token is
sampled where it decodes, keyed by (seed, position) as always, so it equals a
co-located replica's). The decode side pulls only the chunks holding pages its
own prefix cache lacks (matched by the offered page hashes).

Failures: a pull that fails (the prefill replica died, the offer expired) ends
the request with an "error" event and frees its reserved pages; a decode side
that finds no pages to reserve computes the prompt itself. The prefill side
frees an offer's pages when the decode side releases them or at
``timeout_s`` after the offer, whichever is first (the only clock).

All methods run on the engine loop's thread except :meth:`release` (any
thread: the engine service's ``ReleaseKv``) and the pull workers.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from serving.contract.engine_client import KvTransferParams
from serving.core.kv.kv_cache_manager import KVCacheManager, prompt_page_hashes
from serving.engine.kv_pages import chunks
from serving.replica.kv_transport import KvTransferError, Transport, new_transfer_id
from serving.rpc import engine_pb2 as pb

log = logging.getLogger("xlaserve.kv_connector")

DEFAULT_CHUNK_PAGES = 16
DEFAULT_TIMEOUT_S = 30.0


@dataclasses.dataclass
class _Receiving:
    """A decode-side request waiting for its pages."""

    seq: object  # the engine loop's _Sequence
    params: KvTransferParams
    holder: str
    started: float
    nbytes: int = 0


@dataclasses.dataclass
class Received:
    """A pull's outcome for the engine loop (:meth:`KvConnector.get_finished`).

    Attributes:
      seq: the request's engine-loop sequence.
      error: why it failed (None: its pages are in place and cached).
      nbytes: bytes pulled; seconds: from the reservation to the pages in place.
    """

    seq: object
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


class KvConnector:
    """One replica's KV transfers (both sides; a replica of role "both" does either).

    Args:
      engine: the engine (``read_pages``, ``write_pages``, its config).
      kv: the engine loop's page manager.
      transport: the replica's :class:`~serving.replica.kv_transport.Transport`.
      timeout_s: an offer's pages are freed this long after it is made if not released.
      chunk_pages: pages per chunk (one compiled copy program each way).
      wake: called from a worker thread when a pull ends (wakes an idle loop).
    """

    def __init__(self, engine, kv: KVCacheManager, transport: Transport, timeout_s: float = DEFAULT_TIMEOUT_S,
                 chunk_pages: int = DEFAULT_CHUNK_PAGES, wake: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.kv = kv
        self.transport = transport
        self.timeout_s = timeout_s
        self.chunk_pages = chunk_pages
        self.wake = wake
        cache = engine.kv_cache
        k = cache.k
        self.page_shape = (k.shape[0], k.shape[1], k.shape[3], k.shape[4])
        self.dtype = np.dtype(k.dtype).name
        self.kv_format = cache.kv_format if cache.quantized else ""  # as its prefix cache keys pages
        self._offers: dict[str, tuple[str, float]] = {}  # transfer id -> (holder, expiry)
        self._receiving: dict[str, _Receiving] = {}  # request id -> its pull
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (request id, chunks | error)
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # transfer ids (any thread)
        self.offers_expired = 0
        self.pulls_failed = 0

    # -- prefill side ------------------------------------------------------------------

    def request_finished(self, request_id: str, prompt_ids, salt: str | None) -> KvTransferParams:
        """A kv_produce request ends: pins its full prompt pages and offers them.

        Returns:
          the params naming the offer (``num_tokens`` 0: nothing worth sending).
        """
        ps = self.kv.page_size
        n = min((len(prompt_ids) - 1) // ps, self.kv.num_cached_tokens(request_id) // ps)
        tid = new_transfer_id()
        expires = time.time() + self.timeout_s
        params = KvTransferParams(
            transfer_id=tid, transport=self.transport.kind, num_tokens=n * ps, chunk_pages=self.chunk_pages,
            page_shape=self.page_shape, dtype=self.dtype, kv_format=self.kv_format,
            page_hashes=tuple(prompt_page_hashes(prompt_ids[:n * ps], ps, salt, kv_format=self.kv_format)),
            transfer_address=self.transport.address, expires_at=expires)
        if n == 0:
            return params
        holder = f"kv-offer:{tid}"
        pages = self.kv.pin(holder, request_id, n)
        offered = [self.engine.read_pages(c, self.chunk_pages) for c in chunks(pages, self.chunk_pages)]
        self.transport.offer(tid, offered, expires)
        self._offers[tid] = (holder, expires)
        return params

    def release(self, transfer_id: str) -> bool:
        """The decode side has the pages (any thread): they are freed at the loop's next turn.
        Returns whether the offer was known (False: expired or released already)."""
        known = self.transport.offers.get(transfer_id) is not None
        if known:
            self.transport.drop(transfer_id)
            self._released.put(transfer_id)
            self.wake()
        return known

    def _free_offers(self) -> set[str]:
        freed = set()
        while True:
            try:
                tid = self._released.get_nowait()
            except queue.Empty:
                break
            held = self._offers.pop(tid, None)
            if held is not None:
                self.kv.free(held[0])
                freed.add(tid)
        now = time.time()
        for tid, (holder, expires) in list(self._offers.items()):
            if now >= expires:
                log.warning("KV transfer %s was not pulled within %.0f s: its pages are freed", tid,
                            self.timeout_s)
                del self._offers[tid]
                self.transport.drop(tid)
                self.kv.free(holder)
                self.offers_expired += 1
                freed.add(tid)
        return freed

    @property
    def num_offers(self) -> int:
        return len(self._offers)

    # -- decode side -------------------------------------------------------------------

    def check(self, params: KvTransferParams, prompt_ids, salt: str | None) -> str | None:
        """Why these params cannot be pulled into this replica (None: they can)."""
        ps = self.kv.page_size
        if not self.kv.enable_prefix_caching:
            return "this replica's prefix cache is off: received KV pages enter it"
        if params.kv_format != self.kv_format:
            return (f"the prefill replica's KV pages are {params.kv_format or 'unquantized'}, this replica's "
                    f"{self.kv_format or 'unquantized'}: serve both with the same --kv-cache-dtype")
        if tuple(params.page_shape) != self.page_shape or params.dtype != self.dtype:
            return (f"the prefill replica's KV pages are {tuple(params.page_shape)} {params.dtype}, "
                    f"this replica's {self.page_shape} {self.dtype}")
        if params.num_tokens % ps or params.num_tokens > len(prompt_ids) - 1 or params.chunk_pages < 1:
            return f"the offer covers {params.num_tokens} tokens, not whole pages of the prompt"
        if tuple(params.page_hashes) != tuple(prompt_page_hashes(prompt_ids[:params.num_tokens], ps, salt,
                                                                  kv_format=self.kv_format)):
            return "the offered pages are not this prompt's (page hashes differ)"
        return None

    def get_num_new_matched_tokens(self, prompt_ids, salt: str | None, params: KvTransferParams) -> tuple[int, int]:
        """(tokens this replica's prefix cache holds, its host KV tier included, tokens the
        remote side supplies beyond them) for a request's offer."""
        hit = self.kv.lookup_prefix(prompt_ids, salt, params.num_tokens)
        return hit.num_tokens, params.num_tokens - hit.num_tokens

    def receive(self, seq, watermark: int) -> bool:
        """Starts a decode-side request: reserves pages for its offer and pulls what its prefix
        cache lacks. Returns False when no pages can be reserved now (the caller computes
        the prompt itself; the offer is released)."""
        req = seq.req
        params, prompt, salt = req.kv_transfer, list(req.prompt_ids), req.cache_salt
        local, _ = self.get_num_new_matched_tokens(prompt, salt, params)
        hit = self.kv.lookup_prefix(prompt, salt, local)
        holder = f"kv-recv:{req.request_id}"
        if not self.kv.allocate_pages(holder, params.num_tokens, prefix=hit, watermark=watermark, pinned=True):
            self._release_remote(params)
            return False
        self.kv.record_lookup(len(prompt), local)
        seq.sched.cached_tokens = local
        # Host-tier pages are loaded into the reserved pages before the loop's next step.
        seq.sched.host_cached_tokens += len(hit.host_keys) * self.kv.page_size
        rec = self._receiving[req.request_id] = _Receiving(seq, params, holder, time.monotonic())
        self.update_state_after_alloc(rec, local // self.kv.page_size)
        return True

    def update_state_after_alloc(self, rec: _Receiving, num_local_pages: int) -> None:
        """After the reservation: pulls the chunks holding pages past ``num_local_pages``."""
        C = rec.params.chunk_pages
        total = rec.params.num_tokens // self.kv.page_size
        wanted = list(range(num_local_pages // C, -(-total // C))) if num_local_pages < total else []
        rid = rec.seq.req.request_id
        if not wanted:
            self._release_remote(rec.params)
            self._done.put((rid, num_local_pages, [], []))
            return
        threading.Thread(target=self._pull, args=(rid, rec.params, num_local_pages, wanted),
                         name="xlaserve-kv-pull", daemon=True).start()

    def _pull(self, rid: str, params: KvTransferParams, first: int, wanted: list[int]) -> None:
        def alive() -> bool:
            try:
                return self.transport.source_stub(params.source_url).Health(pb.HealthRequest(),
                                                                            timeout=2.0) is not None
            except Exception:  # noqa: BLE001 (any failure to answer is death here)
                return False

        try:
            got = self.transport.pull(params, wanted, params.expires_at, alive)
        except KvTransferError as e:
            self._done.put((rid, first, wanted, str(e)))
        except Exception as e:  # noqa: BLE001 (a transport bug fails this request, not the loop)
            log.exception("KV pull failed")
            self._done.put((rid, first, wanted, f"KV transfer failed: {e}"))
        else:
            self._release_remote(params, wait=True)  # (a worker thread)
            self._done.put((rid, first, wanted, got))
        self.wake()

    def _release_remote(self, params: KvTransferParams, wait: bool = False) -> None:
        """Tells the prefill side its offer is done with (in a thread unless ``wait``: never
        on the loop thread)."""
        def release() -> None:
            try:
                self.transport.source_stub(params.source_url).ReleaseKv(
                    pb.ReleaseKvRequest(transfer_id=params.transfer_id), timeout=5.0)
            except Exception as e:  # noqa: BLE001 (it frees them at its timeout instead)
                log.info("could not release KV transfer %s at %s: %s", params.transfer_id, params.source_url, e)

        if wait:
            release()
        else:
            threading.Thread(target=release, name="xlaserve-kv-release", daemon=True).start()

    def get_finished(self) -> tuple[set[str], list[Received]]:
        """The asynchronous work that ended since the last call (vLLM's done sets).

        Returns:
          (done sending: the offers freed, released or expired, by transfer id;
          done receiving: the pulls that ended, their chunks written into the reserved
          pages and offered to the prefix cache, or failed).
        """
        sent = self._free_offers()
        out: list[Received] = []
        while True:
            try:
                rid, first, wanted, got = self._done.get_nowait()
            except queue.Empty:
                return sent, out
            rec = self._receiving.get(rid)
            if rec is None:
                continue  # cancelled meanwhile (its pages already freed)
            if isinstance(got, str):  # the loop ends it: drop() frees its pages then
                self.pulls_failed += 1
                out.append(Received(rec.seq, error=got))
                continue
            del self._receiving[rid]
            nbytes = self._write(rec, first, wanted, got)
            req = rec.seq.req
            self.kv.cache_pages(rec.holder, list(req.prompt_ids), rec.params.num_tokens, req.cache_salt)
            out.append(Received(rec.seq, nbytes=nbytes, seconds=time.monotonic() - rec.started))

    def _write(self, rec: _Receiving, first: int, wanted: list[int], got) -> int:
        C = rec.params.chunk_pages
        local = self.kv.page_ids(rec.holder)
        nbytes = 0
        for c, chunk in zip(wanted, got):
            ids = [local[i] if first <= i < len(local) else 0 for i in range(c * C, (c + 1) * C)]
            self.engine.write_pages(ids, chunk)
            nbytes += sum(a.nbytes for a in chunk.values())
        return nbytes

    def drop(self, request_id: str) -> bool:
        """A decode-side request ends (any way): frees its reserved pages. Returns whether it
        was still waiting for them."""
        rec = self._receiving.pop(request_id, None)
        self.kv.free(f"kv-recv:{request_id}")
        return rec is not None

    def is_receiving(self, request_id: str) -> bool:
        return request_id in self._receiving

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)
