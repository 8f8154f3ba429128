"""LoRA adapters in PEFT's format: reading, validation and the adapter's digest.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models") adds to a linear layer ``y = x W`` a low-rank update::

    y = x W + s * (x A) B        A: [in, r], B: [r, out]
    s = lora_alpha / r           (rsLoRA, Kalajdzievski 2023: s = lora_alpha / sqrt(r))

PEFT's ``save_pretrained`` writes a folder with ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and
``adapter_model.safetensors``, whose tensors are named like
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in], the
torch ``nn.Linear`` layout) and ``...lora_B.weight`` ([out, r]). This module reads
such a folder against a decoder's ``ModelConfig`` for the Llama family (Llama,
Mistral, Qwen2/3) and Gemma 3, on the seven projections q/k/v/o/gate/up/down
(:data:`TARGETS`), and refuses, with a :class:`LoraAdapterError` saying why,
everything else: DoRA (``use_dora``), ``modules_to_save``, trained biases, per-module
rank or alpha patterns, ``layers_to_transform``, other target modules, a rank above
the server's ``--max-lora-rank``, tensors of the wrong shape or missing ones.

The :attr:`LoraAdapter.digest` hashes what changes the model's output (the rank,
alpha, rsLoRA, targets and every weight), not the adapter's name: the KV cache's
page hashes and the router's carry it, so two adapters never share KV pages and an
adapter reloaded with other weights under the same name never reuses stale ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from model.config import ModelConfig

TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
"""PEFT's target module name -> the decoder parameter it adapts."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served (the message says why)."""


