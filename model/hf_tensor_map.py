"""Which Hugging Face tensor becomes which parameter, per architecture, and how.

transformers names a checkpoint's tensors after its modules
(``model.layers.{i}.self_attn.q_proj.weight``, ...) and stores a linear layer
as ``nn.Linear.weight``: ``(out, in)``, ``y = x @ W.T``. Our decoders keep
einsum layouts with the layers (and experts) stacked on leading axes
(``model.llama.param_layout``, ``model.gemma3.Gemma3``), so each parameter is
one name pattern (``{i}`` = layer, ``{e}`` = expert) and a layout kind, as in
``model.gguf_tensor_map`` for GGUF names. HF's q/k rows are in rotate-half
order already (what ``model.layers.apply_rope`` uses): nothing is permuted.

Gemma 2's and 3's RMSNorm multiplies by ``1 + w`` (``Gemma3RMSNorm``); ours stores the
full multiplier, so their norms load with ``offset=1``.

Phi-3 fuses projections: ``self_attn.qkv_proj.weight`` ((N + 2K) * H, D) holds
the q rows, then k, then v; ``mlp.gate_up_proj.weight`` (2F, D) the gate rows,
then up (HF ``Phi3MLP``: ``gate, up = gate_up.chunk(2)``). Each of our
parameters reads its row range of the fused tensor (kinds "qkv_q", "qkv_k",
"qkv_v", "gate_up_gate", "gate_up_up"). Qwen2's q/k/v biases are kinds
"bias_q" / "bias_kv" ((N * H,) -> [N, H]).

:func:`read_block` turns one block of one of our parameters (the index a device
holds) into the reads of only those bytes from the HF tensor (a ``get_slice``
of ``safetensors``), so a device never reads another device's shard;
:func:`read_into` fills a preallocated block (in the serving dtype) a slab at a
time, so the host never holds the block twice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our parameters comes from.

    Attributes:
      pattern: the HF tensor name, with ``{i}`` (layer, stacked on our axis 0)
        and ``{e}`` (expert, stacked on the next axis) where it is per layer / expert.
      kind: layout kind of each HF tensor (see :func:`hf_shape`).
      offset: added to every value (1.0 for Gemma 3's norms).
    """

    pattern: str
    kind: str
    offset: float = 0.0

    @property
    def stacked_axes(self) -> int:
        return ("{i}" in self.pattern) + ("{e}" in self.pattern)


_LAYER = "layers.{i}."
_ATTENTION = {
    "wq": Source(_LAYER + "self_attn.q_proj.weight", "q"),
    "wk": Source(_LAYER + "self_attn.k_proj.weight", "kv"),
    "wv": Source(_LAYER + "self_attn.v_proj.weight", "kv"),
    "wo": Source(_LAYER + "self_attn.o_proj.weight", "out"),
}
_QK_NORM = {
    "q_norm": Source(_LAYER + "self_attn.q_norm.weight", "vector"),
    "k_norm": Source(_LAYER + "self_attn.k_norm.weight", "vector"),
}
_QKV_BIAS = {
    "bq": Source(_LAYER + "self_attn.q_proj.bias", "bias_q"),
    "bk": Source(_LAYER + "self_attn.k_proj.bias", "bias_kv"),
    "bv": Source(_LAYER + "self_attn.v_proj.bias", "bias_kv"),
}
_PHI3_FUSED = {
    "wq": Source(_LAYER + "self_attn.qkv_proj.weight", "qkv_q"),
    "wk": Source(_LAYER + "self_attn.qkv_proj.weight", "qkv_k"),
    "wv": Source(_LAYER + "self_attn.qkv_proj.weight", "qkv_v"),
    "w_gate": Source(_LAYER + "mlp.gate_up_proj.weight", "gate_up_gate"),
    "w_up": Source(_LAYER + "mlp.gate_up_proj.weight", "gate_up_up"),
}
_DENSE_MLP = {
    "w_gate": Source(_LAYER + "mlp.gate_proj.weight", "in"),
    "w_up": Source(_LAYER + "mlp.up_proj.weight", "in"),
    "w_down": Source(_LAYER + "mlp.down_proj.weight", "in"),
}
_MIXTRAL_MOE = {  # MixtralSparseMoeBlock: w1 = gate, w3 = up, w2 = down
    "router": Source(_LAYER + "block_sparse_moe.gate.weight", "in"),
    "w_gate": Source(_LAYER + "block_sparse_moe.experts.{e}.w1.weight", "in"),
    "w_up": Source(_LAYER + "block_sparse_moe.experts.{e}.w3.weight", "in"),
    "w_down": Source(_LAYER + "block_sparse_moe.experts.{e}.w2.weight", "in"),
}
_QWEN3_MOE = {
    "router": Source(_LAYER + "mlp.gate.weight", "in"),
    "w_gate": Source(_LAYER + "mlp.experts.{e}.gate_proj.weight", "in"),
    "w_up": Source(_LAYER + "mlp.experts.{e}.up_proj.weight", "in"),
    "w_down": Source(_LAYER + "mlp.experts.{e}.down_proj.weight", "in"),
}

