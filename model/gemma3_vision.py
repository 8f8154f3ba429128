"""Gemma 3's vision input: the SigLIP tower and the multimodal projector -> soft tokens.

An image becomes ``mm_tokens_per_image`` vectors in the decoder's embedding space
(Gemma 3 technical report, sec. 2.1; checked against transformers' ``modeling_gemma3.py``,
``Gemma3Model.get_image_features`` and ``Gemma3MultiModalProjector``)::

    patches  = siglip(pixels)                          [B, P, E]   P = (image_size / patch_size)^2
    pooled   = avg_pool(patches as a P^0.5 x P^0.5 grid, kernel k, stride k)
                                                       [B, M, E]   M = mm_tokens_per_image,
                                                                   k = P^0.5 / M^0.5
    soft     = rms_norm_1+w(pooled) @ mm_input_projection     [B, M, D]  D = the decoder's hidden

The soft tokens replace the embeddings of the ``image_token_id`` placeholders in the prompt
as they are (not scaled by sqrt(D) as token embeddings are), and the decoder attends
bidirectionally within each image's run of placeholders (``model.attention_metadata``'s
``image_spans``). The encoder is jitted apart from the decoder (:func:`encode_images`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import check_params, param, rms_norm
from model.siglip import SiglipConfig, SiglipEncoder

__all__ = ["Gemma3VisionConfig", "Gemma3VisionTower", "encode_images", "read_vision_config"]


@dataclasses.dataclass(frozen=True)
class Gemma3VisionConfig:
    """What the vision input of a ``Gemma3ForConditionalGeneration`` checkpoint needs.

    Attributes:
      siglip: the encoder's shapes.
      mm_tokens_per_image: soft tokens per image (256 in the released models).
      text_hidden_size: the decoder's embedding width (D).
      image_token_id, boi_token_id, eoi_token_id: the placeholder, ``<start_of_image>``
        and ``<end_of_image>`` token ids.
      rms_norm_eps: of ``mm_soft_emb_norm`` (the text config's epsilon).
    """

    siglip: SiglipConfig
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    rms_norm_eps: float = 1e-6

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        return self.siglip.patches_per_side // self.tokens_per_side

    def layout(self) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
        """The projector's parameters ({name: (shape, logical axes)})."""
        E, D = self.siglip.hidden_size, self.text_hidden_size
        return {"mm_soft_emb_norm": ((E,), ("vision_embed",)),
                "mm_input_projection": ((E, D), ("vision_embed", "embed"))}


def read_vision_config(d: Mapping[str, Any]) -> Gemma3VisionConfig | None:
    """The vision config of a ``Gemma3ForConditionalGeneration`` ``config.json`` (as a dict);
    None when it has no ``vision_config``.

    Raises:
      ValueError: a missing field (named), ``mm_tokens_per_image`` not a square, or a
        patch grid the pooling cannot divide evenly.
    """
    v = d.get("vision_config")
    if v is None:
        return None
    text = d.get("text_config") or {}

    def need(src, key, where):
        if src.get(key) is None:
            raise ValueError(f"Gemma3ForConditionalGeneration: {where} lacks {key!r}")
        return src[key]

    siglip = SiglipConfig(
        hidden_size=need(v, "hidden_size", "vision_config"),
        intermediate_size=need(v, "intermediate_size", "vision_config"),
        num_layers=need(v, "num_hidden_layers", "vision_config"),
        num_heads=need(v, "num_attention_heads", "vision_config"),
        image_size=need(v, "image_size", "vision_config"),
        patch_size=need(v, "patch_size", "vision_config"),
        num_channels=v.get("num_channels", 3),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6))
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r}: only gelu_pytorch_tanh is implemented")
    mm = d.get("mm_tokens_per_image", 256)
    side = math.isqrt(mm)
    if side * side != mm:
        raise ValueError(f"mm_tokens_per_image {mm} is not a square")
    if siglip.image_size % siglip.patch_size or siglip.patches_per_side % side:
        raise ValueError(f"a {siglip.patches_per_side}x{siglip.patches_per_side} patch grid cannot be "
                         f"pooled to {side}x{side} soft tokens")
    return Gemma3VisionConfig(
        siglip=siglip, mm_tokens_per_image=mm,
        text_hidden_size=need(text, "hidden_size", "text_config"),
        image_token_id=d.get("image_token_index", d.get("image_token_id", 262144)),
        boi_token_id=d.get("boi_token_index", 255999), eoi_token_id=d.get("eoi_token_index", 256000),
        rms_norm_eps=text.get("rms_norm_eps", 1e-6))


class Gemma3VisionTower(nnx.Module):
    """SigLIP encoder, average pooling and the multimodal projector.

    ``__call__(pixels [B, C, S, S] f32) -> soft tokens [B, mm_tokens_per_image, D] f32``
    (S = ``image_size``, D = the decoder's hidden size).

    Parameters: the encoder's (``model.siglip``; ``params["siglip"]``, a dict) and
    ``mm_soft_emb_norm`` [E] (the full multiplier, 1 + w in transformers' terms),
    ``mm_input_projection`` [E, D].
    """

    def __init__(self, cfg: Gemma3VisionConfig, params: dict):
        """Raises ValueError: a missing or misshapen parameter."""
        self.cfg = cfg
        self.encoder = SiglipEncoder(cfg.siglip, params["siglip"])
        layout = cfg.layout()
        check_params(params, layout)
        for name, (_, axes) in layout.items():
            setattr(self, name, param(jnp.asarray(params[name], jnp.float32), axes))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = self.encoder(pixels)  # [B, P, E]
        b, _, e = x.shape
        k, s = cfg.pool_kernel, cfg.tokens_per_side  # row-major patches: row = i * k + a
        x = x.reshape(b, s, k, s, k, e).mean(axis=(2, 4)).reshape(b, s * s, e)
        x = rms_norm(x, self.mm_soft_emb_norm[...], cfg.rms_norm_eps)
        return jnp.einsum("bme,ed->bmd", x, self.mm_input_projection[...],
                          precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, state, pixels):
    return nnx.merge(graphdef, state)(pixels)


def encode_images(tower: Gemma3VisionTower, pixels: jax.Array) -> jax.Array:
    """Soft tokens of a batch of images, jitted apart from the decoder (one program per
    batch size; callers pad to a few bucketed sizes).

    Args:
      pixels: [B, C, S, S] float32, as :func:`model.image_processing.preprocess` makes them.

    Returns:
      [B, mm_tokens_per_image, D] float32.
    """
    graphdef, state = nnx.split(tower)
    return _encode(graphdef, state, pixels)
