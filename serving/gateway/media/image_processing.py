"""An image as Gemma 3's processor hands it to the vision tower: RGB, resized, rescaled, normalized.

Follows transformers' ``Gemma3ImageProcessorPil`` (``image_processing_pil_gemma3.py``, without
pan-and-scan, which is off by default) step by step, with Pillow:

1. ``convert_to_rgb``: an image with another mode is converted to RGBA and composited over
   white, then to RGB (a transparent pixel becomes white);
2. resize to ``size x size`` with Pillow's bilinear filter (``Image.resize``; antialiased when
   shrinking, as Pillow's resize always is);
3. rescale by 1/255 and normalize with mean 0.5 and std 0.5 per channel: ``x / 127.5 - 1``;
4. channels first: ``[3, size, size]`` float32.

transformers' default ``Gemma3ImageProcessor`` resizes with torchvision instead (its bilinear
antialias differs from Pillow's by a grey level here and there); the PIL processor is the one
whose pixels tests/model/test_gemma3_vision.py holds ours equal to.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image

__all__ = ["pixel_digest", "preprocess", "to_rgb"]

MEAN = 0.5
STD = 0.5


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB: other modes through RGBA composited over white (transformers'
    ``image_transforms.convert_to_rgb``)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def preprocess(image: Image.Image, size: int) -> np.ndarray:
    """[3, size, size] float32 pixel values in [-1, 1] of a decoded image (any mode, any size).

    Raises:
      ValueError: ``size`` below 1.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    rgb = to_rgb(image).resize((size, size), resample=Image.Resampling.BILINEAR)
    x = np.asarray(rgb, dtype=np.float64) * (1.0 / 255.0)
    x = ((x.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)).astype(np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def pixel_digest(pixels: np.ndarray) -> str:
    """A hex SHA-256 of preprocessed pixel values (their shape, dtype and bytes): the key of
    the encoder-output cache and the image's part of prefix-cache page hashes."""
    h = hashlib.sha256(f"{pixels.shape}{pixels.dtype}".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()
