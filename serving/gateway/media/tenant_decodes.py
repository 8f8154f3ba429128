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
  its lane always gets one image in, however large.

Tenants are the keys' tenants (``Principal.tenant``); unauthenticated callers share one lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator

from serving.gateway.http.errors import OpenAIError

DEFAULT_TENANT_DECODES = 1
"""Decodes one tenant runs at once by default: one decode thread (of ``DEFAULT_DECODE_THREADS``)."""

IMAGE_DECODES_QUEUED = "image_decodes_queued"
"""The 429's ``code`` when a tenant's lane is full."""


@dataclasses.dataclass
class _Lane:
    running: asyncio.Semaphore
    pixels: int = 0  # waiting or decoding


class TenantDecodeLanes:
    """Per-tenant decode concurrency and queued pixels (see the module docstring; asyncio,
    one event loop).

    Args:
      per_tenant: decodes one tenant runs at once (>= 1).
      max_tenant_pixels: pixels (width x height) one tenant may have waiting or decoding (>= 1).

    Raises:
      ValueError: either below 1.
    """

    def __init__(self, per_tenant: int = DEFAULT_TENANT_DECODES, *, max_tenant_pixels: int) -> None:
        if per_tenant < 1 or max_tenant_pixels < 1:
            raise ValueError(f"per-tenant decodes and pixels must be >= 1, got {per_tenant} and {max_tenant_pixels}")
        self.per_tenant = int(per_tenant)
        self.max_tenant_pixels = int(max_tenant_pixels)
        self._lanes: dict[str, _Lane] = {}

    def pixels(self, tenant: str) -> int:
        """Pixels `tenant` has waiting or decoding now."""
        lane = self._lanes.get(tenant)
        return 0 if lane is None else lane.pixels

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, pixels: int, param: str = "messages") -> AsyncIterator[None]:
        """Waits for a place in `tenant`'s lane and holds it for the body of the ``async with``
        (the image's decode); `pixels` count against the tenant's bound from the call on.

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
                yield
        finally:
            lane.pixels -= n
            if lane.pixels == 0:
                del self._lanes[tenant]
