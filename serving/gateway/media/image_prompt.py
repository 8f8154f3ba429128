"""A chat prompt's images: loaded and preprocessed, and their soft-token placeholders laid out.

The chat template renders each image part as the model's start-of-image token (Gemma 3's
templates emit ``<start_of_image>`` for a ``{"type": "image"}`` content item; the markup is
encoded with control ids, user text never is, so only the template can place one). Each such
id then becomes what transformers' ``Gemma3Processor`` makes of it::

    <start_of_image>  ->  "\\n\\n" <start_of_image> <image_soft_token> x N <end_of_image> "\\n\\n"

(N = ``mm_tokens_per_image``; the processor expands the text before tokenizing, we expand the
ids with ``encode("\\n\\n")`` on each side, which can differ from it only in how those newlines
merge with newlines around them). The soft tokens' positions are where the engine splices the
image's encoder output (``serving.contract.engine_client.ImageInput``).
"""

from __future__ import annotations

import contextlib
from typing import AsyncContextManager, Awaitable, Callable, Sequence

from serving.contract.engine_client import ImageInput, VisionSpec
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import MediaLimits
from serving.gateway.media import image_input
from serving.gateway.media.image_input import image_bytes
from serving.gateway.media.image_processing import pixel_digest, preprocess
from serving.gateway.media.pixel_budget import PixelBudget

__all__ = ["expand_image_placeholders", "load_images", "prompt_images"]


async def load_images(parts: Sequence[tuple[str, str]], spec: VisionSpec, limits: MediaLimits,
                      run: Callable[..., Awaitable], client=None, budget: PixelBudget | None = None,
                      lane: Callable[[int, str], AsyncContextManager] | None = None) -> list[tuple[object, str]]:
    """(pixels [3, S, S] float32, digest) of each ``(param, url)`` image part, in order.

    Nothing but waiting runs on the event loop: base64 decoding, the header check, decoding,
    preprocessing and the digest run through ``run`` (the gateway's bounded worker threads).
    Each decode first takes a place in the caller's tenant's lane (``lane(pixels, param)``:
    ``TenantDecodeLanes.hold`` bound to the tenant; None: no lane), then holds its image's
    pixels of ``budget`` (None: unbounded).

    Raises:
      OpenAIError: 400 naming the part (``serving.gateway.media.image_input``); 429 from
        ``lane`` when the tenant has too many pixels in flight (``tenant_decodes.py``).
    """
    out = []
    for param, url in parts:
        data, media_type = await image_bytes(url, limits, param, client, run)
        pixels = await run(image_input.image_pixels, data, media_type, limits, param)
        async with contextlib.AsyncExitStack() as held:
            if lane is not None:
                await held.enter_async_context(lane(pixels, param))
            if budget is not None:
                await held.enter_async_context(budget.hold(pixels))
            out.append(await run(_decoded, data, media_type, limits, param, spec.image_size))
    return out


def _decoded(data: bytes, media_type: str | None, limits: MediaLimits, param: str, size: int
             ) -> tuple[object, str]:
    """(pixels, digest) of one image (blocking: a worker thread's)."""
    image = image_input.decode_image(data, media_type, limits, param)
    try:
        pixels = preprocess(image, size)
    finally:
        image.close()
    return pixels, pixel_digest(pixels)


def expand_image_placeholders(ids: Sequence[int], spec: VisionSpec, newline_ids: Sequence[int],
                              num_images: int) -> tuple[list[int], list[int]]:
    """(the ids with each start-of-image id expanded, the position of each image's first soft
    token), in prompt order.

    Raises:
      OpenAIError: 400 when the rendered prompt holds another number of start-of-image ids
        than there are images (a chat template that does not place image parts).
    """
    found = sum(1 for t in ids if t == spec.boi_token_id)
    if found != num_images:
        raise OpenAIError(f"The chat template placed {found} images for the {num_images} image parts "
                          "(this model's template does not take image content).", param="messages",
                          code="images_not_supported")
    out: list[int] = []
    starts: list[int] = []
    for t in ids:
        if t != spec.boi_token_id:
            out.append(t)
            continue
        out += newline_ids
        out.append(spec.boi_token_id)
        starts.append(len(out))
        out += [spec.image_token_id] * spec.tokens_per_image
        out.append(spec.eoi_token_id)
        out += newline_ids
    return out, starts


def prompt_images(starts: Sequence[int], loaded: Sequence[tuple[object, str]], spec: VisionSpec
                  ) -> tuple[ImageInput, ...]:
    """The engine's ``ImageInput`` of each image (``starts`` from :func:`expand_image_placeholders`)."""
    return tuple(ImageInput(s, spec.tokens_per_image, digest, pixels)
                 for s, (pixels, digest) in zip(starts, loaded))
