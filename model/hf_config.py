"""A Hugging Face ``config.json`` -> ``ModelConfig``, chosen by its ``architectures``.

Supported (``HF_ARCHITECTURES``): ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` (q/k/v biases), ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``
(fused ``qkv_proj`` / ``gate_up_proj``, LongRoPE, partial rotary),
``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` (the ``llama`` decoder, dense or
MoE, QK-norm for Qwen3), ``Gemma2ForCausalLM`` (the ``gemma3`` decoder without
QK-norm, with attention and final logit soft-capping), ``Gemma3ForCausalLM`` and the
language model of ``Gemma3ForConditionalGeneration`` (its ``text_config``; the
vision tower is skipped with a log line) (the ``gemma3`` decoder). The base models of
those classes (``BASE_MODELS``: ``Gemma3TextModel``, ``Qwen3Model``, ``LlamaModel``, ...), as
sentence-transformers saves an embedding model, read as their causal-LM class without a head;
``use_bidirectional_attention`` (EmbeddingGemma) makes a Gemma 3 config bidirectional
(``ModelConfig.causal`` False).

Field meanings follow transformers' configuration classes
(``configuration_llama.py``, ``configuration_mistral.py``,
``configuration_qwen2.py``, ``configuration_qwen3.py``, ``configuration_phi3.py``,
``configuration_gemma2.py``, ``configuration_mixtral.py``,
``configuration_qwen3_moe.py``, ``configuration_gemma3.py``). transformers
writes a ``config.json`` sparsely in places (a nested ``text_config`` holds only
what differs from ``Gemma3TextConfig``'s defaults; ``tie_word_embeddings`` is
left out when it equals the base default), so the class defaults a field falls
back to are listed here (``_DEFAULTS``), with transformers' values.

Both ways transformers has written RoPE are read: ``rope_theta`` +
``rope_scaling`` (v4, and every checkpoint on the hub before 2026), and
``rope_parameters`` (v5; per layer type for Gemma 3: ``{"full_attention": {...},
"sliding_attention": {...}}``). Scaling types: ``llama3``, ``linear``, ``yarn``,
``longrope`` (and its older name ``su``; Phi-3) (``model.layers.rope_inv_freq``);
any other is an error.

Per-layer sliding windows: Mistral / Mixtral ``sliding_window`` (every layer);
Phi-3 ``sliding_window`` (every layer, when set); Qwen2 / Qwen3 / Qwen3-MoE ``use_sliding_window`` with ``sliding_window`` from layer
``max_window_layers`` on; Gemma 3 ``sliding_window`` on the layers its
``sliding_window_pattern`` (every 6th global) marks; Gemma 2 on every other
layer (0, 2, ...); an explicit
``layer_types`` list (v4.53+) wins over the rules above.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

from model.config import ModelConfig

log = logging.getLogger(__name__)

HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
"""``config.json`` ``architectures`` values :func:`config_from_hf` reads (and the base models
of :data:`BASE_MODELS`)."""

BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
}
"""Base models (no LM head; tensors without the ``model.`` prefix), as sentence-transformers
saves an embedding model's transformer (EmbeddingGemma: ``Gemma3TextModel``; Qwen3-Embedding:
``Qwen3Model``), and the causal-LM class whose config fields they share. Their configs say
``tie_embeddings`` (nothing to read for a head); they serve embeddings only."""


def causal_lm_architecture(arch: str) -> str:
    """The causal-LM class whose fields and tensor names ``arch`` shares (itself, or a base
    model's, see :data:`BASE_MODELS`)."""
    return BASE_MODELS.get(arch, arch)

# Class defaults of the fields read here, where config.json may leave them out
# (transformers' configuration classes, v4.50 - v5).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                             max_position_embeddings=2048, hidden_act="silu"),
    "MistralForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                               max_position_embeddings=4096 * 32, hidden_act="silu",
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                             max_position_embeddings=32768, hidden_act="silu",
                             use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "Phi3ForCausalLM": dict(rms_norm_eps=1e-5, rope_theta=10_000.0, tie_word_embeddings=False,
                            max_position_embeddings=4096, original_max_position_embeddings=4096,
                            hidden_act="silu", sliding_window=None, partial_rotary_factor=1.0),
    # Gemma2Config (configuration_gemma2.py): Gemma 2 2B's widths.
    "Gemma2ForCausalLM": dict(vocab_size=256_000, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, rms_norm_eps=1e-6, rope_theta=10_000.0,
                              query_pre_attn_scalar=256, sliding_window=4096,
                              max_position_embeddings=8192, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0, tie_word_embeddings=True,
                              hidden_activation="gelu_pytorch_tanh"),
    "Qwen3ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                             max_position_embeddings=32768, hidden_act="silu",
                             use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "MixtralForCausalLM": dict(rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
                               max_position_embeddings=4096 * 32, hidden_act="silu",
                               num_local_experts=8, num_experts_per_tok=2),
    "Qwen3MoeForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                                max_position_embeddings=32768, hidden_act="silu",
                                use_sliding_window=False, sliding_window=4096,
                                max_window_layers=28, num_experts=128, num_experts_per_tok=8,
                                norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # Gemma3TextConfig (configuration_gemma3.py): Gemma 3 4B's text widths.
    "Gemma3ForCausalLM": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                              num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                              rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                              sliding_window=4096, sliding_window_pattern=6,
                              max_position_embeddings=131_072, final_logit_softcapping=None,
                              attn_logit_softcapping=None, tie_word_embeddings=True,
                              hidden_activation="gelu_pytorch_tanh"),
}
_DEFAULTS["Gemma3ForConditionalGeneration"] = _DEFAULTS["Gemma3ForCausalLM"]

_MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_GEMMA = ("Gemma2ForCausalLM",) + _GEMMA3
_USE_SLIDING_WINDOW = ("Qwen2ForCausalLM",) + _QK_NORM  # use_sliding_window + max_window_layers


def read_hf_config(model_dir: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face checkpoint directory (``DIR/config.json``).

    Args:
      model_dir: the checkpoint directory.
      name: the served model name (default: the directory's name).

    Raises:
      FileNotFoundError: no config.json in ``model_dir``.
      ValueError: see :func:`config_from_hf` (the message names the file).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face checkpoint")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    try:
        return config_from_hf(d, name=name or Path(model_dir).resolve().name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def hf_architecture(d: Mapping[str, Any]) -> str:
    """The one supported entry of ``d["architectures"]``.

    Raises:
      ValueError: none, several, or an unsupported one (listing what is supported).
    """
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if len(archs) != 1:
        raise ValueError(f"'architectures' must name one architecture, got {archs!r}; "
                         f"supported: {', '.join(HF_ARCHITECTURES)}")
    if archs[0] not in HF_ARCHITECTURES and archs[0] not in BASE_MODELS:
        raise ValueError(f"unsupported architecture {archs[0]!r}; "
                         f"supported: {', '.join(HF_ARCHITECTURES + tuple(BASE_MODELS))}")
    return archs[0]


def config_from_hf(d: Mapping[str, Any], name: str = "hf-model") -> ModelConfig:
    """Builds our config from a parsed ``config.json``.

    Args:
      d: the JSON object.
      name: the served model name.

    Returns:
      A ModelConfig: architecture "llama" (with experts for Mixtral / Qwen3-MoE)
      or "gemma3".

    Raises:
      ValueError: an unsupported architecture, a missing required field (named),
        or a feature this decoder does not implement (attention or MLP biases,
        an activation other than the architecture's, an unsupported RoPE
        scaling type, Qwen3-MoE without ``norm_topk_prob`` or with dense layers).
    """
    base = hf_architecture(d) in BASE_MODELS
    arch = causal_lm_architecture(hf_architecture(d))
    if arch == "Gemma3ForConditionalGeneration":
        if "text_config" not in d:
            raise ValueError("Gemma3ForConditionalGeneration without a 'text_config'")
        if d.get("vision_config") is not None:
            log.info("%s: the decoder's config; the vision tower is skipped here (model.vision_loader "
                     "reads it)", name)
        text = dict(d["text_config"])
        # The top level may carry what the nested config leaves out (transformers
        # keeps tie_word_embeddings at the top for composite models).
        for key in ("tie_word_embeddings",):
            if key not in text and key in d:
                text[key] = d[key]
        d = text
    defaults = _DEFAULTS[arch]

    def get(key: str, *, required: bool = True) -> Any:
        if key in d and d[key] is not None:
            return d[key]
        if key in defaults:
            return defaults[key]
        if required:
            raise ValueError(f"{arch}: config lacks {key!r}")
        return None

    causal = True
    if d.get("use_bidirectional_attention"):
        if arch not in _GEMMA3:
            raise ValueError(f"{arch}: use_bidirectional_attention=true is supported for Gemma 3 "
                             "(EmbeddingGemma) only")
        causal = False  # EmbeddingGemma: an encoder (model.gemma3.Gemma3.encode)
    if base:  # a base model has no head to read
        d = {**d, "tie_word_embeddings": True}
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"{arch}: {flag}=true is not supported (this decoder is causal, "
                             "without biases)")
    act_key = "hidden_activation" if arch in _GEMMA else "hidden_act"
    want_act = "gelu_pytorch_tanh" if arch in _GEMMA else "silu"
    act = d.get(act_key) or d.get("hidden_act") or defaults.get(act_key)
    if act != want_act:
        raise ValueError(f"{arch}: {act_key}={act!r} is not supported (only {want_act!r})")

    num_layers = int(get("num_hidden_layers"))
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    head_dim = int(d.get("head_dim") or defaults.get("head_dim") or hidden // heads)
    common = dict(
        name=name,
        vocab_size=int(get("vocab_size")),
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or defaults.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position=int(get("max_position_embeddings")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        causal=causal,
    )
    if arch == "Gemma2ForCausalLM":
        theta, scaling = _rope(d, defaults, arch, None)
        sliding = _layer_types(d, num_layers) or [not i % 2 for i in range(num_layers)]
        softcap, final_cap = (d.get(k, defaults[k]) for k in ("attn_logit_softcapping",
                                                                "final_logit_softcapping"))
        return ModelConfig(
            architecture="gemma3", qk_norm=False,
            mlp_dim=int(get("intermediate_size")),
            rope_theta_global=theta, rope_theta_local=theta,
            sliding_window=int(get("sliding_window")), sliding_window_pattern=2,
            sliding_layers=tuple(sliding),
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            attn_logit_softcap=float(softcap) if softcap is not None else None,
            final_logit_softcap=float(final_cap) if final_cap is not None else None,
            **_rope_fields(scaling, common["max_position"]), **common)
    if arch in _GEMMA3:
        theta, scaling = _rope(d, defaults, arch, "full_attention")
        per_type = d.get("rope_parameters")
        if isinstance(per_type, Mapping) and "sliding_attention" in per_type:
            theta_local, local_scaling = _rope(d, defaults, arch, "sliding_attention")
            if local_scaling:
                raise ValueError(f"{arch}: RoPE scaling on the sliding layers is not supported "
                                 "(Gemma 3 scales its global layers only)")
        else:
            theta_local = float(get("rope_local_base_freq"))
        pattern = int(get("sliding_window_pattern"))
        sliding = _layer_types(d, num_layers) or [bool((i + 1) % pattern) for i in range(num_layers)]
        softcap = d.get("attn_logit_softcapping")
        final_cap = d.get("final_logit_softcapping")
        return ModelConfig(
            architecture="gemma3", qk_norm=True,
            mlp_dim=int(get("intermediate_size")),
            rope_theta_global=theta, rope_theta_local=theta_local,
            sliding_window=int(get("sliding_window")), sliding_window_pattern=pattern,
            sliding_layers=tuple(sliding),
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            attn_logit_softcap=float(softcap) if softcap is not None else None,
            final_logit_softcap=float(final_cap) if final_cap is not None else None,
            **_rope_fields(scaling, common["max_position"]), **common)

    theta, scaling = _rope(d, defaults, arch, None)
    window, sliding = _llama_windows(arch, d, defaults, num_layers)
    extra: dict[str, Any] = {}
    if arch == "Qwen2ForCausalLM":
        extra["qkv_bias"] = True
    elif arch == "Phi3ForCausalLM":
        extra.update(_phi3_rope(d, defaults, scaling, head_dim, common["max_position"]))
        scaling = None  # read by _phi3_rope
    moe: dict[str, Any] = dict(num_experts=0, num_experts_per_tok=0, expert_mlp_dim=0,
                               mlp_dim=int(get("intermediate_size")))
    if arch == "MixtralForCausalLM":
        moe = dict(num_experts=int(get("num_local_experts")),
                   num_experts_per_tok=int(get("num_experts_per_tok")),
                   expert_mlp_dim=int(get("intermediate_size")), mlp_dim=0)
    elif arch == "Qwen3MoeForCausalLM":
        if not get("norm_topk_prob"):
            raise ValueError(f"{arch}: norm_topk_prob=false is not supported (the router "
                             "renormalises its top-k weights)")
        if int(get("decoder_sparse_step")) != 1 or list(get("mlp_only_layers")):
            raise ValueError(f"{arch}: dense layers among the MoE layers (decoder_sparse_step != 1 "
                             "or mlp_only_layers) are not supported")
        # transformers v5 writes num_experts as num_local_experts (its attribute_map)
        experts = d.get("num_experts") or d.get("num_local_experts") or defaults["num_experts"]
        moe = dict(num_experts=int(experts),
                   num_experts_per_tok=int(get("num_experts_per_tok")),
                   expert_mlp_dim=int(get("moe_intermediate_size")), mlp_dim=0)
    return ModelConfig(
        architecture="llama", qk_norm=arch in _QK_NORM,
        rope_theta_global=theta, rope_theta_local=theta,
        sliding_window=window, sliding_window_pattern=0, sliding_layers=tuple(sliding),
        **moe, **extra, **_rope_fields(scaling, common["max_position"]), **common)


def _phi3_rope(d: Mapping[str, Any], defaults: Mapping[str, Any], scaling: Mapping[str, Any] | None,
               head_dim: int, max_position: int) -> dict[str, Any]:
    """Phi-3's rotary width and LongRoPE fields (HF ``_compute_longrope_parameters``: the
    scaling factor is ``factor`` if given, else ``max_position_embeddings /
    original_max_position_embeddings``, the
    attention factor ``sqrt(1 + ln(factor) / ln(original))`` unless the config gives one)."""
    scaling = dict(scaling or {})
    v5 = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else {}
    partial = scaling.get("partial_rotary_factor", v5.get("partial_rotary_factor",
                                                          d.get("partial_rotary_factor")))
    partial = float(partial if partial is not None else defaults["partial_rotary_factor"])
    rotary = int(head_dim * partial)
    out: dict[str, Any] = {"rotary_dim": rotary if rotary != head_dim else 0}
    scaling.pop("partial_rotary_factor", None)
    if not scaling:
        return out
    kind = scaling["rope_type"]
    if kind != "longrope":
        raise ValueError(f"Phi3ForCausalLM: RoPE scaling {kind!r} is not supported "
                         "(only longrope / su)")
    # transformers gives the top-level original_max_position_embeddings priority (Phi-3's
    # config.json keeps it there), and computes the factor from it unless one is given
    original = d.get("original_max_position_embeddings") or scaling.get(
        "original_max_position_embeddings") or defaults["original_max_position_embeddings"]
    original = int(original)
    factor = float(scaling.get("factor") or max_position / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    out.update(rope_scaling_type="longrope", rope_scaling_factor=float(factor),
               rope_original_max_position=original, rope_attention_factor=float(attention),
               rope_short_factors=tuple(float(x) for x in scaling["short_factor"]),
               rope_long_factors=tuple(float(x) for x in scaling["long_factor"]))
    return out


def _layer_types(d: Mapping[str, Any], num_layers: int) -> list[bool] | None:
    """``layer_types`` as sliding flags, or None when the config has none."""
    types = d.get("layer_types")
    if types is None:
        return None
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must hold {num_layers} entries of 'sliding_attention' / "
                         f"'full_attention', got {types!r}")
    return [t == "sliding_attention" for t in types]


def _llama_windows(arch: str, d: Mapping[str, Any], defaults: Mapping[str, Any],
                   num_layers: int) -> tuple[int, list[bool]]:
    """(sliding window in tokens or 0, per-layer sliding flags) of a Llama-family config."""
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = d["sliding_window"] if "sliding_window" in d else defaults.get("sliding_window")
        flags = [window is not None] * num_layers
    elif arch == "Phi3ForCausalLM":
        window = d.get("sliding_window", defaults["sliding_window"])
        flags = [window is not None] * num_layers
    elif arch in _USE_SLIDING_WINDOW:
        use = d.get("use_sliding_window", defaults["use_sliding_window"])
        window = d.get("sliding_window", defaults["sliding_window"]) if use else None
        first = int(d.get("max_window_layers", defaults["max_window_layers"]))
        flags = [window is not None and i >= first for i in range(num_layers)]
    else:
        window, flags = None, [False] * num_layers
    explicit = _layer_types(d, num_layers)
    if explicit is not None:  # transformers >= 4.53 writes them out; they win
        window = d.get("sliding_window") or window
        flags = explicit
    if not any(flags):
        return 0, []
    if not window or int(window) < 1:
        raise ValueError(f"{arch}: sliding layers without a positive 'sliding_window'")
    return int(window), flags


_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _rope(d: Mapping[str, Any], defaults: Mapping[str, Any], arch: str,
          layer_type: str | None) -> tuple[float, dict | None]:
    """(RoPE base, the scaling dict or None) from ``rope_theta`` + ``rope_scaling`` (v4) or
    ``rope_parameters`` (v5, possibly per layer type)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", d.get("rope_theta"))
        scaling = dict(params)
    else:
        theta = d.get("rope_theta")
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if theta is None:
        theta = defaults["rope_theta"]
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "su":  # Phi-3's first name for LongRoPE
            kind = "longrope"
        if kind == "longrope" and arch != "Phi3ForCausalLM":
            raise ValueError(f"{arch}: RoPE scaling type 'longrope' is supported for "
                             "Phi3ForCausalLM only")
        if kind not in _ROPE_TYPES:
            raise ValueError(f"{arch}: RoPE scaling type {kind!r} is not supported "
                             f"(supported: {', '.join(_ROPE_TYPES[1:])})")
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return float(theta), scaling


def _rope_fields(scaling: Mapping[str, Any] | None, max_position: int) -> dict[str, Any]:
    """ModelConfig's RoPE scaling fields from an HF scaling dict (types as in HF's
    ``modeling_rope_utils``: the yarn attention factor defaults to
    ``0.1 ln(factor) + 1``, or ``get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim)`` when both are given; yarn's original context defaults to
    ``max_position_embeddings``)."""
    if scaling is None:
        return {}
    kind = scaling["rope_type"]
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    factor = scaling.get("factor")
    if kind == "linear":
        return dict(rope_scaling_type="linear", rope_scaling_factor=float(factor))
    if kind == "llama3":
        return dict(rope_scaling_type="llama3", rope_scaling_factor=float(factor),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_position=int(scaling["original_max_position_embeddings"]))
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    if factor is None:
        factor = max_position / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return dict(rope_scaling_type="yarn", rope_scaling_factor=factor,
                rope_original_max_position=original,
                rope_yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
                rope_yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
                rope_attention_factor=float(attention),
                rope_yarn_truncate=bool(scaling.get("truncate", True)))
