"""``xlaserve convert`` and ``xlaserve shard-plan``, and loading a model onto a mesh for ``serve``.

    xlaserve convert path/to/model.gguf OUT_DIR       # orbax checkpoint + config + tokenizer
    xlaserve convert path/to/hf_dir OUT_DIR            # a Hugging Face checkpoint (or a Hub id)
    xlaserve convert tiny-moe OUT_DIR                  # a random model from configs/models.yaml
    xlaserve shard-plan --model llama3-70b --mesh tensor=8 --device h200 --slots 32 --max-len 8192
    xlaserve shard-plan --model org/name --mesh tensor=8   # a Hub id's (or a directory's) config.json
    xlaserve serve --checkpoint OUT_DIR --mesh data=1,tensor=4,expert=1
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

log = logging.getLogger("xlaserve")


def register(sub) -> None:
    """Adds the ``convert`` and ``shard-plan`` subcommands to the CLI's subparsers."""
    conv = sub.add_parser("convert", help="write an orbax checkpoint (with config, tokenizer and chat "
                                          "template) from a GGUF, a Hugging Face checkpoint or a "
                                          "named model")
    conv.add_argument("source", help="a .gguf path, a Hugging Face checkpoint directory, a Hub id "
                                     "(org/name), or a name from configs/models.yaml")
    conv.add_argument("out_dir", help="output directory (created; must not hold a checkpoint)")
    conv.add_argument("--name", help="the model name the checkpoint serves as (default: the "
                      "configs/models.yaml name, the GGUF file's stem, the directory's name or the Hub id)")
    conv.add_argument("--revision", help="a Hub id's branch, tag or commit (default: main)")
    conv.set_defaults(func=cmd_convert)

    sp = sub.add_parser("shard-plan", help="per-device memory and decode floor of a model on a mesh")
    sp.add_argument("--model", required=True,
                    help="model config: YAML path, configs/ name (llama3-70b, mixtral-8x7b, ...), "
                         "random model name, GGUF path, Hugging Face checkpoint directory or Hub id")
    sp.add_argument("--revision", help="a Hub id's branch, tag or commit (default: main)")
    sp.add_argument("--mesh", default="", help="e.g. tensor=8 or data=2,tensor=4,expert=1")
    sp.add_argument("--device", default="h200", help="v5e | v6e | h100 | h200 (configs/devices.yaml)")
    sp.add_argument("--slots", type=int, default=32, help="concurrent sequences")
    sp.add_argument("--max-len", type=int, default=8192, help="tokens per sequence (prompt + output)")
    sp.add_argument("--page-size", type=int, default=16)
    sp.add_argument("--prefill-chunk", type=int, default=512)
    sp.add_argument("--dtype", default="bfloat16", help="weights: bfloat16 | float32")
    sp.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    sp.set_defaults(func=cmd_shard_plan)


def cmd_shard_plan(args: argparse.Namespace) -> int:
    from sharding.mesh import MeshConfig
    from sharding.plan import device_spec, plan

    p = plan(plan_model_config(args.model, getattr(args, "revision", None)), MeshConfig.parse(args.mesh),
             device_spec(args.device), slots=args.slots, max_len=args.max_len, page_size=args.page_size,
             prefill_chunk=args.prefill_chunk, dtype=args.dtype, kv_dtype=args.kv_dtype)
    print(p.table())
    return 0


def plan_model_config(model: str, revision: str | None = None):
    """The ModelConfig ``shard-plan`` plans: a Hugging Face checkpoint directory's or a Hub id's
    ``config.json`` (only that file is fetched), else ``sharding.plan.load_model_config``'s forms.

    Raises:
      ValueError: none of the forms, or an unsupported ``config.json``.
    """
    from pathlib import Path

    from serving.loading.model_source import CONFIG_FILES, is_hub_id, resolve_model
    from sharding.plan import load_model_config

    path = Path(model).expanduser()
    hub = is_hub_id(model) and not path.exists() and path.suffix not in (".yaml", ".yml")
    if path.is_dir() or hub or revision is not None:
        from model.hf_config import read_hf_config

        source = resolve_model(model, revision=revision, files=CONFIG_FILES)
        if source.is_hf:
            return read_hf_config(source.path, name=source.name)
    return load_model_config(model)


def _tokenizer_files(directory) -> dict[str, bytes]:
    """The tokenizer and chat-template files a directory holds ({name: bytes}), verbatim."""
    from pathlib import Path

    from model.checkpoint import TOKENIZER_FILES

    directory = Path(directory)
    return {f: (directory / f).read_bytes() for f in TOKENIZER_FILES if (directory / f).is_file()}


