"""Each tenant's image decodes in a lane of its own: one tenant's images wait behind its own.

The decode threads (``decode_workers.py``) and the pixel budget (``pixel_budget.py``) bound
the gateway's image work as a whole; alone, they let one tenant hold all of it: a tenant
sending image bombs (40-megapixel single-colour PNGs, a few hundred kilobytes each) keeps
every decode thread busy, so every other tenant's images queue behind its bombs, and on a
machine of few cores its decodes take as many cores as there are threads from the engine and
the event loop. :class:`TenantDecodeLanes` puts a per-tenant bound in front of both:

* a tenant's images decode at most ``per_tenant`` at a time (the rest wait, in arrival order,
  on the event loop, holding neither a thread nor any of the pixel budget), so its share of
  the decode threads, and of the cores, is ``per_tenant`` threads whatever it sends;
* a tenant's pixels waiting or decoding are bounded by ``max_tenant_pixels``: an image that
  would pass it is refused at once with 429 (``image_decodes_queued``) rather than queued
  (memory for its encoded bytes, and a client told to back off). A tenant with nothing in
  its lane always gets one image in, however large;
* a tenant's decoded pixels per second are bounded by ``pixel_rate`` (a token bucket of
  ``pixel_burst`` pixels, refilled at ``pixel_rate`` a second, charged each image's width x
  height before its decode; an image the bucket cannot pay waits in the lane, on the event
  loop, until it can). Decoding costs CPU in proportion to pixels (about 14 ns a pixel for a
  PNG, decode and resize, on one Sapphire Rapids core), so this bounds the share of the cores
  a tenant's images take over time, which the concurrency bound alone does not: one thread
  decoding bombs back to back is a whole core, taken from the engine and the event loop on a
  machine of few cores (benchmarks/hostile_tenant.py). A tenant's bucket outlives its lane,
  so waiting for the lane to empty buys no new burst.

Tenants are the keys' tenants (``Principal.tenant``); unauthenticated callers share one lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator, Awaitable, Callable

from serving.gateway.http.errors import OpenAIError

DEFAULT_TENANT_DECODES = 1
"""Decodes one tenant runs at once by default: one decode thread (of ``DEFAULT_DECODE_THREADS``)."""

IMAGE_DECODES_QUEUED = "image_decodes_queued"
"""The 429's ``code`` when a tenant's lane is full."""


@dataclasses.dataclass
class _Lane:
    running: asyncio.Semaphore
    pixels: int = 0  # waiting or decoding


@dataclasses.dataclass
class _Bucket:
    tokens: float  # pixels; below zero while decodes that were charged wait for their turn
    at: float  # the clock's seconds when `tokens` was last brought up to date


class TenantDecodeLanes:
    """Per-tenant decode concurrency and queued pixels (see the module docstring; asyncio,
    one event loop).

    Args:
      per_tenant: decodes one tenant runs at once (>= 1).
      max_tenant_pixels: pixels (width x height) one tenant may have waiting or decoding (>= 1).
      pixel_rate: pixels a second one tenant's images may decode (> 0; None: no bound; the
        gateway's default, ``MediaLimits.tenant_image_pixel_rate``, is 20 M: about a quarter
        of a core).
      pixel_burst: the bucket's size in pixels (>= 1): what a tenant that sent nothing for a
        while may decode at once.
      clock: seconds, monotonic (tests pass their own).
      sleep: ``await sleep(seconds)`` (tests pass their own).

    Raises:
      ValueError: a bound out of its range.
    """

    def __init__(self, per_tenant: int = DEFAULT_TENANT_DECODES, *, max_tenant_pixels: int,
                 pixel_rate: float | None = None, pixel_burst: int = 1,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if per_tenant < 1 or max_tenant_pixels < 1 or pixel_burst < 1:
            raise ValueError(f"per-tenant decodes, pixels and pixel burst must be >= 1, got {per_tenant}, "
                             f"{max_tenant_pixels} and {pixel_burst}")
        if pixel_rate is not None and not pixel_rate > 0:
            raise ValueError(f"the per-tenant pixel rate must be > 0 pixels a second, got {pixel_rate!r}")
        self.per_tenant = int(per_tenant)
        self.max_tenant_pixels = int(max_tenant_pixels)
        self.pixel_rate = None if pixel_rate is None else float(pixel_rate)
        self.pixel_burst = int(pixel_burst)
        self._clock, self._sleep = clock, sleep
        self._lanes: dict[str, _Lane] = {}
        self._buckets: dict[str, _Bucket] = {}

    def pixels(self, tenant: str) -> int:
        """Pixels `tenant` has waiting or decoding now."""
        lane = self._lanes.get(tenant)
        return 0 if lane is None else lane.pixels

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, pixels: int, param: str = "messages") -> AsyncIterator[None]:
        """Waits for a place in `tenant`'s lane, then for its bucket to pay for `pixels` (at
        ``pixel_rate``), and holds the place for the body of the ``async with`` (the image's
        decode); `pixels` count against the tenant's ``max_tenant_pixels`` from the call on.

        Raises:
          OpenAIError: 429 (``image_decodes_queued``, naming `param`) when the tenant's pixels
            waiting or decoding would pass ``max_tenant_pixels``; nothing is held then.
        """
        n = max(int(pixels), 1)
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = _Lane(asyncio.Semaphore(self.per_tenant))
        elif lane.pixels and lane.pixels + n > self.max_tenant_pixels:
            raise OpenAIError(
                f"{param}: this tenant already has {lane.pixels} image pixels waiting or decoding; with this "
                f"image's {n} that would pass the {self.max_tenant_pixels} a tenant may have in flight. "
                "Retry when earlier image requests have finished.",
                status_code=429, type="images", param=param, code=IMAGE_DECODES_QUEUED, headers={"Retry-After": "1"})
        lane.pixels += n
        try:
            async with lane.running:
                wait = self._charge(tenant, n)
                if wait > 0:
                    try:
                        await self._sleep(wait)
                    except BaseException:  # gone before its decode: the pixels go back
                        self._buckets[tenant].tokens += n
                        raise
                yield
        finally:
            lane.pixels -= n
            if lane.pixels == 0:
                del self._lanes[tenant]

    def _charge(self, tenant: str, n: int) -> float:
        """Takes `n` pixels from `tenant`'s bucket; the seconds until the bucket has paid for them."""
        if self.pixel_rate is None:
            return 0.0
        now = self._clock()
        if len(self._buckets) > 4096:  # forget the tenants whose buckets have refilled
            self._buckets = {t: b for t, b in self._buckets.items()
                             if b.tokens + (now - b.at) * self.pixel_rate < self.pixel_burst}
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.pixel_burst), now)
        bucket.tokens = min(float(self.pixel_burst), bucket.tokens + (now - bucket.at) * self.pixel_rate) - n
        bucket.at = now
        return max(0.0, -bucket.tokens / self.pixel_rate)