def target_dims(cfg: ModelConfig, param: str) -> tuple[int, int]:
    """(in, out) features of the projection ``param`` ("wq", ..., "w_down") of ``cfg``'s decoder,
    heads folded into the features as the decoders' 2-D dots fold them."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F = cfg.mlp_dim
    return {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "wo": (N * H, D),
            "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}[param]


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter's weights on the host.

    Attributes:
      rank: ``r``.
      alpha: ``lora_alpha``.
      use_rslora: scaling by ``alpha / sqrt(r)`` instead of ``alpha / r``.
      weights: {decoder param ("wq", ...): (a [L, in, r], b [L, r, out]) float32}, for
        the adapted projections only (B not yet scaled).
      digest: hex sha256 of the config and the weights (see the module docstring).
      source: where it was read from (for messages).
    """

    rank: int
    alpha: float
    use_rslora: bool
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    digest: str
    source: str = ""

    @property
    def scaling(self) -> float:
        """``alpha / r``, or with rsLoRA ``alpha / sqrt(r)``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _fail(path: Path, why: str):
    raise LoraAdapterError(f"LoRA adapter {path}: {why}")


def _targets(path: Path, value) -> tuple[str, ...]:
    if value == "all-linear":  # PEFT: every linear layer but the output head
        return tuple(TARGETS)
    if isinstance(value, str) or not value:
        _fail(path, f"target_modules {value!r} is not supported; name modules among {sorted(TARGETS)}")
    out = []
    for name in value:
        short = str(name).rsplit(".", 1)[-1]
        if short not in TARGETS:
            _fail(path, f"target module {name!r} is not supported (supported: {', '.join(TARGETS)})")
        out.append(short)
    return tuple(sorted(set(out), key=list(TARGETS).index))


def read_config(path: Path, max_rank: int | None = None) -> dict:
    """Reads and checks ``adapter_config.json``: {"r", "lora_alpha", "use_rslora", "targets"}.

    Raises:
      LoraAdapterError: no such file, not JSON, not a LoRA adapter, a refused feature
        (DoRA, ``modules_to_save``, biases, rank/alpha patterns, ``layers_to_transform``,
        ``fan_in_fan_out``, ``lora_bias``, trainable tokens, target parameters, layer
        replication, aLoRA, ``exclude_modules``, unsupported targets) or ``r`` outside 1..``max_rank``.
    """
    file = path / CONFIG_FILE
    if not file.is_file():
        _fail(path, f"no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(path, f"{CONFIG_FILE} is not readable JSON ({e})")
    if not isinstance(raw, dict):
        _fail(path, f"{CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        _fail(path, f"peft_type {raw.get('peft_type')!r} is not LORA")
    if raw.get("use_dora"):
        _fail(path, "DoRA adapters (use_dora) are not supported")
    if raw.get("modules_to_save"):
        _fail(path, f"modules_to_save {raw['modules_to_save']!r} is not supported "
                    "(the adapter would replace whole layers of the base model)")
    if raw.get("bias", "none") != "none":
        _fail(path, f"bias {raw['bias']!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            _fail(path, f"{key} is not supported (one rank and alpha for every module)")
    if raw.get("layers_to_transform") is not None or raw.get("layers_pattern") is not None:
        _fail(path, "layers_to_transform / layers_pattern are not supported")
    for key in ("lora_bias", "trainable_token_indices", "target_parameters", "layer_replication",
                "alora_invocation_tokens", "exclude_modules"):
        if raw.get(key):
            _fail(path, f"{key} is not supported")
    if raw.get("fan_in_fan_out"):
        _fail(path, "fan_in_fan_out (GPT-2's Conv1D layout) is not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        _fail(path, f"r must be a positive integer, got {r!r}")
    if max_rank is not None and r > max_rank:
        _fail(path, f"rank {r} is above the server's --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    return {"r": r, "lora_alpha": float(alpha), "use_rslora": bool(raw.get("use_rslora", False)),
            "targets": _targets(path, raw.get("target_modules"))}


def read_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int | None = None) -> LoraAdapter:
    """Reads a PEFT LoRA adapter folder for a decoder of ``cfg``.

    Args:
      path: the folder (``adapter_config.json`` + ``adapter_model.safetensors``).
      cfg: the base model's config (dense Llama family or Gemma 3).
      max_rank: the largest rank the server serves (None: any).

    Returns:
      the adapter: A [L, in, r] and B [L, r, out] float32 per adapted projection.

    Raises:
      LoraAdapterError: see :func:`read_config`; a mixture-of-experts base; no weights file;
        tensors not of a LoRA on the targets, of the wrong shape, for layers the base
        lacks, or missing.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if cfg.is_moe:
        _fail(path, f"LoRA adapters on mixture-of-experts models ({cfg.name}) are not supported")
    conf = read_config(path, max_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        _fail(path, f"no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        _fail(path, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})")
    r, L = conf["r"], cfg.num_layers
    found: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            _fail(path, f"tensor {key!r} is not a LoRA A/B weight of a supported projection "
                        "(DoRA magnitudes, embeddings and biases are not supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in conf["targets"]:
            _fail(path, f"tensor {key!r} adapts {module}, which target_modules does not name")
        if layer >= L:
            _fail(path, f"tensor {key!r} is for layer {layer}; the base model has {L} layers")
        found.setdefault((module, which), {})[layer] = value
    weights = {}
    for module in conf["targets"]:
        param = TARGETS[module]
        d_in, d_out = target_dims(cfg, param)
        stacked = {}
        for which, shape in (("A", (r, d_in)), ("B", (d_out, r))):
            layers = found.get((module, which), {})
            missing = sorted(set(range(L)) - set(layers))
            if missing:
                _fail(path, f"no lora_{which} weight of {module} for layers {missing}")
            for i, w in layers.items():
                if tuple(w.shape) != shape:
                    _fail(path, f"layer {i} {module}.lora_{which} has shape {tuple(w.shape)}, expected "
                                f"{shape} (r {r}, the base model's {module} is {d_in} -> {d_out})")
            stacked[which] = np.stack([np.asarray(layers[i], np.float32) for i in range(L)])
        weights[param] = (np.ascontiguousarray(stacked["A"].transpose(0, 2, 1)),  # [L, in, r]
                          np.ascontiguousarray(stacked["B"].transpose(0, 2, 1)))  # [L, r, out]
    return LoraAdapter(rank=r, alpha=conf["lora_alpha"], use_rslora=conf["use_rslora"], weights=weights,
                       digest=adapter_digest(conf, weights), source=str(path))


def adapter_digest(conf: dict, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
    """Hex sha256 of the config that changes the output (r, alpha, rsLoRA, targets) and every
    weight's name, shape and float32 bytes."""
    h = hashlib.sha256(json.dumps({k: conf[k] for k in ("r", "lora_alpha", "use_rslora")},
                                  sort_keys=True).encode())
    for name in sorted(weights):
        for w in weights[name]:
            h.update(f"{name}{w.shape}".encode())
            h.update(np.ascontiguousarray(w, np.float32).tobytes())
    return h.hexdigest()
