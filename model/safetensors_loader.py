"""Hugging Face checkpoints: ``config.json`` + ``*.safetensors`` -> our config and parameters.

Entry point: :func:`load_hf_checkpoint` (the config from ``model.hf_config``,
the tensors named by ``model.hf_tensor_map``).

Reading. The checkpoint is one ``model.safetensors`` or several files listed
by ``model.safetensors.index.json`` (``weight_map``: tensor -> file). A file is
opened with ``safetensors.safe_open`` (memory-mapped) and read tensor by tensor
through ``get_slice``, which copies only the requested block; it is unmapped
after each read, since the pages a read touches stay resident (and counted in
the process's memory) while the file is mapped.

Host memory. Each parameter's block is allocated once, in the serving dtype,
and filled a slab at a time (``model.hf_tensor_map.read_into``: one layer of a
stacked parameter), then handed to JAX: the host holds the placed parameters
plus one block in flight, never two copies of the weights
(``benchmarks.real_size`` measures the peak; tests/model/test_load_memory.py
holds it). The block is 64-byte aligned, so JAX's CPU client can adopt it
rather than copy it.

Placement. Every parameter is created with ``jax.make_array_from_callback``
in its target sharding: the callback receives the block one device holds and
reads just those bytes (per layer, per expert: our stacked layouts gather many
HF tensors), so a device never reads, and the host never holds per device, a
copy of what other devices hold; a replicated parameter is read once. Without a
mesh each parameter is read whole and put on JAX's default device.

Dtypes. The serving dtype (float32 or bfloat16) is the stored dtype of matmul
weights; norm scales and the MoE router are float32
(``model.layers.param_dtype``). Blocks are cast from the stored dtype (BF16,
F16, F32; BF16 arrives as ``ml_dtypes.bfloat16``) on read, so a bf16 checkpoint
served in bf16 is never widened.

Errors name what is wrong: a tensor the model needs that no file holds, a
tensor the model would ignore (biases, a ``lm_head`` next to tied embeddings,
any other name the architecture does not use), a shape that is not the config's, a file the index names
that is missing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from model import hf_tensor_map as hmap
from model.config import ModelConfig
from model.hf_config import BASE_MODELS, causal_lm_architecture, hf_architecture, read_hf_config

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
"""Gemma3ForConditionalGeneration's vision tower: not read (text only)."""


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory: ``config.json`` beside
    ``model.safetensors.index.json`` or ``model.safetensors`` (an xlaserve orbax
    checkpoint has a ``config.json`` too, but ``params/`` instead)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and (
        (p / INDEX_FILE).is_file() or (p / SINGLE_FILE).is_file())


