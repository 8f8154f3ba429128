"""Image inputs on the engine side: the vision tower's outputs, cached by pixel digest, and their
place in a prefill step (Gemma 3 vision; ``model.gemma3_vision``).

:class:`ImageEncoder` runs the tower (jitted apart from the decoder) over a few images at a
time, padded to a power-of-two batch (1, 2, 4, ... ``max_batch``: one compiled program each),
and keeps the soft tokens of the last ``cache_size`` images by their pixels' digest
(``ImageInput.digest``), so a repeated image is encoded once.

:func:`pack_images` lays a step's image soft tokens out as the decoder takes them: for each
prefill token, its input embedding row (``image_embeds [T, D]``) and its image's span of
positions (``image_spans [T, 2]``, empty for text tokens; ``model.attention_metadata``).
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from serving.contract.engine_client import ImageInput
from serving.core.sched.step_plan import PrefillRow

__all__ = ["ImageEncoder", "pack_images"]


class ImageEncoder:
    """The vision tower behind a digest-keyed cache of its outputs.

    Args:
      tower: a ``model.gemma3_vision.Gemma3VisionTower``.
      cache_size: images whose soft tokens are kept (least recently used dropped first).
      max_batch: most images per encoder call.

    Attributes:
      hits, misses: images found in the cache / encoded, since the start.
    """

    def __init__(self, tower, cache_size: int = 64, max_batch: int = 8):
        self.tower = tower
        self.cfg = tower.cfg
        self.cache_size = cache_size
        self.max_batch = max_batch
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def tokens_per_image(self) -> int:
        return self.cfg.mm_tokens_per_image

    @property
    def image_size(self) -> int:
        return self.cfg.siglip.image_size

    def soft_tokens(self, images: Sequence[ImageInput]) -> list[np.ndarray]:
        """Each image's soft tokens [mm_tokens_per_image, D] float32 (numpy), from the cache
        or encoded (several misses in one call share encoder batches).

        Raises:
          ValueError: an image whose pixels are not [3, S, S] or whose ``num_tokens`` is
            not the tower's ``mm_tokens_per_image``.
        """
        from model.gemma3_vision import encode_images  # JAX only on the engine side

        S = self.image_size
        todo: dict[str, np.ndarray] = {}
        for im in images:
            if im.num_tokens != self.tokens_per_image:
                raise ValueError(f"an image takes {self.tokens_per_image} soft tokens, got {im.num_tokens}")
            if im.digest in self._cache:
                self._cache.move_to_end(im.digest)
                self.hits += 1
            elif im.digest not in todo:
                pixels = np.asarray(im.pixels, np.float32)
                if pixels.shape != (3, S, S):
                    raise ValueError(f"image pixels must be [3, {S}, {S}], got {pixels.shape}")
                todo[im.digest] = pixels
                self.misses += 1
            else:
                self.hits += 1
        digests = list(todo)
        for i in range(0, len(digests), self.max_batch):
            part = digests[i:i + self.max_batch]
            bucket = 1 << (len(part) - 1).bit_length()
            batch = np.zeros((bucket, 3, S, S), np.float32)
            batch[:len(part)] = [todo[d] for d in part]
            out = np.asarray(encode_images(self.tower, batch))
            for j, d in enumerate(part):
                self._cache[d] = out[j]
        out = [self._cache[im.digest] for im in images]
        while len(self._cache) > self.cache_size:  # after reading: a step's images always fit
            self._cache.popitem(last=False)
        return out


def pack_images(rows: Sequence[PrefillRow], images: Mapping[str, Sequence[ImageInput]],
                encoder: ImageEncoder, num_tokens: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """(image_embeds [T, D] float32, image_spans [T, 2] int32) of a prefill step whose rows
    are packed back to back in ``rows`` order (as ``PrefillBatch.from_rows`` packs them).

    A row's tokens that hold soft tokens of one of its request's ``images`` get that
    image's rows and span; all others zeros and an empty span (0, 0).

    Raises:
      ValueError: as :meth:`ImageEncoder.soft_tokens`.
    """
    embeds = np.zeros((num_tokens, hidden), np.float32)
    spans = np.zeros((num_tokens, 2), np.int32)
    off = 0
    for r in rows:
        ims = [im for im in images.get(r.request_id, ()) if im.start < r.end and im.end > r.start]
        for im, soft in zip(ims, encoder.soft_tokens(ims) if ims else []):
            lo, hi = max(im.start, r.start), min(im.end, r.end)
            embeds[off + lo - r.start:off + hi - r.start] = soft[lo - im.start:hi - im.start]
            spans[off + lo - r.start:off + hi - r.start] = (im.start, im.end)
        off += len(r.token_ids)
    return embeds, spans
