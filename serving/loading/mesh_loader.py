"""The model, on its mesh, and the tokenizer that ``serve``, ``engine`` and ``generate`` run: a
``--model`` loaded by the registry, or an orbax checkpoint restored straight into the mesh's
shardings with the tokenizer it holds."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("xlaserve")


def load_for_serving(cfg):
    """The model (on its mesh) and tokenizer that ``serve`` / ``generate`` run.

    ``cfg.mesh`` (e.g. "data=1,tensor=4,expert=1") builds the mesh over all
    processes' devices; ``cfg.checkpoint`` restores an orbax checkpoint straight
    into the mesh's shardings; otherwise ``cfg.model`` (any form of
    ``serving.loading.model_source``, ``cfg.revision`` for a Hub id) is loaded by
    ``serving.loading.model_registry.load_model``: a Hugging Face checkpoint straight
    into the mesh's shardings, anything else placed on the mesh by the engine.
    The tokenizer serves ``cfg.chat_template``, else the model's own template,
    else Gemma 3's.

    Returns:
      (model, tokenizer, mesh or None).

    Raises:
      ValueError: a mesh the devices or the model cannot take, a ``--model`` that
        is none of the forms, or a checkpoint or GGUF that carries no usable
        tokenizer (text in and out would not be the model's; the registry's
        ``tiny-*`` test models keep their test vocabulary).
    """
    from serving.loading.model_registry import load_model
    from sharding.mesh import MeshConfig, build_mesh

    mesh_cfg = MeshConfig.parse(cfg.mesh) if cfg.mesh else None
    mesh = build_mesh(mesh_cfg) if mesh_cfg is not None and mesh_cfg.size > 1 else None
    if not cfg.checkpoint:
        model, tok = load_model(cfg.model, dtype=cfg.dtype, mesh=mesh, revision=cfg.revision,
                                chat_template=cfg.chat_template, quantization=loaded_quantization(cfg))
        if mesh_cfg is not None:
            log.info("serving %s on mesh %s (%d devices)", model.cfg.name, mesh_cfg, mesh_cfg.size)
        return model, tok, mesh
    import jax.numpy as jnp

    from model.checkpoint import load_config, restore_params, tokenizer_model
    from model.factory import abstract_params, build_model
    from sharding.placement import abstract_targets
    from sharding.rules import ShardingRules

    t0 = time.perf_counter()
    mcfg = load_config(cfg.checkpoint)
    # Restored as stored (float32), each device reading its own shard; cast after.
    targets = abstract_targets(abstract_params(mcfg, "float32"), mesh, ShardingRules.default())
    params = restore_params(cfg.checkpoint, targets)
    model = build_model(mcfg, params=params, dtype=jnp.dtype(cfg.dtype), quantization=loaded_quantization(cfg))
    tok = checkpoint_tokenizer(cfg.checkpoint, mcfg.vocab_size, tokenizer_model(cfg.checkpoint),
                               cfg.chat_template)
    log.info("restored %s from %s onto mesh %s in %.1f s", mcfg.name, cfg.checkpoint,
             mesh_cfg or "1x1x1", time.perf_counter() - t0)
    return model, tok, mesh


def loaded_quantization(cfg) -> str:
    """The weights the model is loaded in: ``--quantization``, except that "auto" loads the
    served dtype (the engine adds the int8 copy it runs few-row steps with) and an unresolved
    default (None: ``serving.cli.bootstrap.with_default_quantization`` not applied) the dtype's."""
    return "none" if cfg.quantization in ("auto", None) else cfg.quantization


def checkpoint_tokenizer(ckpt_dir, vocab_size: int, spm: bytes | None, override_file=None):
    """The tokenizer an orbax checkpoint holds, with its chat template: ``tokenizer.json`` (+ its
    config files and chat template, as ``xlaserve convert`` copies them from a Hugging Face
    checkpoint or writes them for a BPE GGUF), else a SentencePiece ``tokenizer.model`` with
    those files (a SentencePiece-only Hugging Face checkpoint), else Gemma's ``tokenizer.model``.

    Raises:
      ValueError: the checkpoint holds neither, or a tokenizer file that does not load.
    """
    from pathlib import Path

    from model.chat_template_source import load_checkpoint_chat_template
    from model.tokenizer import Tokenizer
    from serving.loading.model_registry import hf_tokenizer, serve_chat_template

    ckpt = Path(ckpt_dir)
    hf_configs = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")
    if (ckpt / "tokenizer.json").is_file() or (spm and any((ckpt / f).is_file() for f in hf_configs)):
        return serve_chat_template(hf_tokenizer(ckpt_dir, vocab_size), override_file,
                                   load_checkpoint_chat_template(ckpt_dir))
    if not spm:
        raise ValueError(
            f"checkpoint {ckpt_dir} has no tokenizer (tokenizer.json or tokenizer.model), so its text "
            f"cannot be served; write the checkpoint from a source with one (xlaserve convert of a "
            f"Hugging Face checkpoint, a Gemma 3 or BPE GGUF, or a registry test model)")
    return serve_chat_template(Tokenizer(spm), override_file)


def with_chat_template(tok, override_file=None, checkpoint_template=None):
    """``serving.loading.model_registry.serve_chat_template`` (kept under this name for callers)."""
    from serving.loading.model_registry import serve_chat_template

    return serve_chat_template(tok, override_file, checkpoint_template)
