"""The EAGLE-3 draft head: its checkpoint format and its forward over a paged KV cache of one layer.

EAGLE-3 (Li, Wei, Zhang, Zhang, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", 2025; the EAGLE repository's ``cnets.py``, vLLM's
``llama_eagle3.py`` and SGLang's ``llama_eagle3.py`` read for the format) drafts from the
*target's* hidden states rather than from tokens alone. The code here is our own.

Checkpoint, as published for Llama 3.1 8B (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): a
``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``, the Llama fields of ONE
decoder layer (``hidden_size``, heads, ``intermediate_size``, RoPE), ``vocab_size`` (the
target's), ``draft_vocab_size`` and optionally ``target_hidden_size`` (default
``hidden_size``) and ``eagle_config.eagle_aux_hidden_state_layer_ids``; and safetensors
(HF [out, in] matrices)::

    fc.weight                           [D, 3 * Dt]   fuses three target layers' hidden states
    midlayer.input_layernorm.weight     [D]           on the token embedding
    midlayer.hidden_norm.weight         [D]           on the hidden state
    midlayer.self_attn.{q,k,v}_proj.weight [N*H | K*H, 2 * D]   attention over [embedding; hidden]
    midlayer.self_attn.o_proj.weight    [D, N * H]
    midlayer.post_attention_layernorm.weight [D]
    midlayer.mlp.{gate,up}_proj.weight  [F, D];  midlayer.mlp.down_proj.weight [D, F]
    norm.weight                         [D]
    lm_head.weight                      [Vd, D]       over the draft vocabulary
    d2t                                 [Vd] int      target id = draft id + d2t[draft id]
    t2d                                 [V] bool      target ids that the draft vocabulary holds
    embed_tokens.weight                 [V, D]        optional: absent, the target's table is used

Forward of one position (``__call__``; ``e`` the token's embedding, ``g`` the hidden input)::

    g = fc(concat(target hidden states of the aux layers))   (the target's features, [3 Dt] -> [D]),
        or the head's own previous output (its later draft steps; already [D])
    a = attn(concat(rms(e; input_layernorm), rms(g; hidden_norm)))   q, k, v from 2 D inputs
    h = g + a;  out = h + mlp(rms(h; post_attention_layernorm))
    logits = rms(out; norm) @ lm_head                        over the draft vocabulary,
             scattered to target ids through d2t (-inf elsewhere)

Position t of the head's cache holds the token at t + 1 with the target's hidden state at t
(the features of a position predict the token two ahead), so a draft step at position t feeds
(token t + 1, hidden t) and proposes token t + 2; the serving side
(``serving.engine.eagle3_draft``) keeps that alignment.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.attention import paged_attention, write_kv_pages
from kernels_pallas.kv_quant import logical_kv_dtype
from model.attention_metadata import AttentionMetadata
from model.compute import REFERENCE, Compute
from model.config import ModelConfig
from model.hf_config import config_from_hf
from model.kv_cache import KVCache
from model.layers import param, project_qkv, rms_norm
from model.random_weights import RandomWeights

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shapes.

    Attributes:
      layer: the one decoder layer's config (``num_layers`` 1; ``vocab_size`` the target's).
      draft_vocab_size: Vd, the rows of ``lm_head``.
      target_hidden_size: Dt, the target's width (``fc`` takes 3 * Dt).
      aux_layer_ids: the target layers whose input hidden states it fuses (None: the
        default of :func:`aux_layers`).
      has_embedding: the checkpoint has its own ``embed_tokens`` (else the target's is used).
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    has_embedding: bool = False


def is_eagle3_config(d: Mapping[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is an EAGLE-3 head's."""
    return ARCHITECTURE in (d.get("architectures") or ())


