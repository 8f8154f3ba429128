"""Model configuration: one dataclass for the decoders in ``model/``.

``architecture`` picks the decoder: "gemma3" (``model.gemma3``) or "llama"
(``model.llama``: Llama 3 and, with ``num_experts > 0``, Mixtral / Qwen3-MoE
style mixture-of-experts). Filled from GGUF metadata
(``ModelConfig.from_gguf_metadata``) or from YAML in ``configs/``
(``ModelConfig.from_dict``), e.g. the ``tiny-random`` model used by unit tests
or ``configs/llama3-70b.yaml`` for planning.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

ARCHITECTURES = ("gemma3", "llama")


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
      query_pre_attn_scalar: attention scores are scaled by its rsqrt.
      max_position: the longest context the weights were trained for (tokens).
      attn_logit_softcap: optional tanh soft-cap on attention scores (None: off).
      final_logit_softcap: optional tanh soft-cap on output logits (None: off).
      tie_embeddings: logits = norm(h) @ embed.T (else a separate lm_head [D, V]).
      architecture: "gemma3" or "llama".
      qk_norm: per-head RMSNorm on q and k before RoPE (Gemma 3, Qwen3).
      rope_scaling_factor: Llama 3.1 RoPE scaling factor (None: unscaled), with
        rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position
        (tokens) as in HF's "llama3" rope_type.
      num_experts: MoE experts per layer (0: a dense MLP).
      num_experts_per_tok: experts each token is routed to (top-k).
      expert_mlp_dim: each expert's SwiGLU hidden width.
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
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_mlp_dim: int = 0

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
        if self.architecture == "gemma3" and not self.tie_embeddings:
            raise ValueError("the gemma3 decoder ties its output head to the embedding")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_global_layer(self, layer: int) -> bool:
        p = self.sliding_window_pattern
        return p == 0 or (layer + 1) % p == 0

    def layer_windows(self) -> list[int]:
        """Per-layer attention window in tokens; 0 means unlimited (global)."""
        return [0 if self.is_global_layer(i) else self.sliding_window for i in range(self.num_layers)]

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
        """Builds a config from GGUF key/value metadata (``gemma3.*`` keys).

        The local RoPE base (10k) is not stored in Gemma 3 GGUFs; it is the
        architecture's constant (see the reference README).

        Raises:
          ValueError: the architecture is not gemma3 or a required key is missing.
        """
        arch = meta.get("general.architecture")
        if arch not in ("gemma3", "llama"):
            raise ValueError(f"unsupported GGUF architecture {arch!r}; this loader reads 'gemma3' and 'llama'")

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
            num_kv_heads=int(get("attention.head_count_kv")),
            mlp_dim=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta_global=float(get("rope.freq_base", 10_000.0)),
            max_position=int(get("context_length")),
        )
        if arch == "llama":
            # Llama-family GGUFs (llama.cpp's "llama" covers Llama 2/3 and Mixtral).
            # Llama 3.1 RoPE scaling is stored as a rope_freqs tensor, which this
            # loader does not read yet: such GGUFs are refused by the loader.
            experts = int(get("expert_count", 0) or 0)
            mlp = common.pop("mlp_dim")
            return cls(
                name=name or "llama", architecture="llama", qk_norm=False,
                head_dim=int(get("rope.dimension_count", hidden // num_heads)),
                mlp_dim=0 if experts else mlp,
                num_experts=experts,
                num_experts_per_tok=int(get("expert_used_count", 0) or 0),
                expert_mlp_dim=mlp if experts else 0,
                sliding_window=0, sliding_window_pattern=0,
                tie_embeddings=bool(meta.get("tie_embeddings", False)),
                **common)
        head_dim = int(get("attention.key_length"))
        return cls(
            name=name or "gemma-3",
            head_dim=head_dim,
            rope_theta_local=10_000.0,
            sliding_window=int(get("attention.sliding_window")),
            sliding_window_pattern=6,
            query_pre_attn_scalar=float(head_dim),
            **common,
        )
