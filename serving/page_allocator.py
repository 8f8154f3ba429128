"""Host-side allocator of KV-cache pages.

Pages are ids into the page pool ``[kv_heads, num_pages, page_size, head_dim]``.
Page 0 is reserved as the null page (padding writes land there, padding page
table entries point there) and is never handed out.

Invariant: every page in 1..num_pages-1 is either free or owned by exactly one
sequence; ``free + owned == num_pages - 1`` at all times.
"""

from __future__ import annotations

import collections


class OutOfPagesError(RuntimeError):
    """Raised when more pages are asked for than are free."""


class PageAllocator:
    def __init__(self, num_pages: int):
        """Args: num_pages: pool size including the null page (>= 2)."""
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free = collections.deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes n pages. Raises OutOfPagesError if fewer than n are free (nothing is taken)."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        """Returns pages to the pool (most recently freed are reused last)."""
        self._free.extend(pages)
