"""GGUF -> the parameter layout of our decoders, with an on-disk cache of the result.

One loader for every architecture ``ModelConfig.from_gguf_metadata`` reads,
dispatched on ``general.architecture``: "gemma3", "gemma2" (``model.gemma3``),
and "llama" (Llama 2/3, Mixtral), "qwen2" (q/k/v biases), "qwen3", "qwen3moe",
"phi3" (fused ``attn_qkv`` / ``ffn_up`` split here; LongRoPE factors from the
``rope_factors_*`` tensors) (``model.llama``, dense or MoE). The tensor names and layouts per architecture are in
``model.gguf_tensor_map``, including the undoing of llama.cpp's Q/K row
permutation for "llama" GGUFs.

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (the
same routine the golden reference used; any type it supports: F16, BF16,
Q4_0 ... Q8_0, the K-quants, IQ, TQ, MXFP4: :func:`dequantizable`); a tensor of
a type it does not read (e.g. I32, F64) is a ValueError naming the tensor and
the type before anything is dequantized. GGUF stores a linear layer as ``[ne0 = in, ne1 = out]``, so the
dequantized row-major array is ``(out, in)`` and ``y = x @ W.T``; we transpose
once here into einsum-friendly layouts.

With ``quantization="int8"``, a matmul weight stored in a block type whose
32-value blocks are ``d * q`` with small integers q (Q8_0, Q4_0, Q5_0; every
layer of a stacked weight) loads as a ``model.quantization.QuantizedArray``
of those integers and block scales instead, which dequantizes to exactly the
float32 values above (``model.quantization.gguf_blocks``); other types (Q4_K,
Q6_K, F16, ...) load as float32 and the model quantizes them per channel.

The loaded arrays are cached as ``.npy`` files (loaded with ``mmap_mode``)
under ``cache_dir``, keyed by the GGUF's name, size and mtime (and the
quantization), so a restart skips dequantization.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from model import gguf_tensor_map as tmap
from model.config import ModelConfig
from model.quantization import CONTRACTION_AXES, GGUF_BLOCK, QuantizedArray, check_quantization, gguf_blocks
from model.gguf_metadata import read_gguf_header

log = logging.getLogger(__name__)

_CACHE_FORMAT = 2  # 2: configs carry {arch}.rope.scaling.* (Gemma 3 4B+ linear)
EXACT_INT8_TYPES = ("Q8_0", "Q4_0", "Q5_0")
"""GGUF types held exactly as int8 with one float scale per 32 values."""
_EXACT_LAYOUTS = ("q", "kv", "in")  # layout kinds whose contraction is one axis (not "out", "experts")


def _config_from_metadata(metadata: dict, name: str | None, shapes: dict) -> ModelConfig:
    """``shapes``: tensor name -> GGUF shape (innermost dimension first)."""
    meta = {k: v for k, v in metadata.items() if not k.startswith(("tokenizer.", "GGUF."))}
    if "tokenizer.ggml.tokens" in metadata:
        meta["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    elif "token_embd.weight" in shapes:  # GGUF shape is [D, V]
        meta["vocab_size"] = int(shapes["token_embd.weight"][-1])
    meta["tie_embeddings"] = "output.weight" not in shapes
    return ModelConfig.from_gguf_metadata(meta, name=name)


def read_gguf_config(path: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """The model config from a GGUF's metadata alone (no tensor is read).

    Raises:
      ValueError: an architecture or metadata the config does not support.
    """
    header = read_gguf_header(path)
    return _config_from_metadata(header.metadata, name, {k: v[0] for k, v in header.tensors.items()})


@functools.cache
def dequantizable(qtype) -> bool:
    """Whether tensors of ``qtype`` (a ``gguf.GGMLQuantizationType``) load: F32, and every
    type the installed gguf-py's ``gguf.quants.dequantize`` implements (probed once, on
    one all-zero block: with gguf 0.19, F16, BF16, Q4_0 ... Q8_0, the K-quants Q2_K ..
    Q6_K, the IQ types, TQ1_0 / TQ2_0, MXFP4 and NVFP4; not Q8_1, Q8_K, Q1_0, the
    integer types nor F64)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if qtype == GGMLQuantizationType.F32:
        return True
    block, type_size = GGML_QUANT_SIZES[qtype]
    try:
        out = dequantize(np.zeros(type_size, np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return np.asarray(out).dtype.kind == "f" and np.asarray(out).size == block


def dequantizable_types() -> list[str]:
    """The names of every ``GGMLQuantizationType`` that :func:`dequantizable` accepts."""
    from gguf import GGMLQuantizationType

    return [t.name for t in GGMLQuantizationType if dequantizable(t)]


def check_tensor_types(tensors: dict, gguf_name: str) -> None:
    """Raises ValueError naming the first tensors (and their types) that do not load.

    Args:
      tensors: {name: ``gguf.ReaderTensor``}.
      gguf_name: the file's name, for the message.
    """
    bad = [(n, t.tensor_type.name) for n, t in tensors.items() if not dequantizable(t.tensor_type)]
    if bad:
        listed = ", ".join(f"{n!r} is {ty}" for n, ty in bad[:4])
        raise ValueError(f"GGUF {gguf_name}: tensor {listed}{' ...' if len(bad) > 4 else ''}: "
                         f"{'a type' if len(bad) == 1 else 'types'} xlaserve cannot dequantize "
                         f"(gguf {_gguf_version()} reads {', '.join(dequantizable_types())})")


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def _dequantize(tensor) -> np.ndarray:
    """One tensor as float32 in ``(out, in)`` order, equal to ``gguf.quants.dequantize``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    check_tensor_types({tensor.name: tensor}, "file")
    if tensor.tensor_type in (GGMLQuantizationType.F32,):
        arr = np.asarray(tensor.data, np.float32)
    else:
        arr = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    # The reader exposes GGUF's [ne0, ne1, ...] as numpy shape reversed: (out, in).
    return arr.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _blocks(tensor) -> QuantizedArray:
    """A 2-D Q8_0 / Q4_0 / Q5_0 tensor's integers and block scales, ``(out, in)`` order."""
    from gguf.constants import GGML_QUANT_SIZES

    deq = _dequantize(tensor)
    values, scales = gguf_blocks(np.asarray(tensor.data), deq, GGML_QUANT_SIZES[tensor.tensor_type][1])
    return QuantizedArray(values, scales)


def _exact_int8(tensor) -> bool:
    return tensor.tensor_type.name in EXACT_INT8_TYPES and len(tensor.shape) == 2


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.name}:{st.st_size}:{int(st.st_mtime)}:{_CACHE_FORMAT}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_gguf(
    path: str | os.PathLike,
    name: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    quantization: str = "none",
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads a GGUF: its config and its weights in our decoder's layout.

    Args:
      path: the GGUF file (``general.architecture`` one of ``model.config.GGUF_ARCHITECTURES``).
      name: the served model name for the config (default per architecture,
        e.g. "gemma-3", "llama").
      cache_dir: where the config and dequantized arrays are cached; None
        disables caching. A cache hit never opens the GGUF (parsing its
        262k-entry vocabulary alone takes ~12 s on a 2-core machine).
      progress: show a tqdm bar while dequantizing.
      quantization: "none", or "int8": matmul weights of the types in
        ``EXACT_INT8_TYPES`` come back as ``QuantizedArray`` (module docstring).

    Returns:
      (config, params) with float32 numpy arrays. gemma3: {"embed": [V, D],
      "final_norm": [D], "wq": [L, D, N, H], ...}, see ``model.gemma3.Gemma3``;
      llama family: ``model.llama.param_layout(config)``, e.g. wq [L, D, N, H]
      (rows un-permuted for "llama"), lm_head [D, V] when untied, and for MoE
      router [L, D, E], w_gate / w_up [L, E, D, F], w_down [L, E, F, D].
      With int8, ``QuantizedArray`` entries of numpy int8 values and float32
      scales [..., in / 32 on the contraction axis, ...] in the same layouts.

    Raises:
      ValueError: an unsupported architecture (naming it), a missing tensor
        (naming it), a tensor of a type that does not dequantize (naming both,
        :func:`check_tensor_types`), a tensor this decoder would ignore (e.g.
        biases, shared experts), unsupported RoPE scaling, or an unknown quantization.
    """
    path = Path(path)
    int8 = check_quantization(quantization) == "int8"
    prefix = "gguf-int8-" if int8 else "gguf-"
    cache = Path(cache_dir) / f"{prefix}{_cache_key(path)}" if cache_dir is not None else None
    if cache is None:
        return _read_gguf(path, name, int8, progress)
    from filelock import FileLock

    cache.parent.mkdir(parents=True, exist_ok=True)
    # One process dequantizes; others starting at once (replicas on one host, test workers)
    # wait for its cache instead of repeating the work.
    with FileLock(f"{cache}.lock"):
        cached = _load_cache(cache)
        if cached is None:
            cfg, params = _read_gguf(path, name, int8, progress)
            _save_cache(cache, cfg, params)
            return cfg, params
    cfg_dict, params = cached
    if name:
        cfg_dict["name"] = name
    return ModelConfig.from_dict(cfg_dict), params


def _read_gguf(path: Path, name: str | None, int8: bool, progress: bool
               ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``load_gguf``'s work without its cache."""
    from gguf import GGUFReader
    from tqdm import tqdm

    t0 = time.perf_counter()
    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    check_tensor_types(tensors, path.name)
    metadata = read_gguf_header(path).metadata  # fast; reader.fields' views are slow to convert
    cfg = _config_from_metadata(metadata, name, {k: tuple(int(d) for d in t.shape) for k, t in tensors.items()})
    arch = str(metadata["general.architecture"])
    used: set[str] = set()
    last: dict[str, np.ndarray] = {}

    def get(tname: str, blocks: bool = False):
        """The tensor dequantized, or with ``blocks`` as a QuantizedArray (an exact type)."""
        if tname not in tensors:
            raise ValueError(f"GGUF {path.name} ({arch}) lacks tensor {tname!r}")
        used.add(tname)
        if blocks:
            return _blocks(tensors[tname])
        if tname not in last:  # Phi-3's fused tensors are read once per part: dequantize once
            last.clear()
            last[tname] = _dequantize(tensors[tname])
        return last[tname]

    def exact(tname: str) -> bool:
        return int8 and tname in tensors and _exact_int8(tensors[tname])

    if arch in ("gemma2", "gemma3"):
        if "output.weight" in tensors:
            raise ValueError(f"untied output.weight is not supported by the {arch} model")
        layer_tensors = tmap.gemma_layer_tensors(cfg.qk_norm)
    else:
        layer_tensors = tmap.llama_layer_tensors(cfg.qk_norm, cfg.is_moe, cfg.qkv_bias,
                                                 fused_phi3=arch == "phi3")
        if "rope_factors_short.weight" in tensors or "rope_factors_long.weight" in tensors:
            cfg = _longrope(cfg, get("rope_factors_short.weight"), get("rope_factors_long.weight"))
        if "rope_freqs.weight" in tensors:
            scaling = tmap.llama3_rope_scaling(
                get("rope_freqs.weight"), cfg.head_dim, cfg.rope_theta_global,
                int(metadata.get(f"{arch}.rope.scaling.original_context_length", 8192)))
            if scaling:
                cfg = dataclasses.replace(cfg, **scaling)
    shape_kw = dict(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim)
    permuted = arch in tmap.PERMUTED_QK

    def layer_tensor(i: int, theirs: str, kind: str, blocks: bool = False):
        tname = f"blk.{i}.{theirs}" if theirs.endswith(".bias") else f"blk.{i}.{theirs}.weight"
        per_expert = f"blk.{i}.{theirs.removesuffix('_exps')}.{{}}.weight"
        if kind == "experts" and tname not in tensors and per_expert.format(0) in tensors:
            # older Mixtral GGUFs: one tensor per expert, blk.{i}.ffn_gate.{e}.weight
            arr = np.stack([get(per_expert.format(e)) for e in range(cfg.num_experts)])
        else:
            arr = get(tname, blocks)
        parts = (arr.values, arr.scales) if blocks else (arr,)
        if permuted and theirs == "attn_q":
            parts = tuple(tmap.unpermute_qk(a, cfg.num_heads) for a in parts)
        elif permuted and theirs == "attn_k":
            parts = tuple(tmap.unpermute_qk(a, cfg.num_kv_heads) for a in parts)
        if not blocks:
            return tmap.to_layout(parts[0], kind, **shape_kw)
        # the scales' contraction axis is hidden / 32 long: the same layout with that width
        block_kw = {**shape_kw, "hidden": shape_kw["hidden"] // GGUF_BLOCK}
        return QuantizedArray(tmap.to_layout(parts[0], kind, **shape_kw),
                              tmap.to_layout(parts[1], kind, **block_kw))

    def stacked_exact(ours: str, theirs: str, kind: str) -> bool:
        return (ours in CONTRACTION_AXES and kind in _EXACT_LAYOUTS
                and all(exact(f"blk.{i}.{theirs}.weight") for i in range(cfg.num_layers)))

    total = 3 + cfg.num_layers * len(layer_tensors)
    bar = tqdm(total=total, desc=f"dequantizing {path.name}", unit="tensor", disable=not progress)
    params: dict[str, np.ndarray] = {}
    params["embed"] = get("token_embd.weight", exact("token_embd.weight"))
    params["final_norm"] = get("output_norm.weight")
    if not cfg.tie_embeddings:
        head = get("output.weight", exact("output.weight"))  # (V, D) -> [D, V]
        params["lm_head"] = QuantizedArray(head.values.T, head.scales.T) if exact("output.weight") else head.T
    bar.update(3)
    for ours, (theirs, kind) in layer_tensors.items():
        blocks = stacked_exact(ours, theirs, kind)
        stacked = []
        for i in range(cfg.num_layers):
            stacked.append(layer_tensor(i, theirs, kind, blocks))
            bar.update()
        params[ours] = (QuantizedArray(np.stack([a.values for a in stacked]),
                                       np.stack([a.scales for a in stacked]))
                        if blocks else np.stack(stacked))
    bar.close()
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"GGUF {path.name} ({arch}) has tensors this decoder does not use: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    log.info("dequantized %s in %.1f s", path.name, time.perf_counter() - t0)
    return cfg, params


def _longrope(cfg: ModelConfig, short: np.ndarray, long: np.ndarray) -> ModelConfig:
    """Phi-3's LongRoPE from llama.cpp's ``rope_factors_short`` / ``rope_factors_long``
    tensors (HF's ``short_factor`` / ``long_factor``, one per rotated pair); the factor
    is ``context_length / rope.scaling.original_context_length`` (HF's rule)."""
    short, long = (np.asarray(a, np.float64).reshape(-1) for a in (short, long))
    factor = cfg.max_position / cfg.rope_original_max_position
    return dataclasses.replace(
        cfg, rope_scaling_type="longrope", rope_scaling_factor=float(factor),
        rope_short_factors=tuple(float(x) for x in short),
        rope_long_factors=tuple(float(x) for x in long))


def _load_cache(d: Path) -> tuple[dict, dict[str, np.ndarray]] | None:
    index = d / "index.json"
    if not index.exists():
        return None
    try:
        idx = json.loads(index.read_text())
        params = {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in idx["arrays"]}
        for n in idx.get("quantized", ()):  # int8 integers and their block scales
            params[n] = QuantizedArray(np.load(d / f"{n}.values.npy", mmap_mode="r"),
                                       np.load(d / f"{n}.scales.npy", mmap_mode="r"))
        return idx["config"], params
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring unreadable weight cache %s: %s", d, e)
        return None


def _save_cache(d: Path, cfg: ModelConfig, params: dict[str, np.ndarray]) -> None:
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    quantized = sorted(n for n, a in params.items() if isinstance(a, QuantizedArray))
    for n, a in params.items():
        if isinstance(a, QuantizedArray):
            np.save(tmp / f"{n}.values.npy", np.asarray(a.values))
            np.save(tmp / f"{n}.scales.npy", np.asarray(a.scales))
        else:
            np.save(tmp / f"{n}.npy", a)
    (tmp / "index.json").write_text(json.dumps({
        "arrays": sorted(set(params) - set(quantized)), "quantized": quantized,
        "config": dataclasses.asdict(cfg)}))
    try:
        tmp.rename(d)
    except OSError:  # another process won the race; theirs is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
