"""The SigLIP vision encoder (Flax NNX): images -> one hidden vector per patch.

Architecture (Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training"; a ViT,
Dosovitskiy et al. 2021; checked against transformers' ``modeling_siglip.py``,
``SiglipVisionTransformer`` without its pooling head, as Gemma 3 uses it)::

    x = patches(pixels) @ patch_embed + patch_bias + pos_embed      (a stride-p, p x p convolution)
    per layer:  x = x + out(attn(layer_norm1(x)))                   (full attention, biases)
                x = x + fc2(gelu_tanh(fc1(layer_norm2(x))))
    features = post_layer_norm(x)

Layer weights are stacked on a leading ``layers`` axis and the encoder runs as one
``lax.scan``. Everything is computed in float32 (the tower is small next to the decoder).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import check_params, param

__all__ = ["SiglipConfig", "SiglipEncoder", "layer_norm", "patchify"]


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """The vision tower's shapes (transformers' ``SiglipVisionConfig`` fields).

    Attributes:
      hidden_size, intermediate_size, num_layers, num_heads: the ViT's widths and depth.
      image_size: side of the square input in pixels; patch_size: side of a patch in pixels.
      num_channels: 3 (RGB).
      layer_norm_eps: LayerNorm epsilon.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layout(self) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
        """``{name: (shape, logical axes)}`` of every parameter (L = layers, E = hidden,
        F = intermediate, C = channels, p = patch, P = patches)."""
        L, E, F, C, p, P = (self.num_layers, self.hidden_size, self.intermediate_size,
                            self.num_channels, self.patch_size, self.num_patches)
        return {
            "patch_embed": ((C * p * p, E), (None, "vision_embed")),
            "patch_bias": ((E,), ("vision_embed",)),
            "pos_embed": ((P, E), (None, "vision_embed")),
            "ln1_scale": ((L, E), ("layers", "vision_embed")),
            "ln1_bias": ((L, E), ("layers", "vision_embed")),
            "wq": ((L, E, E), ("layers", "vision_embed", None)),
            "bq": ((L, E), ("layers", None)),
            "wk": ((L, E, E), ("layers", "vision_embed", None)),
            "bk": ((L, E), ("layers", None)),
            "wv": ((L, E, E), ("layers", "vision_embed", None)),
            "bv": ((L, E), ("layers", None)),
            "wo": ((L, E, E), ("layers", None, "vision_embed")),
            "bo": ((L, E), ("layers", "vision_embed")),
            "ln2_scale": ((L, E), ("layers", "vision_embed")),
            "ln2_bias": ((L, E), ("layers", "vision_embed")),
            "fc1": ((L, E, F), ("layers", "vision_embed", "vision_mlp")),
            "fc1_bias": ((L, F), ("layers", "vision_mlp")),
            "fc2": ((L, F, E), ("layers", "vision_mlp", "vision_embed")),
            "fc2_bias": ((L, E), ("layers", "vision_embed")),
            "post_ln_scale": ((E,), ("vision_embed",)),
            "post_ln_bias": ((E,), ("vision_embed",)),
        }


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32 (biased variance, as ``torch.nn.LayerNorm``)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def patchify(pixels: jax.Array, patch_size: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/p) * (W/p), C * p * p], patches in row-major order, each
    flattened channel-major (C, py, px): the order of a conv kernel ``[E, C, p, p]``."""
    b, c, h, w = pixels.shape
    p = patch_size
    x = pixels.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


class SiglipEncoder(nnx.Module):
    """SigLIP's vision transformer (no pooling head).

    ``__call__(pixels [B, C, image_size, image_size] f32) -> [B, num_patches, hidden] f32``.
    Parameters as :meth:`SiglipConfig.layout` lists them, float32.
    """

    def __init__(self, cfg: SiglipConfig, params: dict):
        """Raises ValueError: a missing or misshapen parameter."""
        self.cfg = cfg
        layout = cfg.layout()
        check_params(params, layout)
        for name, (_, axes) in layout.items():
            setattr(self, name, param(jnp.asarray(params[name], jnp.float32), axes))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.cfg
        if pixels.shape[1:] != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"pixels must be [batch, {cfg.num_channels}, {cfg.image_size}, "
                             f"{cfg.image_size}], got {tuple(pixels.shape)}")
        hp = jax.lax.Precision.HIGHEST
        x = jnp.einsum("bpk,ke->bpe", patchify(pixels.astype(jnp.float32), cfg.patch_size),
                       self.patch_embed[...], precision=hp)
        x = x + self.patch_bias[...] + self.pos_embed[...][None]
        b, n, e = x.shape
        nh, hd = cfg.num_heads, cfg.head_dim
        eps = cfg.layer_norm_eps
        names = ("ln1_scale", "ln1_bias", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo",
                 "ln2_scale", "ln2_bias", "fc1", "fc1_bias", "fc2", "fc2_bias")
        stacked = {name: getattr(self, name)[...] for name in names}

        def layer(x, p):
            h = layer_norm(x, p["ln1_scale"], p["ln1_bias"], eps)
            q = (jnp.einsum("bne,ef->bnf", h, p["wq"], precision=hp) + p["bq"]).reshape(b, n, nh, hd)
            k = (jnp.einsum("bne,ef->bnf", h, p["wk"], precision=hp) + p["bk"]).reshape(b, n, nh, hd)
            v = (jnp.einsum("bne,ef->bnf", h, p["wv"], precision=hp) + p["bv"]).reshape(b, n, nh, hd)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hp) / math.sqrt(hd)
            probs = jax.nn.softmax(scores, axis=-1)
            o = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hp).reshape(b, n, e)
            x = x + jnp.einsum("bne,ef->bnf", o, p["wo"], precision=hp) + p["bo"]
            h = layer_norm(x, p["ln2_scale"], p["ln2_bias"], eps)
            h = jax.nn.gelu(jnp.einsum("bne,ef->bnf", h, p["fc1"], precision=hp) + p["fc1_bias"],
                            approximate=True)
            x = x + jnp.einsum("bnf,fe->bne", h, p["fc2"], precision=hp) + p["fc2_bias"]
            return x, None

        x, _ = jax.lax.scan(layer, x, stacked)
        return layer_norm(x, self.post_ln_scale[...], self.post_ln_bias[...], eps)
