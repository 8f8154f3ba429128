"""KV-cache pages with reference counts and an automatic prefix cache.

Pages are ids into the pool ``[kv_heads, num_pages, page_size, head_dim]``;
page 0 is the null page and is never handed out. A sequence's pages, in
order, form its page-table row::

    tokens:  | t0 ... t15 | t16 ... t31 | t32 .. t37 |
    pages:   |   page 7   |   page 3    |  page 12   |   (page_size 16)
              full, hashed  full, hashed  partial: private to the sequence

Prefix caching (after vLLM v1's ``KVCacheManager``): a page becomes cacheable
once it is full; its key is a chained hash ``h_i = H(h_{i-1}, tokens of page i,
salt)``, so a key names a page's tokens *and everything before them*. A new
sequence walks its prompt page by page and reuses every cached page of its
longest cached prefix. The salt (a tenant id) scopes sharing, so one tenant
cannot probe another's prompts through cache timing.

Invariants (checked by :meth:`check_invariants`, relied on by the scheduler):
  * every page id 1..num_pages-1 is either in the free queue (ref count 0) or
    referenced by >= 1 sequence, never both;
  * a page's ref count equals the number of sequences whose page list holds it;
  * a cached page (in the hash map) holds exactly the tokens its key names;
    only full pages are cached, and only full pages are shared, so a sequence
    only ever writes into pages it owns alone.
Freed pages keep their cached content and sit in the free queue in LRU order
(least recently freed first); eviction takes from its head only when a page
is needed.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence


class OutOfPagesError(RuntimeError):
    """Raised when more pages are asked for than are free or evictable."""


def page_hash(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """Chained key of one full page: H(parent key, the page's token ids, salt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update((salt or "").encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


class KVCacheManager:
    """Host-side page accounting and prefix cache (no JAX).

    Args:
      num_pages: pool size including the null page 0.
      page_size: tokens per page.
      enable_prefix_caching: when False, pages are plain allocations.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        # Free pages, least recently freed first (OrderedDict as an LRU queue).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (p, None) for p in range(1, num_pages))
        self._hash_of: dict[int, bytes] = {}  # page -> key, for cached pages
        self._page_of: dict[bytes, int] = {}  # key -> page
        self.hits = 0  # tokens served from the cache (lifetime)
        self.queries = 0  # prompt tokens looked up (lifetime)

    # -- queries ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free, cached or not)."""
        return len(self._free)

    def page_keys(self, tokens: Sequence[int], salt: str | None, parent: bytes | None = None,
                  start_page: int = 0) -> list[bytes]:
        """Keys of the full pages of ``tokens`` from page ``start_page`` on."""
        keys = []
        ps = self.page_size
        for i in range(start_page, len(tokens) // ps):
            parent = page_hash(parent, tokens[i * ps:(i + 1) * ps], salt)
            keys.append(parent)
        return keys

    def lookup_prefix(self, tokens: Sequence[int], salt: str | None, max_tokens: int) -> list[int]:
        """Cached pages of the longest cached prefix of ``tokens``, at most ``max_tokens`` long.

        Takes no references (call :meth:`acquire` to own them).
        """
        if not self.enable_prefix_caching:
            return []
        pages = []
        for key in self.page_keys(tokens[:max_tokens - max_tokens % self.page_size], salt):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    # -- ownership ---------------------------------------------------------------

    def acquire(self, pages: Sequence[int]) -> None:
        """Takes a reference on (cached) pages; pages with ref count 0 leave the free queue."""
        for p in pages:
            if self.ref_count[p] == 0:
                del self._free[p]
            self.ref_count[p] += 1

    def allocate(self, n: int) -> list[int]:
        """Takes n fresh pages (evicting least recently freed cached pages as needed).

        Raises:
          OutOfPagesError: fewer than n pages are free (nothing is taken).
        """
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            key = self._hash_of.pop(p, None)
            if key is not None:
                del self._page_of[key]
            self.ref_count[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference on each page; pages reaching 0 join the free queue's tail.

        Pages are released last-first, so a sequence's tail (least likely to be
        shared again) is evicted before its prefix.
        """
        for p in reversed(pages):
            if self.ref_count[p] <= 0:
                raise RuntimeError(f"page {p} released more often than acquired")
            self.ref_count[p] -= 1
            if self.ref_count[p] == 0:
                self._free[p] = None

    def cache_pages(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Registers full pages under their keys (pages[i] holds the page named keys[i]).

        A key already cached under another page keeps the existing page (the
        duplicate stays private to its owner and is never shared).
        """
        if not self.enable_prefix_caching:
            return
        for p, key in zip(pages, keys):
            if key in self._page_of or p in self._hash_of:
                continue
            self._page_of[key] = p
            self._hash_of[p] = key

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens

    # -- checking ----------------------------------------------------------------

    def check_invariants(self, owners: Sequence[Sequence[int]]) -> None:
        """Asserts the module's invariants given every live sequence's page list.

        Raises:
          AssertionError: describing the first violation.
        """
        counts = collections.Counter(p for pages in owners for p in pages)
        assert 0 not in counts, "the null page 0 is owned"
        for p in range(1, self.num_pages):
            assert self.ref_count[p] == counts.get(p, 0), (
                f"page {p}: ref count {self.ref_count[p]}, owned by {counts.get(p, 0)}")
            assert (p in self._free) == (self.ref_count[p] == 0), (
                f"page {p}: free={p in self._free} but ref count {self.ref_count[p]}")
        for key, p in self._page_of.items():
            assert self._hash_of.get(p) == key, f"page {p}: hash maps disagree"