def safe_open(path: str, framework: str = "numpy"):
    """``safetensors.safe_open`` (a seam the shard-read tests count through)."""
    import safetensors

    return safetensors.safe_open(path, framework=framework)


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face checkpoint directory, opened lazily (memory-mapped).

    Attributes:
      directory: the checkpoint directory.
      files: {tensor name: file name} (from the index, or the single file's header).
    """

    def __init__(self, directory: str | os.PathLike):
        """Reads the index (or the single file's header).

        Raises:
          FileNotFoundError: neither ``model.safetensors.index.json`` nor
            ``model.safetensors``, or a file the index names is missing.
          ValueError: an index without a ``weight_map``.
        """
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index (no weight_map: {e})") from None
            self.files = {str(k): str(v) for k, v in weight_map.items()}
            for f in sorted(set(self.files.values())):
                if not (self.directory / f).is_file():
                    raise FileNotFoundError(f"{index} names {f}, which is not in {self.directory}")
        elif (self.directory / SINGLE_FILE).is_file():
            self.files = {k: SINGLE_FILE for k in self._handle(SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}")

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file))
        return self._handles[file]

    def _slice(self, name: str):
        if name not in self.files:
            raise KeyError(f"{self.directory.name}: no tensor {name!r}")
        return self._handle(self.files[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors spells it ("BF16", "F32", ...)."""
        return str(self._slice(name).get_dtype())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the block ``index`` of tensor ``name`` (BF16 as ``ml_dtypes.bfloat16``), copied
        out of the mapping by ``safetensors``.

        The file is unmapped after the read (a later one maps it again): pages a read
        touched stay resident in this process while its file is mapped, so a mapping
        kept open would hold a second copy of every tensor read.
        """
        arr = np.asarray(self._slice(name)[index])
        self._handles.pop(self.files[name], None)
        return arr

    def close(self) -> None:
        self._handles.clear()


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
HOST_ALIGNMENT = 64
"""Bytes a host block is aligned to: what XLA's CPU client needs to use a NumPy buffer in
place (a large ``np.empty`` is only 16-byte aligned, which makes ``device_put`` copy it)."""


def aligned_empty(shape: tuple[int, ...], dtype, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` whose data starts at a
    multiple of ``alignment`` bytes."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def load_hf_checkpoint(model_dir: str | os.PathLike, dtype: Any = "float32", mesh=None,
                       rules=None, name: str | None = None, progress: bool = True
                       ) -> tuple[ModelConfig, dict[str, jax.Array]]:
    """Loads a Hugging Face checkpoint: its config and its parameters, placed.

    Args:
      model_dir: a directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` + its shards.
      dtype: the serving dtype ("float32" or "bfloat16"): matmul weights are
        stored in it; norms and the router in float32.
      mesh: a ``jax.sharding.Mesh`` to place the parameters on (None: JAX's
        default device, each parameter read whole).
      rules: with ``mesh``, the ``sharding.rules.ShardingRules`` that map each
        parameter's logical axes onto it (anything with
        ``spec(shape, logical_axes, axis_sizes, what)``).
      name: the served model name (default: the directory's name).
      progress: show a tqdm bar of the bytes read.

    Returns:
      (config, {name: jax.Array}) in the layout ``model.factory.build_model``
      takes (``build_model(cfg, params=params, dtype=dtype)`` keeps the placement).

    Raises:
      FileNotFoundError: no config.json / safetensors files, or a file the index names.
      ValueError: an unsupported architecture or config (see ``model.hf_config``),
        a missing tensor or one this decoder would ignore (named), a tensor of
        the wrong shape, a dtype other than F32/F16/BF16, or ``mesh`` without ``rules``.
    """
    from jax.sharding import NamedSharding

    from model.factory import abstract_params
    from model.layers import param_dtype

    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    cfg = read_hf_config(model_dir, name=name)
    arch = hf_architecture(json.loads((model_dir / "config.json").read_text()))
    ckpt = SafetensorsCheckpoint(model_dir)
    srcs = _sources(arch, cfg, ckpt)
    _check_tensors(ckpt, srcs, cfg)
    if mesh is not None and rules is None:
        raise ValueError("load_hf_checkpoint: a mesh needs sharding rules")

    layout = abstract_params(cfg, "float32")  # {name: (shape, dtype, logical axes)}
    if set(layout) != set(srcs):  # a mapping table that disagrees with the decoder is our bug
        raise AssertionError(f"tensor map {sorted(srcs)} != decoder parameters {sorted(layout)}")
    jdtype = np.dtype(jax.numpy.dtype(dtype))
    shardings = {}  # None: JAX's default device
    for pname, (shape, _, axes) in layout.items():
        shardings[pname] = None if mesh is None else NamedSharding(
            mesh, rules.spec(shape, axes, dict(mesh.shape), what=pname))

    def block_bytes(pname: str) -> int:
        shape, sh = layout[pname][0], shardings[pname]
        item = _ITEMSIZE[ckpt.dtype(hmap.tensor_names(srcs[pname], cfg)[0])]
        if sh is None or sh.is_fully_replicated:
            return math.prod(shape) * item
        return sum(math.prod(len(range(*s.indices(n))) for s, n in zip(idx, shape)) * item
                   for idx in sh.addressable_devices_indices_map(shape).values())

    from tqdm import tqdm

    bar = tqdm(total=sum(block_bytes(p) for p in layout), unit="B", unit_scale=True,
               desc=f"reading {model_dir.name}", disable=not progress)

    def read(tname: str, index: tuple[slice, ...]) -> np.ndarray:
        arr = ckpt.read(tname, index)
        bar.update(arr.nbytes)
        return arr

    params: dict[str, jax.Array] = {}
    try:
        for pname, (shape, _, _) in layout.items():
            target = np.dtype(param_dtype(pname, jdtype))
            src = srcs[pname]

            def callback(index, src=src, shape=shape, target=target):
                block = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
                return hmap.read_into(src, cfg, shape, index, read, aligned_empty(block, target))

            if shardings[pname] is None:
                params[pname] = jax.device_put(callback(tuple(slice(None) for _ in shape)))
            else:
                params[pname] = jax.make_array_from_callback(tuple(shape), shardings[pname], callback)
    finally:
        bar.close()
        ckpt.close()
    log.info("loaded %s (%s, %d tensors) in %.1f s", model_dir.name, arch,
             sum(len(hmap.tensor_names(s, cfg)) for s in srcs.values()), time.perf_counter() - t0)
    return cfg, params


def _sources(arch: str, cfg: ModelConfig, ckpt: SafetensorsCheckpoint) -> dict[str, hmap.Source]:
    """The tensor map for this checkpoint's naming (Gemma3ForConditionalGeneration
    has been saved as ``language_model.model.*`` and, since transformers 4.52,
    ``model.language_model.*``; a base model (``Gemma3TextModel``, ``Qwen3Model``, ...)
    without the ``model.`` prefix; MoE experts one tensor per expert, or fused per
    layer as transformers v5 holds them)."""
    if arch in BASE_MODELS:  # sentence-transformers' transformer: no "model." prefix, no head
        return hmap.sources(causal_lm_architecture(arch), cfg, prefix="")
    if arch != "Gemma3ForConditionalGeneration":
        fused = "model." + hmap.FUSED_EXPERTS_PROBE in ckpt.files
        return hmap.sources(arch, cfg, fused_experts=fused)
    for prefix, head in (("model.language_model.", "lm_head.weight"),
                         ("language_model.model.", "language_model.lm_head.weight")):
        if prefix + "embed_tokens.weight" in ckpt.files:
            return hmap.sources(arch, cfg, prefix=prefix, head=head)
    raise ValueError(f"{ckpt.directory.name}: a Gemma3ForConditionalGeneration checkpoint without "
                     "'model.language_model.embed_tokens.weight' or "
                     "'language_model.model.embed_tokens.weight'")


def _check_tensors(ckpt: SafetensorsCheckpoint, srcs: Mapping[str, hmap.Source],
                   cfg: ModelConfig) -> None:
    """Every tensor the model reads is there at its shape and a float dtype; no other is."""
    from model.factory import abstract_params

    layout = abstract_params(cfg, "float32")
    wanted: dict[str, tuple[int, ...]] = {}
    for pname, src in srcs.items():
        inner = layout[pname][0][src.stacked_axes:]
        for tname in hmap.tensor_names(src, cfg):
            wanted[tname] = hmap.hf_shape(src.kind, inner, cfg)
    where = ckpt.directory.name
    missing = sorted(set(wanted) - set(ckpt.files))
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks tensor{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(repr(m) for m in missing[:8])}{' ...' if len(missing) > 8 else ''}")
    skipped = [t for t in ckpt.files if t.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("%s: skipping %d vision-tower tensors (text only)", where, len(skipped))
    extra = sorted(t for t in set(ckpt.files) - set(wanted) - set(skipped)
                   if not t.endswith(hmap.IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"{where}: the checkpoint has tensors this decoder would ignore: "
                         f"{', '.join(repr(e) for e in extra[:8])}{' ...' if len(extra) > 8 else ''}")
    for tname, shape in wanted.items():
        got = ckpt.shape(tname)
        if got != shape:
            raise ValueError(f"{where}: tensor {tname!r} has shape {got}, the config implies {shape}")
        dt = ckpt.dtype(tname)
        if dt not in _ITEMSIZE:
            raise ValueError(f"{where}: tensor {tname!r} is {dt}; supported: {sorted(_ITEMSIZE)}")
