"""KV-cache pages: who owns which, reference counts and an automatic prefix cache.

Pages are ids into the pool ``[kv_heads, num_pages, page_size, head_dim]``;
page 0 is the null page and is never handed out. The manager owns, per
request id, the request's page list (its page-table row), the chained keys
of its full pages and how many of its leading pages it has offered to the
prefix cache::

    tokens:  | t0 ... t15 | t16 ... t31 | t32 .. t37 |
    pages:   |   page 7   |   page 3    |  page 12   |   (page_size 16)
    keys:    |     h0     |     h1      |            |   2 leading pages offered to the cache
              full, hashed  full, hashed  partial: private to the request

Prefix caching (after vLLM v1's ``KVCacheManager``): a page becomes cacheable
once it is full and computed; its key is a chained hash ``h_i = H(h_{i-1},
tokens of page i, salt)``, so a key names a page's tokens *and everything
before them*. A new request looks up its longest cached prefix
(:meth:`lookup_prefix`, no references taken) and acquires those pages when it
is allocated (:meth:`allocate_pages`). The salt (a tenant id) scopes sharing,
so one tenant cannot probe another's prompts through cache timing. A quantized
KV cache's format ("int8", "fp8") starts the chain (``page_hash``'s ``kv_format``),
so its pages never share a key with another format's (a router's, a host or disk
tier's); unquantized pages hash as they always did.

Forking (``n`` choices of one prompt): :meth:`fork` makes a new request
start from another's computed prefix. The child takes references on the
parent's full pages before the fork point (as a prefix hit does, cached or
not) and gets a fresh page for the partial page the fork point falls in; the
engine copies the parent's partial page into it (a :class:`PageCopy`) before
the child writes there::

    parent:  |   page 7   |   page 3    |  page 12   |      fork at 37 tokens (page_size 16)
    child:   |   page 7   |   page 3    |  page 20   |      7, 3 shared (ref count 2); 12 -> 20 copied

The caller (the scheduler) says what each request needs, in tokens:
:meth:`allocate_pages` (all or nothing), :meth:`fork` (all or nothing),
:meth:`cache_pages` once tokens are computed and their ids known on the host,
:meth:`free` when the request ends or is preempted; it reads a request's
page-table row with :meth:`page_ids`.

Invariants (checked by :meth:`check_invariants`, relied on by the scheduler):
  * every page id 1..num_pages-1 is either in the free queue (ref count 0) or
    held by >= 1 request, never both; page 0 is never held;
  * a page's ref count equals the number of requests whose page list holds it;
  * a cached page (in the hash maps) holds exactly the tokens its key names;
    the two hash maps agree; a request's leading pages that are cached are
    cached under the request's own keys for them;
  * only full pages are cached, and only a request's leading pages offered
    to the cache (full and computed) are shared, by prefix hits or forks, so
    a request only ever writes into pages it holds alone. A forked child's
    shared pages are its parent's offered pages, with the parent's keys (so
    they may be shared without being in the hash maps: caching off, or a
    duplicate kept private); freeing either side leaves the other's intact.
Freed pages keep their cached content and sit in the free queue in LRU order
(least recently freed first); eviction takes from its head only when a page
is needed.

Host tier (``host``: a ``serving.core.kv.host_kv_cache.HostKVCache`` or anything with
``contains(key)``): a cached page evicted for reuse is recorded, with its key,
for the engine to copy to host memory before the page is written again
(:meth:`take_evicted`; the pages of a preempted request stay cached on device
and are recorded when evicted). :meth:`lookup_prefix` continues past the
device hit into keys the host tier holds (``PrefixHit.host_keys``), and
:meth:`allocate_pages` gives those pages fresh device pages, recorded as loads
(:meth:`take_loads`) that the engine must write before the next step runs;
they are cached (in the hash maps) from then on::

    keys:     h0  h1  h2 | h3  h4 | h5 ...
              device hit | host   | computed
    pages:    7   3   9  | 14 15  | 16 ...       loads: (14, h3), (15, h4)
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

from serving.core.kv.kv_events import KvEventJournal


ImageSpans = Sequence[tuple[int, int, str]]
"""A prompt's images as (start, end, digest): positions [start, end) hold the soft tokens of
the image whose pixels hash to ``digest``."""


def page_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None, extra: str = "",
              kv_format: str = "") -> bytes:
    """Chained key of one full page: H(parent key, the page's token ids, salt[, extra]); 16 bytes.
    ``extra``: the digests of the images whose tokens the page holds (:func:`page_extra`);
    a page without image tokens hashes as it always did. ``kv_format``: a quantized KV
    format ("int8", "fp8"), hashed into the first page's key (the root) and so into every
    key of the chain; "" (unquantized pages) hashes as it always did."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or (b"root|kv:" + kv_format.encode() if kv_format else b"root"))
    h.update((salt or "").encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    if extra:
        h.update(b"|img:" + extra.encode())
    return h.digest()


def lora_salt(salt: str | None, adapter_digest: str | None) -> str | None:
    """The prefix-cache salt of a request served through a LoRA adapter: its scope ``salt``
    joined with the adapter's digest (of its weights and config, ``model.lora_adapter``),
    so pages computed with one adapter are never a hit for another, nor for the base model,
    nor for other weights loaded later under the same name. ``salt`` itself without one."""
    if adapter_digest is None:
        return salt
    return f"{salt or ''}\x1flora:{adapter_digest}"


def page_extra(images: ImageSpans, page: int, page_size: int) -> str:
    """The digests of the images with a token in page ``page`` (its positions
    [page * page_size, (page + 1) * page_size)), joined; "" when none. Pages after an
    image inherit it through the chained parent key."""
    lo, hi = page * page_size, (page + 1) * page_size
    return ",".join(d for s, e, d in images if s < hi and e > lo)


def prompt_page_hashes(token_ids: Sequence[int], page_size: int, salt: str | None,
                       images: ImageSpans = (), kv_format: str = "") -> list[bytes]:
    """The chained keys of the full pages of ``token_ids`` (what a router looks up in
    a replica's KV events); ``len(token_ids) // page_size`` of them. ``kv_format``: the
    replica's quantized KV format ("" for unquantized pages; :func:`page_hash`)."""
    keys, key = [], None
    for i in range(len(token_ids) // page_size):
        key = page_hash(key, token_ids[i * page_size:(i + 1) * page_size], salt,
                        page_extra(images, i, page_size), kv_format)
        keys.append(key)
    return keys


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A cached prefix found by :meth:`KVCacheManager.lookup_prefix` (holds no references).

    Attributes:
      page_ids: the cached pages, in order.
      num_tokens: tokens they hold, the host-tier pages included.
      keys: the chained key of each page.
      host_keys: keys of the pages right after ``page_ids`` held in the host tier
        (reloaded, not recomputed); ``num_tokens`` counts them too:
        (len(page_ids) + len(host_keys)) * page_size.
    """

    page_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    keys: tuple[bytes, ...] = ()
    host_keys: tuple[bytes, ...] = ()


NO_HIT = PrefixHit()


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """A page the engine must copy (every layer's K and V) before the step writes.

    Attributes:
      src: the page read (a parent's partial page).
      dst: the page written (the forked child's fresh page; the child holds it alone).
    """

    src: int
    dst: int


@dataclasses.dataclass
class _Held:
    """One request's pages: the page-table row, its full pages' keys, pages offered to the cache."""

    pages: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    pinned: bool = False  # a holder that is not a request (a KV transfer's pages)


class KVCacheManager:
    """Host-side page ownership and prefix cache (no JAX). Requests are named by id.

    Args:
      num_pages: pool size including the null page 0 (>= 2).
      page_size: tokens per page.
      enable_prefix_caching: when False, pages are plain allocations (lookups
        find nothing, nothing is hashed).
      events: publishes every page hash added to or evicted from the prefix
        cache (``serving.core.kv.kv_events``, for routers); None: nothing is published.
      host: the host tier under the prefix cache (anything with ``contains(key) ->
        bool``; see the module docstring); None: evicted pages are dropped.
      kv_format: the device cache's quantized KV format ("int8", "fp8"; "" unquantized),
        part of every page's key (:func:`page_hash`).

    Raises:
      ValueError: num_pages < 2 or page_size < 1.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 events: KvEventJournal | None = None, host=None, kv_format: str = ""):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_format = kv_format
        self.events = events
        self.host = host if enable_prefix_caching else None
        self._to_save: dict[bytes, int] = {}  # key -> evicted page, to copy to the host tier
        self._loads: list[tuple[int, bytes]] = []  # (fresh page, key) to write from the host tier
        self._ref_count = [0] * num_pages
        # Free pages, least recently freed first (OrderedDict as an LRU queue).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages))
        self._hash_of: dict[int, bytes] = {}  # page -> key, for cached pages
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._held: dict[str, _Held] = {}  # request id -> its pages (only requests holding some)
        self.hits = 0  # prompt tokens served from the cache (lifetime)
        self.queries = 0  # prompt tokens looked up (lifetime)

    # -- queries ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable pages (1..num_pages-1) held by requests, in [0, 1]."""
        return 1.0 - len(self._free) / (self.num_pages - 1)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens (ceil(num_tokens / page_size))."""
        return -(-num_tokens // self.page_size)

    def page_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's pages in order (its page-table row); () if it holds none."""
        held = self._held.get(request_id)
        return tuple(held.pages) if held else ()

    def num_cached_tokens(self, request_id: str) -> int:
        """Tokens in the request's leading pages already offered to the prefix cache
        (a multiple of page_size; 0 if it holds no pages)."""
        held = self._held.get(request_id)
        return held.num_cached * self.page_size if held else 0

    def request_ids(self) -> list[str]:
        """Ids of the requests holding pages (pinned holders not included)."""
        return [rid for rid, held in self._held.items() if not held.pinned]

    def pinned_ids(self) -> list[str]:
        """Ids of the pinned holders (:meth:`pin`, :meth:`allocate_pages` with ``pinned``)."""
        return [rid for rid, held in self._held.items() if held.pinned]

    def lookup_prefix(self, token_ids: Sequence[int], salt: str | None, max_tokens: int,
                      images: ImageSpans = ()) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` in whole pages, at most ``max_tokens`` long
        (``images``: the prompt's images, hashed into the pages that hold their tokens).

        With a host tier, the prefix continues past the device pages with the pages
        the host tier holds (``host_keys``), up to the first page in neither tier.
        Takes no references: pass the hit to :meth:`allocate_pages` (before
        anything else allocates) to hold its pages.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        ps = self.page_size
        pages, keys, host_keys, key = [], [], [], None
        for i in range(min(max_tokens, len(token_ids)) // ps):
            key = page_hash(key, token_ids[i * ps:(i + 1) * ps], salt, page_extra(images, i, ps), self.kv_format)
            page = None if host_keys else self._page_of.get(key)
            if page is not None:
                pages.append(page)
                keys.append(key)
            elif self.host is not None and self.host.contains(key):
                host_keys.append(key)
            else:
                break
        if not pages and not host_keys:
            return NO_HIT
        return PrefixHit(tuple(pages), (len(pages) + len(host_keys)) * ps, tuple(keys), tuple(host_keys))

    def cached_pages(self) -> list[tuple[int, bytes]]:
        """(page id, key) of every page in the device prefix cache now (held or free)."""
        return list(self._hash_of.items())

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """(page id, key) of the cached pages evicted since the last call whose key the host
        tier lacks, in eviction order; the caller copies them out before anything writes
        those pages (they were handed out again). Empty without a host tier."""
        out = [(p, key) for key, p in self._to_save.items()]
        self._to_save.clear()
        return out

    def take_loads(self) -> list[tuple[int, bytes]]:
        """(page id, key) of the fresh pages given to host-tier hits since the last call: the
        caller writes each key's host copy into its page before the next step runs."""
        out, self._loads = self._loads, []
        return out

    # -- ownership ---------------------------------------------------------------

    def allocate_pages(self, request_id: str, num_tokens: int, prefix: PrefixHit = NO_HIT,
                       watermark: int = 0, pinned: bool = False) -> bool:
        """Makes the request hold pages covering its first ``num_tokens`` tokens, or takes nothing.

        A request holding no pages may start from a prefix hit: it then holds
        the hit's pages first (the ones nobody holds leave the free queue) and
        gets fresh pages for the rest. Fresh pages evict the least recently
        freed cached pages.

        Args:
          request_id: the request.
          num_tokens: tokens its pages must cover (pages already held count).
          prefix: a hit from :meth:`lookup_prefix` for this request's tokens.
          watermark: free pages that must remain after the allocation.
          pinned: a new holder is not a request but pages kept for a KV transfer
            (:meth:`pinned_ids`; the decode side's pages being received).

        Returns:
          True if the request now holds enough pages; False if that would
          leave fewer than ``watermark`` pages free (nothing was taken).

        Raises:
          ValueError: a prefix for a request that already holds pages, or a
            stale prefix (one of its pages was evicted since the lookup).
        """
        held = self._held.get(request_id)
        if prefix.page_ids or prefix.host_keys:
            if held is not None:
                raise ValueError(f"request {request_id!r} already holds pages; a prefix hit is for a new request")
            for p, key in zip(prefix.page_ids, prefix.keys):
                if self._hash_of.get(p) != key:
                    raise ValueError(f"stale prefix hit: page {p} no longer holds its key")
            if prefix.host_keys and (self.host is None or not all(map(self.host.contains, prefix.host_keys))):
                raise ValueError("stale prefix hit: the host tier no longer holds its pages")
        loads = len(prefix.host_keys) if held is None else 0
        num_held = len(held.pages) if held else len(prefix.page_ids)
        need = max(0, self.pages_for(num_tokens) - num_held - loads) + loads  # loads: fresh pages too
        # Hit pages that nobody holds sit in the free queue: holding them uses it up too.
        reclaimed = sum(1 for p in prefix.page_ids if self._ref_count[p] == 0)
        if need + reclaimed + watermark > len(self._free):
            return False
        if held is None:
            if need == 0 and not prefix.page_ids:
                return True
            held = self._held[request_id] = _Held(keys=list(prefix.keys) + list(prefix.host_keys),
                                                  num_cached=len(prefix.page_ids) + loads, pinned=pinned)
            for p in prefix.page_ids:
                if self._ref_count[p] == 0:
                    del self._free[p]
                self._ref_count[p] += 1
                held.pages.append(p)
        evicted, stored = [], []
        for i in range(need):
            p, _ = self._free.popitem(last=False)
            key = self._hash_of.pop(p, None)
            if key is not None:
                del self._page_of[key]
                evicted.append(key)
                if self.host is not None and not self.host.contains(key):
                    self._to_save[key] = p
            self._ref_count[p] = 1
            held.pages.append(p)
            if i < loads:  # a host-tier page: loaded into p, cached from now on
                key = prefix.host_keys[i]
                self._loads.append((p, key))
                if key not in self._page_of:  # (else a duplicate: private to this request)
                    self._page_of[key] = p
                    self._hash_of[p] = key
                    stored.append(key)
        if self.events is not None and (evicted or stored):
            self.events.publish(stored=stored, removed=evicted)
        return True

    def fork(self, request_id: str, parent_id: str, num_computed: int, num_tokens: int,
             watermark: int = 0) -> tuple[PageCopy, ...] | None:
        """Starts a new request from the parent's first ``num_computed`` computed tokens.

        The child holds the parent's first ``num_computed // page_size`` pages
        (references, as a prefix hit takes; with the parent's keys for them)
        and fresh pages covering the rest of its first ``num_tokens`` tokens.
        When ``num_computed`` ends inside a page, the parent's page there is
        to be copied into the child's first fresh page: the returned copy
        must run on device before anything writes the child's pages (the
        child then writes its tokens from ``num_computed`` on over the copy;
        what the copy brings beyond them is overwritten before it is read).

        Args:
          request_id: the child (holds no pages yet).
          parent_id: the request whose K/V the child takes over (holds pages;
            its first ``num_computed`` tokens computed, its full pages among them
            offered to the cache).
          num_computed: tokens taken over, 0 .. the tokens of the parent's pages.
          num_tokens: tokens the child's pages must cover (> num_computed).
          watermark: free pages that must remain after the fresh pages are taken.

        Returns:
          the page copies for the engine (empty when ``num_computed`` ends on a
          page boundary), or None if the fresh pages would leave fewer than
          ``watermark`` free (nothing was taken).

        Raises:
          ValueError: the child already holds pages, the parent holds too
            few (or has not offered the shared pages), or num_tokens <= num_computed.
        """
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds pages; a fork is for a new request")
        parent = self._held.get(parent_id)
        shared = num_computed // self.page_size
        if parent is None or parent.num_cached < shared or len(parent.pages) < self.pages_for(num_computed):
            raise ValueError(f"parent {parent_id!r} does not hold {num_computed} computed tokens "
                             f"in offered pages")
        if num_tokens <= num_computed:
            raise ValueError(f"num_tokens ({num_tokens}) must exceed num_computed ({num_computed})")
        need = self.pages_for(num_tokens) - shared
        if need + watermark > len(self._free):
            return None
        held = self._held[request_id] = _Held(
            keys=parent.keys[:shared] if self.enable_prefix_caching else [], num_cached=shared)
        for p in parent.pages[:shared]:
            self._ref_count[p] += 1  # held by the parent: not in the free queue
            held.pages.append(p)
        self.allocate_pages(request_id, num_tokens)  # the fresh pages (fits: checked above)
        if num_computed % self.page_size == 0:
            return ()
        return (PageCopy(parent.pages[shared], held.pages[shared]),)

    def pin(self, holder_id: str, request_id: str, num_pages: int) -> tuple[int, ...]:
        """Makes ``holder_id`` (a pinned holder) hold the request's first ``num_pages`` offered
        pages too, so they outlive the request: the prefill side of a KV transfer keeps a
        finished prompt's pages until the decode side has them. :meth:`free` the holder.

        Returns:
          the pinned page ids, in order.

        Raises:
          ValueError: the holder exists, or the request has offered fewer pages to the cache.
        """
        if holder_id in self._held:
            raise ValueError(f"holder {holder_id!r} already holds pages")
        held = self._held.get(request_id)
        if num_pages <= 0:
            return ()
        if held is None or held.num_cached < num_pages:
            raise ValueError(f"request {request_id!r} has not offered {num_pages} computed pages")
        pin = self._held[holder_id] = _Held(pages=held.pages[:num_pages], keys=held.keys[:num_pages],
                                            num_cached=num_pages, pinned=True)
        if not self.enable_prefix_caching:
            pin.keys = []
        for p in pin.pages:
            self._ref_count[p] += 1
        return tuple(pin.pages)

    def free(self, request_id: str) -> None:
        """Drops the request's pages; pages nobody holds any more join the free queue's tail.

        Pages are released last-first, so a request's tail (least likely to be
        shared again) is evicted before its prefix. Cached pages keep their
        content until evicted. A request holding no pages is a no-op.
        """
        held = self._held.pop(request_id, None)
        if held is None:
            return
        for p in reversed(held.pages):
            if self._ref_count[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self._ref_count[p] -= 1
            if self._ref_count[p] == 0:
                self._free[p] = None

    def cache_pages(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                    salt: str | None, images: ImageSpans = ()) -> None:
        """Offers the request's full pages among its first ``num_tokens`` tokens to the prefix cache.

        Extends the request's chained keys from the last one it stored, so
        each page is hashed once. A key already cached under another page
        keeps that page (the duplicate stays private to this request).

        Args:
          request_id: the request.
          token_ids: its token ids known on the host (at least its first
            full pages; tokens beyond ``len(token_ids)`` are not cached).
          num_tokens: tokens whose K/V are computed (written by a dispatched step).
          salt: its prefix-cache scope (the one it was looked up with).
          images: its prompt's images (as it was looked up with).

        Raises:
          ValueError: the request holds fewer pages than ``num_tokens`` needs.
        """
        full = min(num_tokens, len(token_ids)) // self.page_size
        held = self._held.get(request_id)
        done = held.num_cached if held else 0
        if full <= done:
            return
        if held is None or full > len(held.pages):
            raise ValueError(f"request {request_id!r} holds {len(held.pages) if held else 0} pages, "
                             f"fewer than {full} full pages")
        held.num_cached = full
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        key = held.keys[-1] if held.keys else None
        stored = []
        for i in range(len(held.keys), full):
            key = page_hash(key, token_ids[i * ps:(i + 1) * ps], salt, page_extra(images, i, ps), self.kv_format)
            held.keys.append(key)
            p = held.pages[i]
            if key in self._page_of or p in self._hash_of:
                continue
            self._page_of[key] = p
            self._hash_of[p] = key
            stored.append(key)
        if stored and self.events is not None:
            self.events.publish(stored=stored)

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Adds one admission's prompt tokens and cache-served tokens to ``queries`` and ``hits``."""
        self.queries += prompt_tokens
        self.hits += hit_tokens

    # -- checking ----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Asserts the module's invariants against the manager's own per-request tables.

        Raises:
          AssertionError: describing the first violation.
        """
        counts = collections.Counter(p for held in self._held.values() for p in held.pages)
        assert 0 not in counts, "the null page 0 is held"
        for p in range(1, self.num_pages):
            assert self._ref_count[p] == counts.get(p, 0), (
                f"page {p}: ref count {self._ref_count[p]}, held by {counts.get(p, 0)}")
            assert (p in self._free) == (self._ref_count[p] == 0), (
                f"page {p}: free={p in self._free} but ref count {self._ref_count[p]}")
        assert all(0 < p < self.num_pages for p in self._free), "the free queue holds a page id out of range"
        assert len(self._page_of) == len(self._hash_of), "hash maps differ in size"
        if self.events is not None:
            assert self.events.cached() == set(self._page_of), "published page hashes differ from the cache"
        for key, p in self._page_of.items():
            assert self._hash_of.get(p) == key, f"page {p}: hash maps disagree"
        for rid, held in self._held.items():
            assert held.pages, f"request {rid!r}: an entry without pages"
            assert len(set(held.pages)) == len(held.pages), f"request {rid!r} holds a page twice"
            assert held.num_cached <= len(held.pages), f"request {rid!r}: more cached than held pages"
            assert len(held.keys) == (held.num_cached if self.enable_prefix_caching else 0), (
                f"request {rid!r}: {len(held.keys)} keys for {held.num_cached} cached pages")
            for p, key in zip(held.pages, held.keys):
                assert self._hash_of.get(p, key) == key, f"request {rid!r}: page {p} cached under another key"
            for p in held.pages[held.num_cached:]:
                assert counts[p] == 1, f"request {rid!r}: uncached page {p} is shared"
