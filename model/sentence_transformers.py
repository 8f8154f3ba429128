"""Sentence-transformers model directories: the modules after the transformer, read without torch.

A sentence-transformers directory (EmbeddingGemma, Qwen3-Embedding, ...) lists its modules in
``modules.json``, each with a ``type`` (a class path: ``sentence_transformers.models.Pooling``
in releases before 5, ``sentence_transformers.sentence_transformer.modules.pooling.Pooling``
since; only the class name is read) and a ``path`` (a subdirectory; "" for the root). Supported,
in this order:

  * ``Transformer`` (first, at the root or in its folder): a Hugging Face base model
    (``model.hf_config.BASE_MODELS``: ``Gemma3TextModel`` with ``use_bidirectional_attention``,
    ``Qwen3Model``, ...) and its tokenizer; ``max_seq_length`` from
    ``sentence_bert_config.json`` when it says one;
  * ``Pooling``: ``mean`` (the mean over the input's tokens), ``lasttoken`` (the last token's
    state: Qwen3-Embedding) or ``cls`` (the first token's), from ``pooling_mode`` (v5+) or the
    ``pooling_mode_*_tokens`` / ``pooling_mode_lasttoken`` flags (earlier releases);
  * ``Dense`` (any number): ``y = act(x W^T + b)`` with ``linear.weight`` [out, in] and
    ``linear.bias`` [out] from the folder's ``model.safetensors``; ``activation_function``
    Identity, Tanh, ReLU, Sigmoid or GELU;
  * ``Normalize``: divide by the L2 norm.

The order of these steps is sentence-transformers' ``SentenceTransformer.forward``; pooling
reads only the real tokens of a padded row (its length), so padding never changes an
embedding. ``config_sentence_transformers.json``'s ``matryoshka_dims`` (the sizes the model was
trained to be truncated to, largest first or in any order) are what the API's ``dimensions``
may ask for; a model without them is not Matryoshka.

Source of the module semantics: sentence-transformers' ``Pooling``, ``Dense`` and ``Normalize``
modules (sentence_transformer/modules/pooling.py, base/modules/dense.py, normalize.py, 6.2).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

POOLING_MODES = ("mean", "lasttoken", "cls")
ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": jnp.tanh,
    "ReLU": jax.nn.relu,
    "Sigmoid": jax.nn.sigmoid,
    "GELU": lambda x: jax.nn.gelu(x, approximate=False),
}
_LEGACY_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "lasttoken",
                   "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean"}

__all__ = ["DenseLayer", "EmbeddingHead", "is_sentence_transformer", "read_sentence_transformer"]


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """One ``Dense`` module: ``weight`` [out, in] float32, ``bias`` [out] float32 or None, and
    its activation's class name (a key of ``ACTIVATIONS``)."""

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str