_FUSED_MOE = {  # transformers v5's own layout (save_original_format=False), Mixtral and Qwen3-MoE
    "router": Source(_LAYER + "mlp.gate.weight", "in"),
    "w_gate": Source(_LAYER + "mlp.experts.gate_up_proj", "fused_gate"),
    "w_up": Source(_LAYER + "mlp.experts.gate_up_proj", "fused_up"),
    "w_down": Source(_LAYER + "mlp.experts.down_proj", "fused_down"),
}
FUSED_EXPERTS_PROBE = "layers.0.mlp.experts.gate_up_proj"
"""A tensor (after the prefix) only checkpoints in the fused expert layout hold."""

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers older conversions saved that are no weights (transformers skips them too)."""


def sources(arch: str, cfg: ModelConfig, prefix: str = "model.",
            head: str = "lm_head.weight", fused_experts: bool = False) -> dict[str, Source]:
    """{our parameter: Source} for ``config.json``'s architecture.

    Args:
      arch: an ``architectures`` entry (``model.hf_config.HF_ARCHITECTURES``).
      cfg: its config (tied head, QK-norm).
      prefix: what precedes ``layers.``, ``embed_tokens`` and ``norm`` ("model."; the
        language model of a Gemma3ForConditionalGeneration: "language_model.model."
        or "model.language_model.").
      head: the untied output head's name.
      fused_experts: MoE experts stored stacked per layer, as transformers v5
        holds them (``mlp.experts.gate_up_proj`` [E, 2F, D] = gate rows then up
        rows, ``mlp.experts.down_proj`` [E, D, F]), instead of one tensor per
        expert (every Mixtral and Qwen3-MoE release).
    """
    out = {
        "embed": Source(prefix + "embed_tokens.weight", "embed"),
        "final_norm": Source(prefix + "norm.weight", "vector"),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = Source(head, "in")
    extras = _layer_extras(arch, cfg)
    if fused_experts and cfg.is_moe:
        extras.update(_FUSED_MOE)
    layer = {k: dataclasses.replace(v, pattern=prefix + v.pattern)
             for k, v in {**_ATTENTION, **extras}.items()}
    out.update(layer)
    if arch.startswith(("Gemma2", "Gemma3")):
        out = {k: dataclasses.replace(v, offset=1.0) if v.kind == "vector" else v
               for k, v in out.items()}
    return out


def _layer_extras(arch: str, cfg: ModelConfig) -> dict[str, Source]:
    if arch.startswith(("Gemma2", "Gemma3")):
        norms = {
            "attn_norm": Source(_LAYER + "input_layernorm.weight", "vector"),
            "post_attn_norm": Source(_LAYER + "post_attention_layernorm.weight", "vector"),
            "ffw_norm": Source(_LAYER + "pre_feedforward_layernorm.weight", "vector"),
            "post_ffw_norm": Source(_LAYER + "post_feedforward_layernorm.weight", "vector"),
        }
        return {**norms, **(_QK_NORM if cfg.qk_norm else {}), **_DENSE_MLP}
    out = {
        "attn_norm": Source(_LAYER + "input_layernorm.weight", "vector"),
        "ffw_norm": Source(_LAYER + "post_attention_layernorm.weight", "vector"),
    }
    if cfg.qk_norm:
        out.update(_QK_NORM)
    if cfg.qkv_bias:
        out.update(_QKV_BIAS)
    if not cfg.is_moe:
        out.update(_DENSE_MLP)
    elif arch == "MixtralForCausalLM":
        out.update(_MIXTRAL_MOE)
    else:
        out.update(_QWEN3_MOE)
    if arch == "Phi3ForCausalLM":
        out.update(_PHI3_FUSED)
    return out


def tensor_names(src: Source, cfg: ModelConfig) -> list[str]:
    """Every HF tensor name a Source reads."""
    layers = range(cfg.num_layers) if "{i}" in src.pattern else [None]
    experts = range(cfg.num_experts) if "{e}" in src.pattern else [None]
    return [src.pattern.format(i=i, e=e) for i in layers for e in experts]


def hf_shape(kind: str, ours: Sequence[int], cfg: ModelConfig | None = None) -> tuple[int, ...]:
    """The HF tensor shape behind our per-tensor shape ``ours``.

    Phi-3's fused kinds need ``cfg`` (the fused tensor's other parts):
    "qkv_q" / "qkv_k" / "qkv_v" ours [D, N or K, H] -> ((N + 2K) * H, D);
    "gate_up_gate" / "gate_up_up" ours [D, F] -> (2F, D). "bias_q" / "bias_kv"
    [N, H] -> (N * H,).

    kinds: "vector" [n] and "embed" [V, D] as stored; "in" (out, in) -> ours
    [in, out] (also the router (E, D) -> [D, E], each expert's (F, D) -> [D, F]);
    "q" / "kv" (N*H, D) -> [D, N, H]; "out" (D, N*H) -> [N, H, D]; a layer's
    fused experts: "fused_gate" / "fused_up" (E, 2F, D) (rows [:F] / [F:]) ->
    [E, D, F], "fused_down" (E, D, F) -> [E, F, D].
    """
    if kind in ("vector", "embed"):
        return tuple(ours)
    if kind in ("bias_q", "bias_kv"):
        return (ours[0] * ours[1],)
    if kind in _QKV_OFFSET:
        if cfg is None:
            raise ValueError(f"layout kind {kind!r} needs the config")
        return ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, ours[0])
    if kind in ("gate_up_gate", "gate_up_up"):
        return (2 * ours[1], ours[0])
    if kind == "in":
        return (ours[1], ours[0])
    if kind in ("q", "kv"):
        return (ours[1] * ours[2], ours[0])
    if kind == "out":
        return (ours[2], ours[0] * ours[1])
    if kind in ("fused_gate", "fused_up"):
        return (ours[0], 2 * ours[2], ours[1])
    if kind == "fused_down":
        return (ours[0], ours[2], ours[1])
    raise ValueError(f"unknown tensor layout kind {kind!r}")


_QKV_OFFSET = {"qkv_q": lambda cfg: 0, "qkv_k": lambda cfg: cfg.num_heads * cfg.head_dim,
               "qkv_v": lambda cfg: (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim}
"""The first row of each part of Phi-3's fused ``qkv_proj``."""


def _ranges(index: Sequence[slice], shape: Sequence[int]) -> list[range]:
    return [range(*s.indices(n)) for s, n in zip(index, shape)]


def read_block(src: Source, cfg: ModelConfig, shape: Sequence[int], index: Sequence[slice],
               read: Callable[[str, tuple[slice, ...]], np.ndarray]) -> np.ndarray:
    """The block ``index`` of our parameter (global ``shape``) from its HF tensors.

    Args:
      src: the parameter's Source.
      cfg: shapes (head_dim, layer and expert counts).
      shape: the parameter's global shape (stacked axes first).
      index: one slice per dimension (a device's block, e.g. from
        ``jax.make_array_from_callback``); steps must be 1.
      read: ``read(hf_name, hf_index) -> array`` reading only ``hf_index`` of the
        HF tensor (a safetensors ``get_slice``).

    Returns:
      The block in our layout, in the stored dtype (float32 where ``src.offset``
      was added); the caller casts.

    Rows of a "q"/"kv"/"out" tensor are read for whole heads: a block that
    splits ``head_dim`` reads its heads' full rows and keeps its columns.
    """
    ranges = _ranges(index, shape)
    if any(r.step != 1 for r in ranges):
        raise ValueError(f"{src.pattern}: strided blocks are not supported ({index})")
    n_stacked = src.stacked_axes
    stacked, inner = ranges[:n_stacked], ranges[n_stacked:]
    H = cfg.head_dim

    def one(name: str) -> np.ndarray:
        sl = [slice(r.start, r.stop) for r in inner]
        if src.kind in ("vector", "embed"):
            arr = read(name, tuple(sl))
        elif src.kind == "in":
            arr = read(name, (sl[1], sl[0])).T
        elif src.kind in ("q", "kv") or src.kind in _QKV_OFFSET:
            d, n, h = inner
            off = _QKV_OFFSET[src.kind](cfg) if src.kind in _QKV_OFFSET else 0
            rows = slice(off + n.start * H, off + n.stop * H)
            arr = read(name, (rows, sl[0])).reshape(len(n), H, len(d))
            arr = arr[:, h.start:h.stop, :].transpose(2, 0, 1)
        elif src.kind in ("bias_q", "bias_kv"):
            n, h = inner
            arr = read(name, (slice(n.start * H, n.stop * H),)).reshape(len(n), H)
            arr = arr[:, h.start:h.stop]
        elif src.kind in ("gate_up_gate", "gate_up_up"):
            d, f = sl
            off = cfg.mlp_dim if src.kind == "gate_up_up" else 0
            arr = read(name, (slice(f.start + off, f.stop + off), d)).T
        elif src.kind == "out":
            n, h, d = inner
            cols = slice(n.start * H, n.stop * H)
            arr = read(name, (sl[2], cols)).T.reshape(len(n), H, len(d))
            arr = arr[:, h.start:h.stop, :]
        elif src.kind in ("fused_gate", "fused_up"):
            e, d, f = sl
            off = cfg.expert_mlp_dim if src.kind == "fused_up" else 0
            arr = read(name, (e, slice(f.start + off, f.stop + off), d)).transpose(0, 2, 1)
        elif src.kind == "fused_down":
            e, f, d = sl
            arr = read(name, (e, d, f)).transpose(0, 2, 1)
        else:
            raise ValueError(f"unknown tensor layout kind {src.kind!r}")
        if src.offset:
            arr = arr.astype(np.float32) + np.float32(src.offset)
        return arr

    if n_stacked == 0:
        return one(src.pattern)
    if n_stacked == 1:
        if len(stacked[0]) == 1:  # one layer (a slab of read_into): no stacked copy
            return one(src.pattern.format(i=stacked[0][0]))[None]
        return np.stack([one(src.pattern.format(i=i)) for i in stacked[0]])
    return np.stack([np.stack([one(src.pattern.format(i=i, e=e)) for e in stacked[1]])
                     for i in stacked[0]])


SLAB_BYTES = 16 << 20
"""How much of a block :func:`read_into` reads at a time (at least one index of its axis 0:
one layer of a stacked parameter)."""


def read_into(src: Source, cfg: ModelConfig, shape: Sequence[int], index: Sequence[slice],
              read: Callable[[str, tuple[slice, ...]], np.ndarray], out: np.ndarray,
              slab_bytes: int = SLAB_BYTES) -> np.ndarray:
    """Fills ``out`` with the block ``index`` of our parameter, slab by slab along axis 0.

    Each slab (a run of rows of axis 0, e.g. one layer of a stacked parameter, holding
    about ``slab_bytes`` of ``out``) is read by :func:`read_block` and cast into
    ``out``'s dtype as it is copied, so the host holds ``out`` plus one slab, never the
    block twice (nor the block in the stored dtype beside the serving one).

    Args:
      src, cfg, shape, index, read: as for :func:`read_block`.
      out: the block's array ([the block's shape], the serving dtype), written in place.
      slab_bytes: bytes of ``out`` per read (at least one row of axis 0).

    Returns:
      ``out``.

    Raises:
      ValueError: ``out``'s shape is not the block's, or a strided block.
    """
    ranges = _ranges(index, shape)
    if any(r.step != 1 for r in ranges):
        raise ValueError(f"{src.pattern}: strided blocks are not supported ({index})")
    block = tuple(len(r) for r in ranges)
    if tuple(out.shape) != block:
        raise ValueError(f"{src.pattern}: out has shape {tuple(out.shape)}, the block {block}")
    if not block:
        out[...] = read_block(src, cfg, shape, index, read)
        return out
    row_bytes = max(1, out.nbytes // max(1, block[0]))
    step = max(1, slab_bytes // row_bytes)
    rows = ranges[0]
    for k in range(0, len(rows), step):
        sub = rows[k:k + step]
        sub_index = (slice(sub.start, sub.stop), *(slice(r.start, r.stop) for r in ranges[1:]))
        out[k:k + len(sub)] = read_block(src, cfg, shape, sub_index, read)
    return out
