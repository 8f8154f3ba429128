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

import dataclasses
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


def _config_from_reader(reader, name: str | None) -> ModelConfig:
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith(("tokenizer.", "GGUF."))}
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


def load_gguf(
    path: str | os.PathLike,
    name: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads a Gemma 3 GGUF: its config and its weights in the Gemma3 layout.

    Args:
      path: the GGUF file.
      name: the served model name for the config (default "gemma-3").
      cache_dir: where the config and dequantized arrays are cached; None
        disables caching. A cache hit never opens the GGUF (parsing its
        262k-entry vocabulary alone takes ~12 s on a 2-core machine).
      progress: show a tqdm bar while dequantizing.

    Returns:
      (config, {"embed": [V, D], "final_norm": [D], "wq": [L, D, N, H], ...})
      with float32 numpy arrays; see ``model.gemma3.Gemma3`` for every shape.

    Raises:
      ValueError: not a gemma3 GGUF, or a tensor is missing / misshapen.
    """
    path = Path(path)
    cache = Path(cache_dir) / f"gguf-{_cache_key(path)}" if cache_dir is not None else None
    if cache is not None:
        cached = _load_cache(cache)
        if cached is not None:
            cfg_dict, params = cached
            if name:
                cfg_dict["name"] = name
            return ModelConfig.from_dict(cfg_dict), params

    from gguf import GGUFReader
    from tqdm import tqdm

    t0 = time.perf_counter()
    reader = GGUFReader(str(path))
    cfg = _config_from_reader(reader, name)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"GGUF {path.name} lacks tensor {name!r}")
        return _dequantize(tensors[name])

    if "output.weight" in tensors:
        raise ValueError("untied output.weight is not supported by the Gemma3 model")
    total = 2 + cfg.num_layers * len(_LAYER_TENSORS)
    bar = tqdm(total=total, desc=f"dequantizing {path.name}", unit="tensor", disable=not progress)
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
    log.info("dequantized %s in %.1f s", path.name, time.perf_counter() - t0)
    if cache is not None:
        _save_cache(cache, cfg, params)
    return cfg, params


def _load_cache(d: Path) -> tuple[dict, dict[str, np.ndarray]] | None:
    index = d / "index.json"
    if not index.exists():
        return None
    try:
        idx = json.loads(index.read_text())
        return idx["config"], {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in idx["arrays"]}
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring unreadable weight cache %s: %s", d, e)
        return None


def _save_cache(d: Path, cfg: ModelConfig, params: dict[str, np.ndarray]) -> None:
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for n, a in params.items():
        np.save(tmp / f"{n}.npy", a)
    (tmp / "index.json").write_text(
        json.dumps({"arrays": sorted(params), "config": dataclasses.asdict(cfg)}))
    try:
        tmp.rename(d)
    except OSError:  # another process won the race; theirs is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
