"""Model configuration: one dataclass for the decoders in ``model/``.

``architecture`` picks the decoder: "gemma3" (``model.gemma3``: Gemma 3, and
Gemma 2 with ``qk_norm`` off) or "llama" (``model.llama``: Llama 3, Mistral,
Qwen2 with ``qkv_bias``, Qwen3, Phi-3 and, with ``num_experts > 0``, Mixtral /
Qwen3-MoE style mixture-of-experts). Filled from GGUF metadata
(``ModelConfig.from_gguf_metadata``) or from YAML in ``configs/``
(``ModelConfig.from_dict``), e.g. the ``tiny-random`` model used by unit tests
or ``configs/llama3-70b.yaml`` for planning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("gemma3", "llama")
ROPE_SCALING_TYPES = ("llama3", "linear", "yarn", "longrope")
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")
"""``general.architecture`` values ``from_gguf_metadata`` reads (llama.cpp's names)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder.

    Attributes:
      name: model name served on the API (e.g. "gemma-3-270m").
      vocab_size: number of token ids.
      num_layers: transformer blocks.
      hidden_size: model width ("embed").
      num_heads: query heads.
      num_kv_heads: key/value heads (1 = MQA; < num_heads = GQA).
      head_dim: per-head width.
      mlp_dim: GeGLU hidden width.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta_global: RoPE base for full-attention layers.
      rope_theta_local: RoPE base for sliding-window layers.
      sliding_window: window of the sliding layers, in tokens, counting the
        query itself: query i sees key j iff j <= i and i - j < sliding_window.
      sliding_window_pattern: layer i is global iff (i + 1) % pattern == 0
        (Gemma 3: 6, i.e. layers 5, 11, 17); 0 means every layer is global.
      sliding_layers: per-layer flags, True = a sliding-window layer (HF
        ``layer_types``); when given (one per layer) they replace
        ``sliding_window_pattern`` (Mistral: every layer; Qwen3 with
        ``use_sliding_window``: layers from ``max_window_layers`` on).
      query_pre_attn_scalar: attention scores are scaled by its rsqrt.
      max_position: the longest context the weights were trained for (tokens).
      attn_logit_softcap: optional tanh soft-cap on attention scores (None: off).
      final_logit_softcap: optional tanh soft-cap on output logits (None: off).
      tie_embeddings: logits = norm(h) @ embed.T (else a separate lm_head [D, V]).
      architecture: "gemma3" or "llama".
      qk_norm: per-head RMSNorm on q and k before RoPE (Gemma 3, Qwen3).
      rope_scaling_factor: RoPE scaling factor (None: unscaled), of type
        rope_scaling_type: "llama3" (Llama 3.1, with rope_low_freq_factor,
        rope_high_freq_factor, rope_original_max_position in tokens, as in HF's
        "llama3" rope_type), "linear" (every frequency divided by the factor) or
        "yarn" (rope_original_max_position, rope_yarn_beta_fast,
        rope_yarn_beta_slow, rope_attention_factor, rope_yarn_truncate; see
        ``model.layers.rope_inv_freq``). The gemma3 decoder scales its global
        layers only (HF's Gemma 3 runs its sliding layers with unscaled RoPE).
        "longrope" (Phi-3's "su" / "longrope"): rope_short_factors and
        rope_long_factors (one per rotated pair) divide the frequencies of
        positions below / from rope_original_max_position, and cos and sin are
        multiplied by rope_attention_factor (see ``model.layers.rope_inv_freq``);
        rope_scaling_factor is max_position / rope_original_max_position.
      rotary_dim: the leading width of each head that RoPE rotates (Phi-3's
        ``partial_rotary_factor``); 0 = head_dim. The rest passes unrotated.
      qkv_bias: q, k and v projections carry biases bq [N, H], bk, bv [K, H] (Qwen2).
      num_experts: MoE experts per layer (0: a dense MLP).
      num_experts_per_tok: experts each token is routed to (top-k).
      expert_mlp_dim: each expert's SwiGLU hidden width.
      causal: attention is causal (every decoder). False: bidirectional (EmbeddingGemma's
        ``use_bidirectional_attention``; a sliding layer then sees keys within
        ``sliding_window // 2`` on each side): the model only encodes (``encode``,
        embeddings); its paged prefill and decode raise ValueError.
    """

    name: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta_global: float = 1_000_000.0
    rope_theta_local: float = 10_000.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    query_pre_attn_scalar: float | None = None
    max_position: int = 32768
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_embeddings: bool = True
    architecture: str = "gemma3"
    qk_norm: bool = True
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_scaling_type: str = "llama3"
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    rope_yarn_truncate: bool = True
    sliding_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_mlp_dim: int = 0
    qkv_bias: bool = False
    rotary_dim: int = 0
    rope_short_factors: tuple[float, ...] = ()
    rope_long_factors: tuple[float, ...] = ()
    causal: bool = True

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.num_experts:
            if self.architecture != "llama":
                raise ValueError("mixture-of-experts layers need architecture: llama")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                                 f"got {self.num_experts_per_tok}")
            if self.expert_mlp_dim < 1:
                raise ValueError("an MoE config needs expert_mlp_dim >= 1")
        if self.rope_scaling_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling_type must be one of {ROPE_SCALING_TYPES}, "
                             f"got {self.rope_scaling_type!r}")
        # JSON (a checkpoint's config.json) gives a list; keep the dataclass hashable.
        object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
        for f in ("rope_short_factors", "rope_long_factors"):
            object.__setattr__(self, f, tuple(float(x) for x in getattr(self, f)))
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in 0..head_dim ({self.head_dim}), "
                             f"got {self.rotary_dim}")
        if self.rope_scaling_type == "longrope" and self.rope_scaling_factor is not None:
            half = self.rope_dim // 2
            if len(self.rope_short_factors) != half or len(self.rope_long_factors) != half:
                raise ValueError(f"longrope needs {half} short and long factors (rotary_dim / 2), "
                                 f"got {len(self.rope_short_factors)} and {len(self.rope_long_factors)}")
        if self.sliding_layers:
            if len(self.sliding_layers) != self.num_layers:
                raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries, "
                                 f"expected one per layer ({self.num_layers})")
            if any(self.sliding_layers) and self.sliding_window < 1:
                raise ValueError("sliding_layers marks sliding layers but sliding_window < 1")
        if self.architecture == "gemma3" and not self.tie_embeddings:
            raise ValueError("the gemma3 decoder ties its output head to the embedding")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def rope_dim(self) -> int:
        """The rotated width of each head (``rotary_dim``, else ``head_dim``)."""
        return self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_global_layer(self, layer: int) -> bool:
        if self.sliding_layers:
            return not self.sliding_layers[layer]
        p = self.sliding_window_pattern
        return p == 0 or (layer + 1) % p == 0

    def layer_windows(self) -> list[int]:
        """Per-layer attention window in tokens; 0 means unlimited (global)."""
        return [0 if self.is_global_layer(i) else self.sliding_window for i in range(self.num_layers)]

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w > 0 for w in self.layer_windows())

    def layer_rope_thetas(self) -> list[float]:
        return [
            self.rope_theta_global if self.is_global_layer(i) else self.rope_theta_local
            for i in range(self.num_layers)
        ]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Builds a config from a mapping (e.g. a YAML file); unknown keys raise ValueError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}; known: {sorted(fields)}")
        return cls(**d)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Builds a config from GGUF key/value metadata (``{arch}.*`` keys, llama.cpp names).

        ``general.architecture`` (one of ``GGUF_ARCHITECTURES``) picks the decoder:

          * "gemma3" -> gemma3. The local RoPE base (10k) is not stored in
            Gemma 3 GGUFs; it is the architecture's constant.
          * "gemma2" -> gemma3 without QK-norm: one RoPE base, sliding windows
            on layers 0, 2, ... (llama.cpp's swa pattern 2), ``attn_logit_softcapping``
            and ``final_logit_softcapping``; the attention scale is not stored, and
            is llama.cpp's rule: 1/sqrt(hidden / heads) for the 46-layer 27B,
            else 1/sqrt(key_length).
          * "qwen2" -> llama with q/k/v biases; "phi3" -> llama with
            ``rope.dimension_count`` the rotated width (partial rotary), every
            layer sliding when ``attention.sliding_window`` > 0, and LongRoPE when
            the GGUF holds ``rope_factors_short`` / ``rope_factors_long`` tensors
            (set by ``model.gguf_loader``; ``rope.scaling.attn_factor`` and
            ``rope.scaling.original_context_length`` read here).
          * "llama" (Llama 2/3, and Mixtral with ``llama.expert_count``),
            "qwen3" and "qwen3moe" (QK-norm) -> llama. head_dim is
            ``attention.key_length``, else ``rope.dimension_count``, else
            hidden / heads; the expert width is ``expert_feed_forward_length``
            (Qwen3-MoE), else ``feed_forward_length`` (Mixtral).

        RoPE scaling: ``{arch}.rope.scaling.type`` "linear" (Gemma 3 4B and up:
        factor 8, global layers only) or "yarn" with ``.factor``,
        ``.original_context_length`` and, where present, ``.yarn_beta_fast``,
        ``.yarn_beta_slow``, ``.yarn_attn_factor`` (else HF's defaults: 32, 1,
        ``0.1 ln(factor) + 1``), as llama.cpp's converter writes HF's
        ``rope_scaling``; "none" or a factor of 1 is unscaled.

        Not in the metadata, set by ``model.gguf_loader`` from the tensors:
        ``tie_embeddings`` (whether ``output.weight`` exists; ``meta["tie_embeddings"]``
        if given) and Llama 3.1 RoPE scaling (the ``rope_freqs`` tensor).

        Raises:
          ValueError: an unsupported architecture, a required key is missing, or
            RoPE scaling (e.g. "longrope", YaRN's ``yarn_log_multiplier``) or expert
            gating this decoder does not implement.
        """
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; this loader reads "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise ValueError(f"GGUF metadata lacks {full!r}")
            return default

        num_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = meta.get("tokenizer.ggml.tokens")
        common = dict(
            vocab_size=int(meta.get("vocab_size") or len(vocab)),
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta_global=float(get("rope.freq_base", 10_000.0)),
            max_position=int(get("context_length")),
        )
        common.update(_gguf_rope_scaling(meta, arch, common["max_position"]))
        if arch == "gemma3":
            head_dim = int(get("attention.key_length"))
            return cls(
                name=name or "gemma-3",
                head_dim=head_dim,
                mlp_dim=int(get("feed_forward_length")),
                rope_theta_local=10_000.0,
                sliding_window=int(get("attention.sliding_window")),
                sliding_window_pattern=6,
                query_pre_attn_scalar=float(head_dim),
                **common,
            )
        if arch == "gemma2":
            head_dim = int(get("attention.key_length", hidden // num_heads))
            layers = common["num_layers"]
            scalar = hidden // num_heads if layers == 46 else head_dim
            softcap = meta.get("gemma2.attn_logit_softcapping")
            final_cap = meta.get("gemma2.final_logit_softcapping")
            return cls(
                name=name or "gemma-2", qk_norm=False, head_dim=head_dim,
                mlp_dim=int(get("feed_forward_length")),
                rope_theta_local=common["rope_theta_global"],
                sliding_window=int(get("attention.sliding_window")), sliding_window_pattern=2,
                sliding_layers=tuple(not i % 2 for i in range(layers)),
                query_pre_attn_scalar=float(scalar),
                attn_logit_softcap=float(softcap) if softcap else None,
                final_logit_softcap=float(final_cap) if final_cap else None,
                **common)
        gating = int(get("expert_gating_func", 1))
        if gating != 1:  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise ValueError(f"GGUF {arch}.expert_gating_func={gating} is not supported (softmax only)")
        extra: dict[str, Any] = {}
        if arch == "phi3":  # rope.dimension_count is the rotated width, not the head's
            head_dim = int(get("attention.key_length", 0) or hidden // num_heads)
            rotary = int(get("rope.dimension_count", head_dim))
            window = int(get("attention.sliding_window", 0) or 0)
            extra = dict(rotary_dim=rotary if rotary != head_dim else 0,
                         rope_original_max_position=int(get(
                             "rope.scaling.original_context_length", common["max_position"])),
                         rope_attention_factor=meta.get("phi3.rope.scaling.attn_factor"))
            if window > 0:
                extra.update(sliding_window=window,
                             sliding_layers=(True,) * common["num_layers"])
        else:
            head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0)
                           or hidden // num_heads)
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"GGUF {arch}: value head width differs from key head width")
        experts = int(get("expert_count", 0) or 0)
        mlp = 0 if experts else int(get("feed_forward_length"))
        expert_mlp = int(get("expert_feed_forward_length", 0) or get("feed_forward_length")) if experts else 0
        default_name = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                        "qwen3moe": "qwen3-moe", "phi3": "phi3"}[arch]
        # {arch}.rope.scaling.* (common) wins over Phi-3's own reading of the same keys.
        fields = {"sliding_window": 0, "sliding_window_pattern": 0, **extra, **common}
        return cls(
            name=name or default_name, architecture="llama", qk_norm=arch in ("qwen3", "qwen3moe"),
            qkv_bias=arch == "qwen2", head_dim=head_dim, mlp_dim=mlp,
            num_experts=experts,
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            expert_mlp_dim=expert_mlp,
            tie_embeddings=bool(meta.get("tie_embeddings", False)),
            **fields)


GGUF_ROPE_SCALING_TYPES = ("none", "linear", "yarn")
"""``{arch}.rope.scaling.type`` values read (llama.cpp's ``RopeScalingType`` names)."""


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str, context_length: int) -> dict[str, Any]:
    """ModelConfig's RoPE scaling fields from ``{arch}.rope.scaling.*`` (``from_gguf_metadata``).

    The yarn defaults are HF's (``modeling_rope_utils._compute_yarn_parameters``):
    beta_fast 32, beta_slow 1, attention factor ``0.1 ln(factor) + 1``; the original
    context defaults to the GGUF's ``context_length``.
    """
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.rope.scaling.{name}", default)

    kind = str(key("type", "none"))
    if kind not in GGUF_ROPE_SCALING_TYPES:
        raise ValueError(f"GGUF {arch}.rope.scaling.type={kind!r} is not supported "
                         f"(supported: {', '.join(GGUF_ROPE_SCALING_TYPES)}; Llama 3.1 scaling "
                         "is read from the rope_freqs tensor)")
    factor = float(key("factor", 1.0) or 1.0)
    if kind == "none" or factor == 1.0:
        return {}
    if float(key("attn_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"GGUF {arch}.rope.scaling.attn_factor={key('attn_factor')} is not supported")
    if kind == "linear":
        return dict(rope_scaling_type="linear", rope_scaling_factor=factor)
    if float(key("yarn_log_multiplier", 0.0) or 0.0) != 0.0:
        raise ValueError(f"GGUF {arch}.rope.scaling.yarn_log_multiplier (DeepSeek's YaRN "
                         "mscale) is not supported")
    ext = key("yarn_ext_factor")
    if ext is not None and float(ext) not in (-1.0, 1.0):  # -1: llama.cpp's "1 for yarn"
        raise ValueError(f"GGUF {arch}.rope.scaling.yarn_ext_factor={float(ext)} is not supported "
                         "(only YaRN's full ramp, 1)")
    attention = key("yarn_attn_factor")
    return dict(rope_scaling_type="yarn", rope_scaling_factor=factor,
                rope_original_max_position=int(key("original_context_length", context_length)),
                rope_yarn_beta_fast=float(key("yarn_beta_fast", 32.0)),
                rope_yarn_beta_slow=float(key("yarn_beta_slow", 1.0)),
                rope_attention_factor=float(attention) if attention is not None
                else 0.1 * math.log(factor) + 1.0)
