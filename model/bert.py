"""A BERT-family encoder (BERT, XLM-RoBERTa): the transformer of sentence-transformers' CrossEncoders.

Post-LayerNorm blocks over a padded batch of whole inputs, no KV cache::

    x = LayerNorm(word_emb[tokens] + pos_emb[positions] + type_emb[token_types])
    per layer:  x = LayerNorm(x + attn(x) W_o + b_o)                 bidirectional, biased q/k/v
                x = LayerNorm(x + act(x W_i + b_i) W_out + b_out)      act: exact GELU by default
    encode(...) -> x  [B, S, hidden] f32

Positions are ``0 .. S-1`` for BERT and ``pad_token_id + 1 + i`` for (XLM-)RoBERTa (transformers'
``create_position_ids_from_input_ids`` for unpadded tokens). A row's token type is 0 before its
``type_starts`` and 1 from there (BERT's pair framing: ``[CLS] a [SEP]`` then ``b [SEP]``);
RoBERTa's single type leaves it 0. Weights keep Hugging Face's ``[out, in]`` layout and names
(``model.cross_encoder`` reads them). Source of the semantics: transformers' ``modeling_bert.py``
and ``modeling_xlm_roberta.py`` (5.24).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.padded_attention_xla import padded_attention_xla
from model.compute import REFERENCE, Compute

__all__ = ["BertConfig", "BertEncoder", "ACTIVATIONS"]

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}

_LAYER_WEIGHTS = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "ln1_w", "ln1_b", "wi", "bi", "wout", "bout",
                  "ln2_w", "ln2_b")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """An encoder's sizes (from a Hugging Face ``config.json``).

    Attributes:
      name: the model's name (its directory).
      vocab_size, hidden_size, num_layers, num_heads, intermediate_size: sizes.
      max_position: the longest input in tokens (``max_position_embeddings``, less RoBERTa's
        ``pad_token_id + 1`` offset).
      type_vocab_size: token types (2 for BERT, 1 for XLM-RoBERTa).
      position_offset: the first position's row of ``pos_emb`` (0; RoBERTa: ``pad_token_id + 1``).
      layer_norm_eps: LayerNorm's epsilon.
      hidden_act: a key of ``ACTIVATIONS``.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position: int
    type_vocab_size: int = 2
    position_offset: int = 0
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape; layer weights stacked on a leading ``num_layers`` axis."""
        D, I, L = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = {"wq": (D, D), "bq": (D,), "wk": (D, D), "bk": (D,), "wv": (D, D), "bv": (D,),
                     "wo": (D, D), "bo": (D,), "ln1_w": (D,), "ln1_b": (D,), "wi": (I, D), "bi": (I,),
                     "wout": (D, I), "bout": (D,), "ln2_w": (D,), "ln2_b": (D,)}
        return {"word_emb": (self.vocab_size, D), "pos_emb": (self.max_position + self.position_offset, D),
                "type_emb": (self.type_vocab_size, D), "emb_ln_w": (D,), "emb_ln_b": (D,),
                **{k: (L, *s) for k, s in per_layer.items()}}


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


class BertEncoder(nnx.Module):
    """The encoder; ``takes_token_types`` tells the embedding engine to pass ``type_starts``.

    Args:
      cfg: sizes.
      params: {name: array} in :meth:`BertConfig.param_shapes` (float32 numpy or JAX arrays).
      dtype: the matmul-input dtype (float32 or bfloat16); LayerNorms, the softmax and
        accumulation run in float32.

    Raises:
      ValueError: a missing or misshapen parameter.
    """

    takes_token_types = True

    def __init__(self, cfg: BertConfig, params: dict, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        for name, shape in cfg.param_shapes().items():
            if name not in params:
                raise ValueError(f"{cfg.name}: parameter {name!r} is missing")
            if tuple(params[name].shape) != shape:
                raise ValueError(f"{cfg.name}: parameter {name!r} is {tuple(params[name].shape)}, expected {shape}")
            setattr(self, name, nnx.Param(jnp.asarray(np.asarray(params[name], np.float32))))

    def encode(self, tokens: jax.Array, lengths: jax.Array, compute: Compute = REFERENCE,
               type_starts: jax.Array | None = None) -> jax.Array:
        """Hidden states of a padded batch.

        Args:
          tokens: [B, S] int32; lengths: [B] int32, 1 <= lengths[b] <= S <= max_position.
          compute: the platform's matmul choices (``Compute.dot``).
          type_starts: [B] int32, the first position of token type 1 in each row (>= lengths[b]:
            all type 0); None: all type 0.

        Returns:
          [B, S, hidden] float32 (padding positions hold garbage the caller ignores).
        """
        cfg, dtype = self.cfg, self.dtype
        B, S = tokens.shape
        pos = jnp.arange(S, dtype=jnp.int32)
        types = jnp.zeros((B, S), jnp.int32) if type_starts is None else \
            (pos[None, :] >= type_starts[:, None]).astype(jnp.int32)
        types = jnp.minimum(types, cfg.type_vocab_size - 1)
        x = (self.word_emb[...][tokens] + self.pos_emb[...][pos + cfg.position_offset][None]
             + self.type_emb[...][types])
        x = _layer_norm(x, self.emb_ln_w[...], self.emb_ln_b[...], cfg.layer_norm_eps).reshape(B * S, -1)
        H = cfg.num_heads
        hd = cfg.hidden_size // H
        act = ACTIVATIONS[cfg.hidden_act]

        def linear(h, w, b):
            return compute.dot("tk,nk->tn", h, w, dtype) + b

        def layer(x, p):
            q, k, v = (linear(x, p[w], p[b]).reshape(B, S, H, hd) for w, b in (("wq", "bq"), ("wk", "bk"),
                                                                              ("wv", "bv")))
            o = padded_attention_xla(q, k, v, lengths, scale=hd ** -0.5, causal=False).reshape(B * S, -1)
            x = _layer_norm(x + linear(o.astype(jnp.float32), p["wo"], p["bo"]), p["ln1_w"], p["ln1_b"],
                            cfg.layer_norm_eps)
            y = linear(act(linear(x, p["wi"], p["bi"])), p["wout"], p["bout"])
            return _layer_norm(x + y, p["ln2_w"], p["ln2_b"], cfg.layer_norm_eps), None

        x, _ = jax.lax.scan(layer, x, {n: getattr(self, n)[...] for n in _LAYER_WEIGHTS})
        return x.reshape(B, S, -1)
