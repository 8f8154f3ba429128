"""GGUF -> the Gemma3 parameter layout, with an on-disk cache of the result.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (the
same routine the golden reference used). GGUF stores a linear layer as
``[ne0 = in, ne1 = out]``, so the dequantized row-major array is ``(out, in)``
and ``y = x @ W.T``; we transpose once here into einsum-friendly layouts.

The dequantized float32 arrays are cached as ``.npy`` files (loaded with
``mmap_mode``) under ``cache_dir``, keyed by the GGUF's name, size and mtime,
so a restart skips dequantization.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from model.config import ModelConfig

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1
_LAYER_TENSORS = {
    # ours: (gguf name, transform)
    "attn_norm": ("attn_norm", "vector"),
    "post_attn_norm": ("post_attention_norm", "vector"),
    "ffw_norm": ("ffn_norm", "vector"),
    "post_ffw_norm": ("post_ffw_norm", "vector"),
    "q_norm": ("attn_q_norm", "vector"),
    "k_norm": ("attn_k_norm", "vector"),
    "wq": ("attn_q", "qkv"),
    "wk": ("attn_k", "kv"),
    "wv": ("attn_v", "kv"),
    "wo": ("attn_output", "out"),
    "w_gate": ("ffn_gate", "in"),
    "w_up": ("ffn_up", "in"),
    "w_down": ("ffn_down", "in"),
}


def read_metadata(reader) -> dict:
    """GGUF key/values as python scalars, strings and lists (the vocab as a list)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # pragma: no cover - exotic field types we do not use
            continue
    return meta


def load_config(path: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """Reads just the metadata of a GGUF into a :class:`ModelConfig`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    meta["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig.from_gguf_metadata(meta, name=name)


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32,):
        arr = np.asarray(tensor.data, np.float32)
    else:
        arr = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    # The reader exposes GGUF's [ne0, ne1, ...] as numpy shape reversed: (out, in).
    return arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _to_layout(arr: np.ndarray, kind: str, cfg: ModelConfig) -> np.ndarray:
    D, H = cfg.hidden_size, cfg.head_dim
    if kind == "vector":
        return arr
    if kind == "qkv":  # (N*H, D) -> [D, N, H]
        return arr.T.reshape(D, cfg.num_heads, H)
    if kind == "kv":  # (K*H, D) -> [D, K, H]
        return arr.T.reshape(D, cfg.num_kv_heads, H)
    if kind == "out":  # (D, N*H) -> [N, H, D]
        return arr.T.reshape(cfg.num_heads, H, D)
    if kind == "in":  # (out, in) -> [in, out]
        return arr.T
    raise ValueError(kind)


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.name}:{st.st_size}:{int(st.st_mtime)}:{_CACHE_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_params(
    path: str | os.PathLike,
    cfg: ModelConfig,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Loads a Gemma 3 GGUF into the Gemma3 parameter dict (float32 numpy arrays).

    Args:
      path: the GGUF file.
      cfg: its config (``load_config``).
      cache_dir: where dequantized arrays are cached; None disables caching.
      progress: show a tqdm bar while dequantizing.

    Returns:
      {"embed": [V, D], "final_norm": [D], "wq": [L, D, N, H], ...} float32;
      see ``model.gemma3.Gemma3`` for every shape.

    Raises:
      ValueError: a tensor is missing or has an unexpected shape.
    """
    path = Path(path)
    if cache_dir is not None:
        cached = _load_cache(Path(cache_dir) / f"gguf-{_cache_key(path)}")
        if cached is not None:
            return cached

    from gguf import GGUFReader
    from tqdm import tqdm

    t0 = time.perf_counter()
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"GGUF {path.name} lacks tensor {name!r}")
        return _dequantize(tensors[name])

    names = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{g}.weight" for i in range(cfg.num_layers) for g, _ in _LAYER_TENSORS.values()
    ]
    bar = tqdm(total=len(names), desc=f"dequantizing {path.name}", unit="tensor", disable=not progress)
    params: dict[str, np.ndarray] = {}
    params["embed"] = get("token_embd.weight")
    bar.update()
    params["final_norm"] = get("output_norm.weight")
    bar.update()
    for ours, (theirs, kind) in _LAYER_TENSORS.items():
        stacked = []
        for i in range(cfg.num_layers):
            stacked.append(_to_layout(get(f"blk.{i}.{theirs}.weight"), kind, cfg))
            bar.update()
        params[ours] = np.stack(stacked)
    bar.close()
    if "output.weight" in tensors:
        raise ValueError("untied output.weight is not supported by the Gemma3 model")
    log.info("dequantized %s in %.1f s", path.name, time.perf_counter() - t0)
    if cache_dir is not None:
        _save_cache(Path(cache_dir) / f"gguf-{_cache_key(path)}", params)
    return params


def _load_cache(d: Path) -> dict[str, np.ndarray] | None:
    index = d / "index.json"
    if not index.exists():
        return None
    try:
        names = json.loads(index.read_text())["arrays"]
        return {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in names}
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring unreadable weight cache %s: %s", d, e)
        return None


def _save_cache(d: Path, params: dict[str, np.ndarray]) -> None:
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for n, a in params.items():
        np.save(tmp / f"{n}.npy", a)
    (tmp / "index.json").write_text(json.dumps({"arrays": sorted(params)}))
    try:
        tmp.rename(d)
    except OSError:  # another process won the race; theirs is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