def cmd_convert(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from model.checkpoint import save_checkpoint
    from serving.loading.model_registry import known_models
    from serving.loading.model_source import resolve_model

    t0 = time.perf_counter()
    models = known_models()
    source = resolve_model(args.source, revision=getattr(args, "revision", None), registry=models)
    tok, tok_files = None, None
    if source.is_hf:
        from model.safetensors_loader import load_hf_checkpoint
        from serving.loading.model_registry import hf_tokenizer

        hf_tokenizer(source.path)  # refuse a directory without a usable tokenizer before reading weights
        cfg, params = load_hf_checkpoint(source.path, "float32", name=source.name)
        tok_files = _tokenizer_files(source.path)
        spm_file = Path(source.path) / "tokenizer.model"
        if "tokenizer.json" not in tok_files and spm_file.is_file():  # a SentencePiece-only checkpoint
            tok = spm_file.read_bytes()
    elif source.kind == "gguf" or models[args.source].get("source") == "gguf-package":
        import importlib

        from model.bpe_tokenizer import BPETokenizer
        from model.gguf_loader import load_gguf
        from serving.loading.model_registry import gguf_tokenizer
        from serving.config.server_config import cache_dir

        if source.kind == "gguf":
            path, weights_cache = source.path, None
        else:
            path = importlib.import_module(models[args.source]["package"]).assemble()
            weights_cache = cache_dir("weights")
        cfg, params = load_gguf(path, name=source.name, cache_dir=weights_cache)
        try:
            gtok = gguf_tokenizer(path)
        except ValueError as e:
            # A vocabulary xlaserve cannot rebuild (a Llama 2 / Mixtral SentencePiece one without
            # Gemma's chat pieces, an unknown tokenizer.ggml.pre) is not converted.
            log.warning("tokenizer not converted: the checkpoint holds weights only, and "
                        "serve/generate will refuse it: %s", e)
            gtok = None
        if isinstance(gtok, BPETokenizer):
            with tempfile.TemporaryDirectory() as d:  # tokenizer files and the GGUF's chat template
                tok_files = _tokenizer_files(gtok.save(d))
        elif gtok is not None:
            tok = gtok.serialized_model
    elif models[args.source].get("source") == "random":
        from flax import nnx

        from model.config import ModelConfig
        from model.factory import build_model
        from model.tokenizer import Tokenizer

        spec = models[args.source]
        cfg = ModelConfig.from_dict(spec["config"])
        model = build_model(cfg, rngs=nnx.Rngs(int(spec.get("seed", 0))))
        params = {".".join(map(str, p)): v.get_value()
                  for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        tok = Tokenizer.tiny(cfg.vocab_size).serialized_model
    else:
        raise ValueError(f"convert: model {args.source!r}: unknown source "
                         f"{models[args.source].get('source')!r}")
    if getattr(args, "name", None):
        cfg = dataclasses.replace(cfg, name=args.name)
    out = save_checkpoint(args.out_dir, cfg, params, tokenizer_model=tok, tokenizer_files=tok_files)
    print(f"wrote {out} ({cfg.name}, {len(params)} arrays) in {time.perf_counter() - t0:.1f} s")
    return 0


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
                                chat_template=cfg.chat_template, quantization=cfg.quantization)
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
    model = build_model(mcfg, params=params, dtype=jnp.dtype(cfg.dtype), quantization=cfg.quantization)
    tok = checkpoint_tokenizer(cfg.checkpoint, mcfg.vocab_size, tokenizer_model(cfg.checkpoint),
                               cfg.chat_template)
    log.info("restored %s from %s onto mesh %s in %.1f s", mcfg.name, cfg.checkpoint,
             mesh_cfg or "1x1x1", time.perf_counter() - t0)
    return model, tok, mesh


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


def join_processes(cfg) -> bool:
    """Joins a multi-process job if the settings or JAX_* env vars name one. True if it did."""
    from sharding.multihost import ProcessConfig, initialize

    return initialize(ProcessConfig.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id))


def lockstep_for(mesh):
    """A Lockstep when the mesh spans several processes, else None."""
    import jax

    if mesh is None or jax.process_count() == 1:
        return None
    from sharding.multihost import Lockstep

    return Lockstep()


def run_follower(cfg) -> int:
    """A non-leader process of ``serve``: loads the same model onto the same mesh and runs
    the steps process 0 publishes, until it stops."""
    import jax

    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.engine import Engine
    from serving.config.engine_config import EngineConfig
    from sharding.multihost import Lockstep

    model, _, mesh = load_for_serving(cfg)
    engine = Engine(model, EngineConfig.from_server_config(cfg, model.cfg), mesh=mesh,
                    lockstep=Lockstep(), policy=BackendPolicy.detect(mesh, attention_impl=cfg.attention_impl))
    log.info("process %d following process 0's steps", jax.process_index())
    steps = engine.lockstep.follow(engine.run_published)
    log.info("process %d ran %d steps; leader stopped", jax.process_index(), steps)
    return 0


if __name__ == "__main__":
    sys.exit("use: xlaserve convert | shard-plan")
