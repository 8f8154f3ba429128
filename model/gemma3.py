"""Gemma 3 (and Gemma 2) text decoder in Flax NNX, over a paged KV cache.

Architecture (Gemma 3 technical report; checked against the reference README):

    x = embed[tokens] * sqrt(hidden)
    per layer:  h = x + post_attn_norm(attn(input_norm(x)))
                x = h + post_ffw_norm(down(gelu_tanh(gate(pre_ffw_norm(h))) * up(...)))
    attn:       q, k = rms_norm_per_head(q), rms_norm_per_head(k)   (QK-norm, before RoPE)
                q, k = rope(q, k; theta = 1e6 global / 1e4 sliding)  (rotate-half pairing)
                scores * 1/sqrt(query_pre_attn_scalar); sliding window on 5 of every 6 layers
    logits = final_norm(x) @ embed.T                                  (tied output)

Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a
Practical Size"; HF ``modeling_gemma2.py``) is the same stack without QK-norm
(``cfg.qk_norm`` False: no q_norm / k_norm parameters), one RoPE base on every
layer, attention-logit soft-capping (``cfg.attn_logit_softcap``, applied by the
attention kernels: ``c * tanh(scores / c)`` before the mask and softmax) and
final-logit soft-capping, sliding windows on every other layer (0, 2, ...).

RMSNorm weights are stored as the full multiplier (``1 + w`` in HF terms), as
the GGUF stores them: ``y = x * rsqrt(mean(x^2) + eps) * scale``.

The layer weights are stacked on a leading ``layers`` axis and the decoder
runs as one ``lax.scan``, so a step compiles one layer body instead of 18.
The model knows nothing of serving or of the platform: it maps (tokens,
positions, kv_cache, attention metadata, logits_indices) to (logits, kv_cache)
(``__call__``), or a padded batch (tokens, lengths) to its final-norm hidden
states without the LM head (``encode``: embedding models such as EmbeddingGemma,
bidirectional when ``cfg.causal`` is False; ``__call__`` refuses those),
and takes what depends on the platform (the dot, the attention
implementation) as one static ``compute`` argument (``model.compute``).
Stacked layer weights may arrive in a storage representation (the engine's
backend policy decides); they are turned back into their logical dtype
inside the layer scan, as the Llama decoder does.

Parameters carry logical axis names (``logical_axes`` metadata) for
``sharding/`` to map onto a mesh; the model itself has no parallelism.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers import (
    apply_rope,
    attention_block,
    check_params,
    encode_attention_block,
    embed_lookup_param,
    embed_tokens,
    rms_norm,
    set_params,
    weight,
    with_lora,
)
from model.lora import LoraInputs
from model.random_weights import RandomWeights

__all__ = ["Gemma3", "KVCache", "apply_rope", "init_random_params", "rms_norm"]


class Gemma3(nnx.Module):
    """Gemma 3 decoder with stacked layer weights.

    Parameter shapes (L = num_layers, D = hidden, N = heads, K = kv heads, H = head_dim, F = mlp):
      embed [V, D]; final_norm [D];
      attn_norm, post_attn_norm, ffw_norm, post_ffw_norm [L, D]; q_norm, k_norm [L, H]
      (with ``cfg.qk_norm``);
      wq [L, D, N, H]; wk, wv [L, D, K, H]; wo [L, N, H, D];
      w_gate, w_up [L, D, F]; w_down [L, F, D].
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 params: dict | None = None, quantization: str = "none"):
        """Builds the model from ``params`` (a dict of arrays in the layout above,
        e.g. from ``model.gguf_loader``) or with random weights from ``rngs``.

        Args:
          cfg: shapes.
          dtype: weight and matmul-input dtype (float32 or bfloat16); norms,
            softmax and accumulation are float32 regardless.
          quantization: "none", or "int8": the layer matrices and the tied output
            head held as int8 with scales (``model.layers.set_params``; the
            embedding lookup keeps a float32 copy).

        Raises:
          ValueError: missing or misshapen parameters, an unknown quantization.
        """
        self.cfg = cfg
        self.dtype = dtype
        if params is None:
            params = init_random_params(cfg, rngs or nnx.Rngs(0))
        L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                               cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)
        expected = {
            "embed": ((V, D), ("vocab", "embed")),
            "final_norm": ((D,), ("embed",)),
            "attn_norm": ((L, D), ("layers", "embed")),
            "post_attn_norm": ((L, D), ("layers", "embed")),
            "ffw_norm": ((L, D), ("layers", "embed")),
            "post_ffw_norm": ((L, D), ("layers", "embed")),
            "q_norm": ((L, H), ("layers", "head_dim")),
            "k_norm": ((L, H), ("layers", "head_dim")),
            "wq": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
            "wk": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
            "wv": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
            "wo": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
            "w_gate": ((L, D, F), ("layers", "embed", "mlp")),
            "w_up": ((L, D, F), ("layers", "embed", "mlp")),
            "w_down": ((L, F, D), ("layers", "mlp", "embed")),
        }
        if not cfg.qk_norm:  # Gemma 2
            del expected["q_norm"], expected["k_norm"]
        check_params(params, expected)
        self.quantization = quantization
        set_params(self, params, expected, dtype, quantization)
        self.embed_lookup = embed_lookup_param(params["embed"], dtype, tied=True,
                                               quantized=quantization != "none")

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        logits_indices: jax.Array,
        compute: Compute = REFERENCE,
        image_embeds: jax.Array | None = None,
        lora: LoraInputs | None = None,
        hidden_states: bool = False,
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
        """Runs the decoder over a step's tokens.

        Args:
          tokens: [T] int32.
          positions: [T] int32 absolute positions.
          kv_cache: all layers' pages; this step's K/V are written into it.
          md: the step's attention metadata.
          logits_indices: [S] int32, the tokens whose logits are returned.
          compute: platform-dependent choices (static; see ``model.compute``).
          image_embeds: [T, D] float32 or None: the input embedding of each image token
            (``md.image_spans`` non-empty), used as it is (token embeddings are scaled by
            sqrt(D), image soft tokens are not: ``model.gemma3_vision``); other rows are
            ignored. Needs ``md.image_spans``.
          lora: the resident LoRA adapters' stacks and each token's slot (``model.lora``;
            None: the base model).
          hidden_states: also return every token's final-norm hidden state, which
            :meth:`head` turns into that token's logits (a prefill that scores its prompt).

        Returns:
          (logits [S, vocab] float32, updated kv_cache), with ``hidden_states`` a third
          element: [T, hidden] in the compute dtype.

        Raises:
          ValueError: a bidirectional model (``cfg.causal`` False), which only encodes;
            ``image_embeds`` without ``md.image_spans``.
        """
        cfg = self.cfg
        dtype = self.dtype

        def attend(h, p, l, window, theta, rope_scaled, cache, lw):
            o, k_cache, v_cache = attention_block(
                h, p, positions, cache[0], cache[1], md, l, cfg=cfg, theta=theta, window=window,
                dtype=dtype, compute=compute, rope_scaled=rope_scaled, lora=lw)
            return o, (k_cache, v_cache)

        image_rows = None
        if image_embeds is not None:
            if md.image_spans is None:
                raise ValueError("image_embeds needs the attention metadata's image_spans")
            image_rows = (md.image_spans[:, 1] > md.image_spans[:, 0], image_embeds)
        x, (k_cache, v_cache) = self._layers(tokens, attend, (kv_cache.k, kv_cache.v), compute, image_rows, lora)
        logits = self.head(rms_norm(x[logits_indices], self.final_norm[...], cfg.rms_norm_eps, compute), compute)
        if hidden_states:
            return logits, KVCache(k_cache, v_cache), rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, compute)
        return logits, KVCache(k_cache, v_cache)

    def head(self, x: jax.Array, compute: Compute = REFERENCE) -> jax.Array:
        """The LM head (the tied embedding, then the final soft cap where the config has one):
        final-norm hidden states x [S, hidden] -> logits [S, vocab] float32."""
        logits = compute.dot("sd,vd->sv", x, weight(self, "embed"), self.dtype)
        if self.cfg.final_logit_softcap is not None:
            c = self.cfg.final_logit_softcap
            logits = c * jnp.tanh(logits / c)
        return logits

    def encode(self, tokens: jax.Array, lengths: jax.Array, compute: Compute = REFERENCE) -> jax.Array:
        """The final-norm hidden states of a padded batch, without the LM head (embedding models).

        Attention is causal, or bidirectional when ``cfg.causal`` is False (EmbeddingGemma);
        no KV cache is read or kept.

        Args:
          tokens: [B, S] int32, row b's tokens at 0 .. lengths[b] - 1, then padding (any id).
          lengths: [B] int32, 1 <= lengths[b] <= S.
          compute: platform-dependent choices (static; the dot).

        Returns:
          [B, S, hidden] float32; positions past a row's length hold garbage.
        """
        cfg = self.cfg
        B, S = tokens.shape
        positions = jnp.tile(jnp.arange(S, dtype=jnp.int32), B)

        def attend(h, p, l, window, theta, rope_scaled, state, lw):  # (no LoRA: lw is None)
            o = encode_attention_block(h, p, positions, lengths, cfg=cfg, theta=theta, window=window,
                                       dtype=self.dtype, compute=compute, rope_scaled=rope_scaled)
            return o, state

        x, _ = self._layers(tokens.reshape(B * S), attend, (), compute)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, compute).reshape(B, S, -1)

    def _layers(self, tokens: jax.Array, attend, state, compute: Compute, image_rows=None,
                lora: LoraInputs | None = None):
        """The embedding and the layer stack (one ``lax.scan``), attention by ``attend``.

        ``attend(h [T, D], layer weights, layer id, window, theta, rope_scaled, state, lw) ->
        (o [T, D], state)``: the paged cache threaded as ``state`` (``__call__``), or
        nothing (``encode``); ``lw`` is this layer's LoRA (``layers.with_lora``) or None.
        ``lora``: the LoRA stacks and token slots, or None. ``image_rows``: None, or
        (is_image [T] bool, embeds [T, D]):
        the rows whose input embedding is an image soft token, taken as it is (unscaled).
        Returns (x [T, D] f32 before the final norm, state).
        """
        cfg = self.cfg
        dtype = self.dtype
        x = embed_tokens(self, tokens) * jnp.float32(math.sqrt(cfg.hidden_size))
        if image_rows is not None:
            is_image, embeds = image_rows
            x = jnp.where(is_image[:, None], embeds.astype(jnp.float32), x)
        windows = jnp.asarray(cfg.layer_windows(), jnp.int32)
        thetas = jnp.asarray(cfg.layer_rope_thetas(), jnp.float32)
        layer_params = {
            name: weight(self, name)
            for name in ("attn_norm", "post_attn_norm", "ffw_norm", "post_ffw_norm", "q_norm",
                         "k_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
            if cfg.qk_norm or name not in ("q_norm", "k_norm")
        }
        eps = cfg.rms_norm_eps
        use_window = cfg.has_sliding_layers
        # HF's Gemma 3 scales the RoPE of its global layers only (rope_scaling, e.g. linear 8
        # on 4B+); unscaled models scan over the same inputs as before (same program).
        scaled_rope = cfg.rope_scaling_factor is not None

        def layer(carry, xs):
            x, state = carry
            p, l, window, theta, lora_layer = xs[:5]
            rope_scaled = xs[5] if scaled_rope else True
            p = {name: compute.load(w) for name, w in p.items()}  # stored -> logical dtype
            p.update(compute.layer_view(resident, l))
            lw = None if lora_layer is None else (lora_layer, lora.token_slots)
            h = rms_norm(x, p["attn_norm"], eps, compute)
            o, state = attend(h, p, l, window if use_window else None, theta, rope_scaled, state, lw)
            x = x + rms_norm(o, p["post_attn_norm"], eps, compute)
            h = rms_norm(x, p["ffw_norm"], eps, compute)
            gate = with_lora(compute.dot("td,df->tf", h, p["w_gate"], dtype), h, lw, "w_gate", dtype, compute)
            up = with_lora(compute.dot("td,df->tf", h, p["w_up"], dtype), h, lw, "w_up", dtype, compute)
            act = jax.nn.gelu(gate, approximate=True) * up
            mlp = with_lora(compute.dot("tf,fd->td", act, p["w_down"], dtype), act, lw, "w_down", dtype, compute)
            x = x + rms_norm(mlp, p["post_ffw_norm"], eps, compute)
            return (x, state), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        # weights the int8 matmul reads in place in their stacks are closed over, not scanned
        layer_params, resident = compute.layer_weights(layer_params)
        xs = (layer_params, layer_ids, windows, thetas, None if lora is None else lora.weights)
        if scaled_rope:
            xs += (jnp.asarray([cfg.is_global_layer(i) for i in range(cfg.num_layers)]),)
        (x, state), _ = jax.lax.scan(layer, (x, state), xs)
        return x, state


def init_random_params(cfg: ModelConfig, rngs: nnx.Rngs) -> dict[str, jax.Array]:
    """Random weights in the Gemma3 layout (float32), for tests and benchmarks.

    Scaled so activations stay O(1) through the stack (normal / sqrt(fan_in)); drawn on the
    host (``model.random_weights``).
    """
    L, D, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)

    draw = RandomWeights(rngs)  # on the host: no XLA program per shape
    normal, norm_scale = draw.normal, draw.norm_scale

    out = {
        "embed": normal((V, D), D),
        "final_norm": norm_scale((D,)),
        "attn_norm": norm_scale((L, D)),
        "post_attn_norm": norm_scale((L, D)),
        "ffw_norm": norm_scale((L, D)),
        "post_ffw_norm": norm_scale((L, D)),
        "q_norm": norm_scale((L, H)),
        "k_norm": norm_scale((L, H)),
        "wq": normal((L, D, N, H), D),
        "wk": normal((L, D, K, H), D),
        "wv": normal((L, D, K, H), D),
        "wo": normal((L, N, H, D), N * H),
        "w_gate": normal((L, D, F), D),
        "w_up": normal((L, D, F), D),
        "w_down": normal((L, F, D), F),
    }
    if not cfg.qk_norm:
        del out["q_norm"], out["k_norm"]
    return out
