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

from typing import Awaitable, Callable, Sequence

from serving.contract.engine_client import ImageInput, VisionSpec
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import MediaLimits
from serving.gateway.media.image_input import load_image
from serving.gateway.media.image_processing import pixel_digest, preprocess

__all__ = ["expand_image_placeholders", "load_images", "prompt_images"]


async def load_images(parts: Sequence[tuple[str, str]], spec: VisionSpec, limits: MediaLimits,
                      run: Callable[..., Awaitable], client=None) -> list[tuple[object, str]]:
    """(pixels [3, S, S] float32, digest) of each ``(param, url)`` image part, in order;
    decoding and preprocessing run through ``run`` (the gateway's worker threads).

    Raises:
      OpenAIError: 400 naming the part (``serving.gateway.media.image_input``).
    """
    out = []
    for param, url in parts:
        image = await load_image(url, limits, param, client)
        pixels = await run(preprocess, image, spec.image_size)
        out.append((pixels, pixel_digest(pixels)))
    return out


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
