"""Model configuration: one dataclass for the Gemma 3 family of decoders.

Filled from GGUF metadata (``ModelConfig.from_gguf_metadata``) or from a YAML
file in ``configs/`` (``ModelConfig.from_dict``), e.g. the ``tiny-random``
model used by unit tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Gemma-3-style decoder.

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
      tie_embeddings: logits = norm(h) @ embed.T.
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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

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
        if arch != "gemma3":
            raise ValueError(f"unsupported GGUF architecture {arch!r}; this loader reads 'gemma3'")

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise ValueError(f"GGUF metadata lacks {full!r}")
            return default

        num_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length"))
        vocab = meta.get("tokenizer.ggml.tokens")
        return cls(
            name=name or "gemma-3",
            vocab_size=int(meta.get("vocab_size") or len(vocab)),
            num_layers=int(get("block_count")),
            hidden_size=int(get("embedding_length")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv")),
            head_dim=head_dim,
            mlp_dim=int(get("feed_forward_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta_global=float(get("rope.freq_base")),
            rope_theta_local=10_000.0,
            sliding_window=int(get("attention.sliding_window")),
            sliding_window_pattern=6,
            query_pre_attn_scalar=float(head_dim),
            max_position=int(get("context_length")),
        )
