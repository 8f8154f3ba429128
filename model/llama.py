"""Llama-family decoder in Flax NNX over the paged KV cache: Llama 3, Mistral, Qwen2, Qwen3,
Phi-3, and MoE (Mixtral, Qwen3-MoE).

Architecture (Llama 3: Grattafiori et al. 2024; HF ``modeling_llama.py``)::

    x = embed[tokens]
    per layer:  h = x + attn(rms_norm(x))              GQA, RoPE (rotate-half; Llama 3.1 scaling)
                x = h + ffn(rms_norm(h))
    logits = rms_norm(x) @ lm_head                       (lm_head = embed.T when tied)

``ffn`` is a SwiGLU MLP ``down(silu(gate(h)) * up(h))``, or with
``cfg.num_experts > 0`` the mixture of experts of ``model.moe`` (Mixtral:
8 experts, top-2; Qwen3-30B-A3B: 128 experts, top-8, with QK-norm). The
attention sub-layer is Gemma 3's (``model.layers.attention_block``) without
soft-caps, with q/k/v biases for Qwen2 (``cfg.qkv_bias``) and Phi-3's
LongRoPE and partial rotary width (``model.layers.apply_rope``; Phi-3's fused
``qkv_proj`` / ``gate_up_proj`` are split at load); layers that ``cfg`` marks
sliding (Mistral's and Phi-3's ``sliding_window``, Qwen2's and Qwen3's
``use_sliding_window``) attend through the window.

``encode`` maps a padded batch to its final-norm hidden states without the LM head
(embedding models: Qwen3-Embedding's last-token pooling reads them; see ``model.gemma3``).

Layer weights are stacked on a leading ``layers`` axis and the decoder runs
as one ``lax.scan``; stacked weights in a storage representation are turned
back into their logical dtype inside it, as in ``model.gemma3``. What depends
on the platform arrives in the static ``compute`` argument (``model.compute``).
Parameters carry logical axes for ``sharding/``; the model has no parallelism
of its own (the MoE layer runs expert-parallel over the mesh axes that
``compute.moe`` names when the ambient mesh splits them, see ``model.moe.moe_ffn``).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers import (
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
from model.moe import moe_ffn
from model.random_weights import RandomWeights


def param_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every parameter's (shape, logical axes).

    L = layers, D = hidden, N = heads, K = kv heads, H = head_dim, F = mlp,
    E = experts, Fe = expert mlp, V = vocab.
    """
    L, D, N, K, H, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.vocab_size)
    out = {
        "embed": ((V, D), ("vocab", "embed")),
        "final_norm": ((D,), ("embed",)),
        "attn_norm": ((L, D), ("layers", "embed")),
        "ffw_norm": ((L, D), ("layers", "embed")),
        "wq": ((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = ((D, V), ("embed", "vocab"))
    if cfg.qkv_bias:  # Qwen2
        out["bq"] = ((L, N, H), ("layers", "heads", "head_dim"))
        out["bk"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
        out["bv"] = ((L, K, H), ("layers", "kv_heads", "head_dim"))
    if cfg.qk_norm:
        out["q_norm"] = ((L, H), ("layers", "head_dim"))
        out["k_norm"] = ((L, H), ("layers", "head_dim"))
    if cfg.is_moe:
        E, Fe = cfg.num_experts, cfg.expert_mlp_dim
        out["router"] = ((L, D, E), ("layers", "embed", None))
        out["w_gate"] = ((L, E, D, Fe), ("layers", "expert", "embed", "mlp"))
        out["w_up"] = ((L, E, D, Fe), ("layers", "expert", "embed", "mlp"))
        out["w_down"] = ((L, E, Fe, D), ("layers", "expert", "mlp", "embed"))
    else:
        F = cfg.mlp_dim
        out["w_gate"] = ((L, D, F), ("layers", "embed", "mlp"))
        out["w_up"] = ((L, D, F), ("layers", "embed", "mlp"))
        out["w_down"] = ((L, F, D), ("layers", "mlp", "embed"))
    return out


_LAYER_PARAMS = ("attn_norm", "ffw_norm", "q_norm", "k_norm", "wq", "wk", "wv", "wo", "bq", "bk",
                 "bv", "router", "w_gate", "w_up", "w_down")


class Llama(nnx.Module):
    """Llama-family decoder (dense or MoE) with stacked layer weights; shapes in :func:`param_layout`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 params: dict | None = None, quantization: str = "none"):
        """Builds the model from ``params`` (arrays in :func:`param_layout`, e.g.
        from ``model.gguf_loader`` or an orbax checkpoint) or random weights from ``rngs``.

        Args:
          dtype: weight and matmul-input dtype (float32 or bfloat16); norms, the
            router, softmax and accumulation are float32 regardless, and so is the
            lookup of a tied embedding table (``model.layers.param_dtype``).
          quantization: "none", or "int8": the layer matrices and the output head
            held as int8 with scales (``model.layers.set_params``); dense models only.

        Raises:
          ValueError: wrong architecture, missing or misshapen parameters, an
            unknown quantization, or int8 for a mixture-of-experts model.
        """
        if cfg.architecture != "llama":
            raise ValueError(f"Llama needs architecture: llama, got {cfg.architecture!r}")
        if quantization == "int8" and cfg.is_moe:
            raise ValueError(f"quantization int8 supports dense models only; {cfg.name} is a "
                             f"mixture of experts (serve it with quantization none)")
        self.cfg = cfg
        self.dtype = dtype
        if params is None:
            params = init_random_params(cfg, rngs or nnx.Rngs(0))
        layout = param_layout(cfg)
        check_params(params, layout)
        self.quantization = quantization
        set_params(self, params, layout, dtype, quantization, untied_embed=not cfg.tie_embeddings)
        self.embed_lookup = embed_lookup_param(params["embed"], dtype, cfg.tie_embeddings,
                                               quantized=quantization != "none")

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata, logits_indices: jax.Array,
                 compute: Compute = REFERENCE, lora: LoraInputs | None = None,
                 hidden_states: bool = False, aux_layers: tuple[int, ...] | None = None):
        """Same contract as ``model.gemma3.Gemma3.__call__``.

        Args:
          tokens: [T] int32; positions: [T] int32; kv_cache: all layers' pages;
          md: attention metadata; logits_indices: [S] int32; compute: platform-dependent
          choices (static; see ``model.compute``); lora: the resident LoRA adapters' stacks
          and each token's slot (``model.lora``; None: the base model; dense models only);
          hidden_states: also return every token's final-norm hidden state (for :meth:`head`);
          aux_layers: (static) layer ids i in 0..L whose input hidden states (the residual
            stream entering layer i; L: after the last layer, before the final norm) are
            also returned, for an EAGLE-3 draft head (``model.eagle3``). None (default):
            nothing more is computed.

        Returns:
          (logits [S, vocab] f32, updated kv_cache), then with ``hidden_states`` the hidden
          states [T, hidden] in the compute dtype, then with ``aux_layers``
          aux [T, len(aux_layers) * hidden] f32, every token's states concatenated in order.

        Raises:
          ValueError: a bidirectional model (``cfg.causal`` False), which only encodes;
            ``lora`` given for a mixture-of-experts model.
        """
        cfg, dtype = self.cfg, self.dtype
        theta = cfg.rope_theta_global

        def attend(h, p, l, window, cache, lw):
            o, k_cache, v_cache = attention_block(
                h, p, positions, cache[0], cache[1], md, l, cfg=cfg, theta=theta, window=window,
                dtype=dtype, compute=compute, lora=lw)
            return o, (k_cache, v_cache)

        x, (k_cache, v_cache), aux = self._layers(tokens, attend, (kv_cache.k, kv_cache.v), compute, lora,
                                                  aux_layers)
        if aux is not None:  # [A, T, D] -> [T, A * D]
            last = jnp.asarray([i == cfg.num_layers for i in aux_layers])[:, None, None]
            aux = jnp.where(last, x[None], aux)
            aux = jnp.moveaxis(aux, 0, 1).reshape(x.shape[0], -1)
        logits = self.head(rms_norm(x[logits_indices], self.final_norm[...], cfg.rms_norm_eps, compute), compute)
        out = (logits, KVCache(k_cache, v_cache))
        if hidden_states:
            out += (rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, compute),)
        if aux_layers is not None:
            out += (aux,)
        return out

    def head(self, x: jax.Array, compute: Compute = REFERENCE) -> jax.Array:
        """The LM head (the tied embedding or ``lm_head``): final-norm hidden states
        x [S, hidden] -> logits [S, vocab] float32."""
        if self.cfg.tie_embeddings:
            return compute.dot("sd,vd->sv", x, weight(self, "embed"), self.dtype)
        return compute.dot("sd,dv->sv", x, weight(self, "lm_head"), self.dtype)

    def encode(self, tokens: jax.Array, lengths: jax.Array, compute: Compute = REFERENCE) -> jax.Array:
        """Same contract as ``model.gemma3.Gemma3.encode``: [B, S] tokens, [B] lengths ->
        final-norm hidden states [B, S, hidden] f32 (Qwen3-Embedding's, causal)."""
        cfg = self.cfg
        B, S = tokens.shape
        positions = jnp.tile(jnp.arange(S, dtype=jnp.int32), B)

        def attend(h, p, l, window, state, lw):  # (no LoRA: lw is None)
            o = encode_attention_block(h, p, positions, lengths, cfg=cfg, theta=cfg.rope_theta_global,
                                       window=window, dtype=self.dtype, compute=compute)
            return o, state

        x, _, _ = self._layers(tokens.reshape(B * S), attend, (), compute)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, compute).reshape(B, S, -1)

    def _layers(self, tokens: jax.Array, attend, state, compute: Compute, lora: LoraInputs | None = None,
                aux_layers: tuple[int, ...] | None = None):
        """The embedding and the layer stack (one ``lax.scan``), attention by
        ``attend(h [T, D], layer weights, layer id, window, state, lw) -> (o [T, D], state)``
        (``lw``: this layer's LoRA, ``layers.with_lora``, or None; ``lora``: the stacks and
        token slots, or None). Returns (x [T, D] f32 before the final norm, state, aux):
        aux [A, T, D] f32 the input of each layer of ``aux_layers`` (an id L is left to the
        caller: x), None without them.

        Raises:
          ValueError: ``lora`` given for a mixture-of-experts model."""
        cfg, dtype = self.cfg, self.dtype
        x = embed_tokens(self, tokens)
        layout = param_layout(cfg)
        layer_params = {n: weight(self, n) for n in _LAYER_PARAMS if n in layout}
        eps = cfg.rms_norm_eps
        use_window = cfg.has_sliding_layers  # Mistral, Qwen3 with use_sliding_window
        if lora is not None and cfg.is_moe:
            raise ValueError(f"LoRA adapters on mixture-of-experts models ({cfg.name}) are not supported")

        aux_ids = None if aux_layers is None else jnp.asarray(aux_layers, jnp.int32)

        def layer(carry, xs):
            x, state, aux = carry
            p, l, window, lora_layer = xs
            if aux is not None:  # keep this layer's input where it is asked for
                aux = jnp.where((aux_ids == l)[:, None, None], x[None], aux)
            p = {name: compute.load(w) for name, w in p.items()}  # stored -> logical dtype
            p.update(compute.layer_view(resident, l))
            lw = None if lora_layer is None else (lora_layer, lora.token_slots)
            o, state = attend(rms_norm(x, p["attn_norm"], eps, compute), p, l, window, state, lw)
            h = x + o
            y = rms_norm(h, p["ffw_norm"], eps, compute)
            if cfg.is_moe:
                y = moe_ffn(y, p, k=cfg.num_experts_per_tok, dtype=dtype, compute=compute)
            else:
                dot = compute.dot
                gate = with_lora(dot("td,df->tf", y, p["w_gate"], dtype), y, lw, "w_gate", dtype, compute)
                up = with_lora(dot("td,df->tf", y, p["w_up"], dtype), y, lw, "w_up", dtype, compute)
                act = jax.nn.silu(gate) * up
                y = with_lora(dot("tf,fd->td", act, p["w_down"], dtype), act, lw, "w_down", dtype, compute)
            return (h + y, state, aux), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        # weights the int8 matmul reads in place in their stacks are closed over, not scanned
        layer_params, resident = compute.layer_weights(layer_params)
        # per-layer windows and LoRA stacks (None: scanned as nothing, the same program as without)
        xs = (layer_params, layer_ids, jnp.asarray(cfg.layer_windows(), jnp.int32) if use_window else None,
              None if lora is None else lora.weights)
        aux = None if aux_ids is None else jnp.zeros((len(aux_layers),) + x.shape, jnp.float32)
        (x, state, aux), _ = jax.lax.scan(layer, (x, state, aux), xs)
        return x, state, aux


def init_random_params(cfg: ModelConfig, rngs: nnx.Rngs) -> dict[str, jax.Array]:
    """Random float32 weights in :func:`param_layout` (normal / sqrt(fan_in); norms near 1),
    drawn on the host (``model.random_weights``)."""
    draw = RandomWeights(rngs)
    out = {}
    for name, (shape, _) in param_layout(cfg).items():
        if name.endswith("norm"):
            out[name] = draw.norm_scale(shape)
            continue
        fan_in = {"wo": cfg.num_heads * cfg.head_dim, "embed": cfg.hidden_size}.get(
            name, shape[-2] if name not in ("wq", "wk", "wv") else cfg.hidden_size)
        out[name] = draw.normal(shape, fan_in)
    return out
