"""A bound on decoded image pixels in flight, shared by every request of one gateway.

Decoding an image takes memory in proportion to its pixels (3-4 bytes each, before
preprocessing), whatever its encoded size: a single-colour 40-megapixel PNG is a few hundred
kilobytes of base64 and 120 MB decoded. :class:`PixelBudget` is a weighted semaphore over
pixels: a decode takes its image's width x height (read from the header) before it starts and
gives it back when its preprocessed pixels are made, so at most ``capacity`` pixels are decoded
at once and the rest wait, in arrival order, on the event loop (costing nothing meanwhile).
An image larger than the whole budget waits until it is alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import AsyncIterator


class PixelBudget:
    """A weighted semaphore of `capacity` pixels (asyncio; one event loop).

    Raises:
      ValueError: `capacity` below 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the pixel budget must be at least 1 pixel, got {capacity}")
        self.capacity = int(capacity)
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, pixels: int) -> AsyncIterator[None]:
        """Holds `pixels` (at most the capacity) of the budget for the body of the ``async with``."""
        n = min(max(int(pixels), 1), self.capacity)
        if self._waiters or self.in_use + n > self.capacity:
            fut = asyncio.get_running_loop().create_future()
            entry = (n, fut)
            self._waiters.append(entry)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                    self._release(n)
                else:
                    self._waiters.remove(entry)
                    self._wake()
                raise
        else:
            self.in_use += n
        try:
            yield
        finally:
            self._release(n)

    def _release(self, n: int) -> None:
        self.in_use -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.in_use += n
            fut.set_result(None)