def config_from_json(d: Mapping[str, Any], has_embedding: bool = False) -> Eagle3Config:
    """The head's config from its ``config.json``.

    Raises:
      ValueError: not an EAGLE-3 config, more than one layer, a missing field (named).
    """
    if not is_eagle3_config(d):
        raise ValueError(f"not an EAGLE-3 head: architectures {d.get('architectures')!r}, expected "
                         f"[{ARCHITECTURE!r}]")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"an EAGLE-3 head has one decoder layer, config says {d['num_hidden_layers']}")
    if "draft_vocab_size" not in d:
        raise ValueError("EAGLE-3 config lacks 'draft_vocab_size'")
    layer = config_from_hf({**d, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                            "tie_word_embeddings": False}, name="eagle3-head")
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or d.get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer, int(d["draft_vocab_size"]), int(d.get("target_hidden_size") or layer.hidden_size),
                        None if not ids else tuple(int(i) for i in ids), has_embedding)


def aux_layers(cfg: Eagle3Config, target_layers: int) -> tuple[int, int, int]:
    """The target layers whose *input* hidden states (the residual stream entering layer i;
    i = target_layers: the last layer's output, before the final norm) the head fuses.

    EAGLE-3's default (vLLM's, the EAGLE repository's): layers 2, L // 2 and L - 3 (low,
    middle, high), clamped to 0..L for targets of few layers; or the config's
    ``eagle_aux_hidden_state_layer_ids``.

    Raises:
      ValueError: not three ids, or one outside 0..L.
    """
    L = target_layers
    ids = cfg.aux_layer_ids or (min(2, L), L // 2, max(L - 3, 0))
    if len(ids) != 3 or not all(0 <= i <= L for i in ids):
        raise ValueError(f"EAGLE-3 fuses three target layers in 0..{L}, got {ids}")
    return tuple(ids)


def param_layout(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in our layout ([in, out] matrices; D = hidden, Dt = the
    target's hidden, N/K/H heads, kv heads, head size, F = mlp, V / Vd = target / draft vocab)."""
    c = cfg.layer
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
    out = {
        "fc": (3 * cfg.target_hidden_size, D),
        "input_norm": (D,), "hidden_norm": (D,), "post_attn_norm": (D,), "final_norm": (D,),
        "wq": (2 * D, N, H), "wk": (2 * D, K, H), "wv": (2 * D, K, H), "wo": (N, H, D),
        "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D),
        "lm_head": (D, cfg.draft_vocab_size),
        "d2t": (cfg.draft_vocab_size,),
    }
    if cfg.has_embedding:
        out["embed"] = (c.vocab_size, D)
    return out


_HF_NAMES = {  # our name -> (checkpoint name, transform of the HF tensor)
    "fc": ("fc.weight", "T"),
    "input_norm": ("midlayer.input_layernorm.weight", None),
    "hidden_norm": ("midlayer.hidden_norm.weight", None),
    "post_attn_norm": ("midlayer.post_attention_layernorm.weight", None),
    "final_norm": ("norm.weight", None),
    "wq": ("midlayer.self_attn.q_proj.weight", "heads"),
    "wk": ("midlayer.self_attn.k_proj.weight", "heads"),
    "wv": ("midlayer.self_attn.v_proj.weight", "heads"),
    "wo": ("midlayer.self_attn.o_proj.weight", "out_heads"),
    "w_gate": ("midlayer.mlp.gate_proj.weight", "T"),
    "w_up": ("midlayer.mlp.up_proj.weight", "T"),
    "w_down": ("midlayer.mlp.down_proj.weight", "T"),
    "lm_head": ("lm_head.weight", "T"),
    "d2t": ("d2t", None),
    "embed": ("embed_tokens.weight", None),
}


def hf_name(name: str) -> str:
    """The checkpoint tensor name of our parameter ``name``."""
    return _HF_NAMES[name][0]


def load_checkpoint(path: str | os.PathLike, target_cfg: ModelConfig) -> tuple[Eagle3Config, dict[str, np.ndarray]]:
    """Reads an EAGLE-3 head directory (``config.json`` + ``*.safetensors``) for a target.

    Args:
      path: the directory.
      target_cfg: the served model's config (its vocabulary and width are checked).

    Returns:
      (config, parameters in :func:`param_layout`, float32 but ``d2t`` int32).

    Raises:
      ValueError: not an EAGLE-3 head; a target vocabulary or hidden size other than the
        served model's; a missing tensor or one of the wrong shape (named); ``d2t`` mapping
        outside the target vocabulary; ``t2d`` of the wrong length.
    """
    from safetensors import safe_open

    root = Path(path)
    d = json.loads((root / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as sf:
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k)
    cfg = config_from_json(d, has_embedding="embed_tokens.weight" in tensors)
    check_target(cfg, target_cfg)
    c = cfg.layer
    params = {}
    for name, shape in param_layout(cfg).items():
        key, how = _HF_NAMES[name]
        if key not in tensors:
            raise ValueError(f"EAGLE-3 checkpoint {root.name}: missing tensor {key!r}")
        t = np.asarray(tensors[key])
        hf_shape = (shape if how is None else shape[::-1] if how == "T"
                    else (shape[1] * shape[2], shape[0]) if how == "heads" else (shape[2], shape[0] * shape[1]))
        if tuple(t.shape) != tuple(hf_shape):
            raise ValueError(f"EAGLE-3 checkpoint {root.name}: {key} has shape {tuple(t.shape)}, expected "
                             f"{tuple(hf_shape)} (config: hidden {c.hidden_size}, target hidden "
                             f"{cfg.target_hidden_size}, draft vocabulary {cfg.draft_vocab_size})")
        if how is not None:  # HF [out, in] -> our [in, out] (heads split off)
            t = t.T.reshape(shape)
        params[name] = t.astype(np.int32 if name == "d2t" else np.float32)
    ids = np.arange(cfg.draft_vocab_size) + params["d2t"]
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"EAGLE-3 checkpoint {root.name}: d2t maps draft ids outside the target "
                         f"vocabulary of {c.vocab_size}")
    if "t2d" in tensors and tensors["t2d"].shape != (c.vocab_size,):
        raise ValueError(f"EAGLE-3 checkpoint {root.name}: t2d has shape {tensors['t2d'].shape}, "
                         f"expected ({c.vocab_size},)")
    return cfg, params


def check_target(cfg: Eagle3Config, target_cfg: ModelConfig) -> None:
    """Raises ValueError unless the head was made for a target of this vocabulary and width
    (and, without its own embedding table, of its own width), and the target is a Llama."""
    c = cfg.layer
    if target_cfg.architecture != "llama":
        raise ValueError(f"EAGLE-3 drafts for Llama-family targets; the served model is {target_cfg.architecture}")
    if c.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"EAGLE-3 head's vocab_size {c.vocab_size} is not the served model's "
                         f"{target_cfg.vocab_size}")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ValueError(f"EAGLE-3 head's target_hidden_size {cfg.target_hidden_size} is not the served "
                         f"model's hidden size {target_cfg.hidden_size}")
    if not cfg.has_embedding and c.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"EAGLE-3 head without embed_tokens has hidden size {c.hidden_size}: it needs "
                         f"the served model's ({target_cfg.hidden_size}) to share its embedding table")
    aux_layers(cfg, target_cfg.num_layers)


def random_params(cfg: Eagle3Config, rngs: nnx.Rngs) -> dict[str, np.ndarray]:
    """Random float32 weights in :func:`param_layout` (normal / sqrt(fan_in), norms near 1), with
    ``d2t`` the offsets of a draft vocabulary of every (V // Vd)-th target id (tests, benchmarks)."""
    draw = RandomWeights(rngs)
    out = {}
    for name, shape in param_layout(cfg).items():
        if name == "d2t":
            step = cfg.layer.vocab_size // cfg.draft_vocab_size
            out[name] = (np.arange(shape[0]) * (step - 1)).astype(np.int32)
        elif name.endswith("norm"):
            out[name] = np.asarray(draw.norm_scale(shape))
        else:
            fan_in = shape[0] if name != "wo" else shape[0] * shape[1]
            out[name] = np.asarray(draw.normal(shape, fan_in))
    return out


class Eagle3Head(nnx.Module):
    """An EAGLE-3 draft head (one Llama decoder layer over [embedding; hidden]); see the module
    docstring. Float weights only (no int8)."""

    def __init__(self, cfg: Eagle3Config, params: dict, target_embed: jax.Array | None = None, *,
                 dtype=jnp.float32):
        """Args:
          cfg: the head's config; params: arrays in :func:`param_layout`.
          target_embed: [V, D] the target's embedding table (needed when ``params`` has no
            ``embed``).
          dtype: matmul-input dtype (norms float32).

        Raises:
          ValueError: a missing or misshapen parameter, or no embedding table.
        """
        self.cfg = cfg
        self.dtype = dtype
        for name, shape in param_layout(cfg).items():
            if name not in params:
                raise ValueError(f"EAGLE-3 head: missing parameter {name}")
            if tuple(params[name].shape) != tuple(shape):
                raise ValueError(f"EAGLE-3 head: {name} has shape {tuple(params[name].shape)}, expected {shape}")
            kind = jnp.int32 if name == "d2t" else (jnp.float32 if name.endswith("norm") else dtype)
            setattr(self, name, param(jnp.asarray(params[name], kind), (None,) * len(shape)))
        if not cfg.has_embedding:
            if target_embed is None:
                raise ValueError("EAGLE-3 head without embed_tokens needs the target's embedding table")
            self.embed = param(jnp.asarray(target_embed, dtype), (None, None))

    @property
    def layer_cfg(self) -> ModelConfig:
        return self.cfg.layer

    def __call__(self, tokens: jax.Array, hidden: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata, compute: Compute = REFERENCE):
        """One forward over T tokens.

        Args:
          tokens: [T] int32 target ids; hidden: [T, 3 * Dt] the target's fused features or
            [T, D] the head's own previous outputs; positions: [T] int32; kv_cache: the
            head's one-layer cache; md: attention metadata (its slot mapping says where K/V go).

        Returns:
          (logits [T, V] float32 over target ids, -inf outside the draft vocabulary;
          out [T, D] float32 the hidden state before the final norm (the next step's input);
          kv_cache).
        """
        c, dtype = self.cfg.layer, self.dtype
        D, N, H = c.hidden_size, c.num_heads, c.head_dim
        eps = c.rms_norm_eps
        dot = compute.dot
        g = hidden.astype(jnp.float32)
        if g.shape[-1] != D:
            g = dot("ti,id->td", g, self.fc[...], dtype)
        e = self.embed[...][tokens].astype(jnp.float32)
        x = jnp.concatenate([rms_norm(e, self.input_norm[...], eps, compute),
                             rms_norm(g, self.hidden_norm[...], eps, compute)], axis=-1)
        p = {"wq": self.wq[...], "wk": self.wk[...], "wv": self.wv[...]}
        wide = dataclasses.replace(c, hidden_size=2 * D)
        q, k, v = project_qkv(x, p, positions, cfg=wide, theta=c.rope_theta_global, dtype=dtype, compute=compute)
        k_cache, v_cache = write_kv_pages(kv_cache.k, kv_cache.v, k, v, md.slot_mapping, layer=0)
        attn = paged_attention(q.astype(logical_kv_dtype(k_cache)), k_cache, v_cache, md, layer=0,
                               scale=c.attn_scale, config=compute.attention)
        T = tokens.shape[0]
        h = g + dot("te,ed->td", attn.reshape(T, N * H), self.wo[...].reshape(N * H, D), dtype)
        y = rms_norm(h, self.post_attn_norm[...], eps, compute)
        act = jax.nn.silu(dot("td,df->tf", y, self.w_gate[...], dtype)) * dot("td,df->tf", y, self.w_up[...], dtype)
        out = h + dot("tf,fd->td", act, self.w_down[...], dtype)
        draft_logits = dot("td,dv->tv", rms_norm(out, self.final_norm[...], eps, compute), self.lm_head[...], dtype)
        ids = jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32) + self.d2t[...]
        logits = jnp.full((T, c.vocab_size), -jnp.inf, jnp.float32).at[:, ids].set(
            draft_logits.astype(jnp.float32))
        return logits, out, KVCache(k_cache, v_cache)