@dataclasses.dataclass(frozen=True)
class EmbeddingHead:
    """What turns the transformer's hidden states into an embedding.

    Attributes:
      transformer_dir: the directory of the base model's ``config.json``, weights and tokenizer.
      pooling: one of ``POOLING_MODES``.
      dense: the Dense layers, in order.
      normalize: whether a Normalize module ends the pipeline.
      hidden_size: the transformer's width (the pooling's input).
      max_seq_length: the longest input the model takes, in tokens (None: the base model's
        ``max_position_embeddings``).
      matryoshka_dims: the sizes ``dimensions`` may truncate to (empty: not Matryoshka).
    """

    transformer_dir: Path
    pooling: str
    dense: tuple[DenseLayer, ...]
    normalize: bool
    hidden_size: int
    max_seq_length: int | None = None
    matryoshka_dims: tuple[int, ...] = ()

    @property
    def dim(self) -> int:
        """The embedding's width: the last Dense layer's output, else the hidden size."""
        return int(self.dense[-1].weight.shape[0]) if self.dense else self.hidden_size

    def __call__(self, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
        """Pooling, Dense layers and Normalize over a padded batch (jit-able; the weights are
        constants of the trace).

        Args:
          hidden: [B, S, hidden] float32, the transformer's final-norm states.
          lengths: [B] int32, each row's real tokens (>= 1).

        Returns:
          [B, dim] float32.
        """
        B, S, _ = hidden.shape
        if self.pooling == "mean":
            real = (jnp.arange(S)[None, :] < lengths[:, None]).astype(jnp.float32)
            x = jnp.einsum("bs,bsd->bd", real, hidden) / lengths[:, None].astype(jnp.float32)
        elif self.pooling == "lasttoken":
            x = hidden[jnp.arange(B), lengths - 1]
        else:  # cls
            x = hidden[:, 0]
        for layer in self.dense:
            x = jnp.einsum("bi,oi->bo", x, jnp.asarray(layer.weight), precision="highest")
            if layer.bias is not None:
                x = x + jnp.asarray(layer.bias)
            x = ACTIVATIONS[layer.activation](x)
        if self.normalize:  # sentence-transformers: F.normalize(x, p=2, dim=1), eps 1e-12
            x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
        return x


def is_sentence_transformer(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sentence-transformers model directory (it has ``modules.json``)."""
    return (Path(path) / "modules.json").is_file()


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, modules.json, ...) as a dict.

    Raises:
      FileNotFoundError: the file is missing (its path named).
      ValueError: it is not valid JSON.
    """
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _pooling_mode(cfg: dict, where: Path) -> str:
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [m for k, m in _LEGACY_POOLING.items() if cfg.get(k)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{where}: pooling {modes!r} is not supported (one of {', '.join(POOLING_MODES)})")
    return modes[0]


def _dense(folder: Path) -> DenseLayer:
    from safetensors.numpy import load_file

    cfg = read_json(folder / "config.json")
    act = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if act not in ACTIVATIONS:
        raise ValueError(f"{folder}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if cfg.get("use_residual"):
        raise ValueError(f"{folder}: Dense with use_residual is not supported")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors (pytorch_model.bin is not read: "
                                "convert it to safetensors)")
    tensors = load_file(str(weights))
    w = tensors.get("linear.weight")
    shape = (int(cfg["out_features"]), int(cfg["in_features"]))
    if w is None or w.shape != shape:
        raise ValueError(f"{weights}: 'linear.weight' must be {shape}, got "
                         f"{None if w is None else w.shape}")
    b = tensors.get("linear.bias")
    if cfg.get("bias", True) and b is None:
        raise ValueError(f"{weights}: 'linear.bias' is missing (the config says bias)")
    return DenseLayer(w.astype(np.float32), None if b is None else b.astype(np.float32), act)


def read_sentence_transformer(path: str | os.PathLike) -> EmbeddingHead:
    """Reads a sentence-transformers directory's modules (see the module docstring).

    Raises:
      FileNotFoundError: no ``modules.json``, or a file a module needs.
      ValueError: a module type, pooling mode or activation that is not supported, modules
        out of order, or Dense weights that disagree with their config.
    """
    root = Path(path)
    modules = read_json(root / "modules.json")
    if not isinstance(modules, list) or not modules:
        raise ValueError(f"{root / 'modules.json'}: expected a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if kinds[0] != "Transformer":
        raise ValueError(f"{root}: the first module must be a Transformer, got {kinds[0]!r}")
    transformer_dir = root / modules[0].get("path", "")
    hidden = int(read_json(transformer_dir / "config.json").get("hidden_size", 0))
    st_cfg_path = transformer_dir / "sentence_bert_config.json"
    st_cfg = read_json(st_cfg_path) if st_cfg_path.is_file() else {}
    pooling, dense, normalize = None, [], False
    for m, kind in zip(modules[1:], kinds[1:]):
        folder = root / m.get("path", "")
        if kind == "Pooling" and pooling is None and not dense:
            pooling = _pooling_mode(read_json(folder / "config.json"), folder)
        elif kind == "Dense" and pooling is not None and not normalize:
            dense.append(_dense(folder))
        elif kind == "Normalize" and pooling is not None and not normalize:
            normalize = True
        else:
            raise ValueError(f"{root}: module {kind!r} ({m.get('path')!r}) is not supported here; "
                             "expected Transformer, Pooling, Dense..., Normalize")
    if pooling is None:
        raise ValueError(f"{root}: no Pooling module")
    width = hidden
    for i, d in enumerate(dense):
        if d.weight.shape[1] != width:
            raise ValueError(f"{root}: Dense layer {i} takes {d.weight.shape[1]} inputs, gets {width}")
        width = d.weight.shape[0]
    cfg_path = root / "config_sentence_transformers.json"
    dims = (read_json(cfg_path).get("matryoshka_dims") or []) if cfg_path.is_file() else []
    dims = tuple(sorted({int(d) for d in dims}, reverse=True))
    if any(not 1 <= d <= width for d in dims):
        raise ValueError(f"{cfg_path}: matryoshka_dims {list(dims)} must lie in 1..{width}")
    max_len = st_cfg.get("max_seq_length")
    return EmbeddingHead(transformer_dir=transformer_dir, pooling=pooling, dense=tuple(dense),
                         normalize=normalize, hidden_size=hidden,
                         max_seq_length=int(max_len) if max_len else None, matryoshka_dims=dims)
