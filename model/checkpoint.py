"""Orbax checkpoints: xlaserve's native weight format.

Layout of a checkpoint directory::

    DIR/config.json      the ModelConfig (``dataclasses.asdict``)
    DIR/params/          orbax StandardCheckpointer: {name: array}, names as in
                         the model's parameter layout (``model.factory.abstract_params``)
    DIR/tokenizer.model  the SentencePiece model (serialized ModelProto), if any
    DIR/tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja
                         a ``tokenizers`` (BPE) tokenizer and its chat template, if any
                         (:data:`TOKENIZER_FILES`, as a Hugging Face checkpoint holds them)

Orbax stores each array as a tensorstore (zarr) array independent of how it
was sharded when written, so a checkpoint written on one mesh restores onto
any other: :func:`restore_params` hands orbax the target ``NamedSharding`` of
every array and each device reads only its own shard (no full copy per device).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

import jax
import numpy as np

from model.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
"""The Hugging Face tokenizer and chat-template files a checkpoint may hold beside its arrays."""


def save_checkpoint(out_dir: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, object],
                    tokenizer_model: bytes | None = None,
                    tokenizer_files: Mapping[str, bytes] | None = None) -> Path:
    """Writes ``params`` ({name: numpy or jax array, possibly sharded}) with config and tokenizer.

    Every process of a multi-process run must call it (orbax coordinates the write).

    Args:
      tokenizer_model: a SentencePiece model (Gemma's), written as ``tokenizer.model``.
      tokenizer_files: {file name: bytes} of :data:`TOKENIZER_FILES` (a BPE
        tokenizer, its chat template), written beside the arrays.

    Raises:
      FileExistsError: ``out_dir/params`` already exists.
      ValueError: a tokenizer file name outside :data:`TOKENIZER_FILES`.
    """
    bad = sorted(set(tokenizer_files or ()) - set(TOKENIZER_FILES))
    if bad:
        raise ValueError(f"save_checkpoint: {bad} are not tokenizer files ({', '.join(TOKENIZER_FILES)})")
    import orbax.checkpoint as ocp

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / "params").exists():
        raise FileExistsError(f"{out / 'params'} exists; choose an empty output directory")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out / "params", {k: v if isinstance(v, jax.Array) else np.asarray(v)
                                for k, v in params.items()})
    ckptr.wait_until_finished()
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        if tokenizer_model is not None:
            (out / "tokenizer.model").write_bytes(tokenizer_model)
        for file, data in (tokenizer_files or {}).items():
            (out / file).write_bytes(data)
    return out


def load_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """The checkpoint's ModelConfig. Raises FileNotFoundError if DIR is not a checkpoint."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not an xlaserve checkpoint (no config.json)")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def restore_params(ckpt_dir: str | os.PathLike, target: Mapping[str, jax.ShapeDtypeStruct]
                   ) -> dict[str, jax.Array]:
    """Reads the parameters straight into their target shapes, dtypes and shardings.

    Args:
      ckpt_dir: a directory written by :func:`save_checkpoint`.
      target: {name: jax.ShapeDtypeStruct(shape, dtype, sharding=...)}; a dtype
        other than the stored one is converted on read.

    Raises:
      ValueError: the checkpoint's arrays are not the ones ``target`` names.
    """
    import orbax.checkpoint as ocp

    path = Path(ckpt_dir).resolve() / "params"
    ckptr = ocp.StandardCheckpointer()
    stored = ckptr.metadata(path)
    stored = getattr(stored, "item_metadata", stored)
    names = set(stored.keys()) if hasattr(stored, "keys") else set(target)
    if names != set(target):
        raise ValueError(f"checkpoint {ckpt_dir} holds {sorted(names)}, the model needs {sorted(target)}")
    return ckptr.restore(path, dict(target))


def tokenizer_model(ckpt_dir: str | os.PathLike) -> bytes | None:
    """The stored SentencePiece model bytes, or None."""
    path = Path(ckpt_dir) / "tokenizer.model"
    return path.read_bytes() if path.is_file() else None
