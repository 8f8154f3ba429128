"""``xlaserve convert`` and ``xlaserve shard-plan``, and loading a model onto a mesh for ``serve``.

    xlaserve convert path/to/model.gguf OUT_DIR       # orbax checkpoint + config + tokenizer
    xlaserve convert tiny-moe OUT_DIR                  # a random model from configs/models.yaml
    xlaserve shard-plan --model llama3-70b --mesh tensor=8 --device h200 --slots 32 --max-len 8192
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
    conv = sub.add_parser("convert", help="write an orbax checkpoint (with config and tokenizer) "
                                          "from a GGUF or a named random model")
    conv.add_argument("source", help="a .gguf path, or a name from configs/models.yaml")
    conv.add_argument("out_dir", help="output directory (created; must not hold a checkpoint)")
    conv.add_argument("--name", help="the model name the checkpoint serves as (default: the "
                      "configs/models.yaml name, or the GGUF file's stem)")
    conv.set_defaults(func=cmd_convert)

    sp = sub.add_parser("shard-plan", help="per-device memory and decode floor of a model on a mesh")
    sp.add_argument("--model", required=True,
                    help="model config: YAML path, configs/ name (llama3-70b, mixtral-8x7b, ...) "
                         "or random model name")
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
    from sharding.plan import device_spec, load_model_config, plan

    p = plan(load_model_config(args.model), MeshConfig.parse(args.mesh), device_spec(args.device),
             slots=args.slots, max_len=args.max_len, page_size=args.page_size,
             prefill_chunk=args.prefill_chunk, dtype=args.dtype, kv_dtype=args.kv_dtype)
    print(p.table())
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from model.checkpoint import save_checkpoint
    from serving.model_registry import known_models

    t0 = time.perf_counter()
    models = known_models()
    if args.source.endswith(".gguf") and Path(args.source).is_file():
        from model.gguf_loader import load_gguf
        from model.tokenizer import Tokenizer

        cfg, params = load_gguf(args.source, name=Path(args.source).stem, cache_dir=None)
        try:
            tok = Tokenizer.from_gguf(args.source).serialized_model
        except (ValueError, KeyError, RuntimeError) as e:
            # Our tokenizer rebuilds Gemma-style SentencePiece vocabularies only: a Llama 3
            # BPE ("gpt2") vocabulary or a Llama 2 / Mixtral one (no chat pieces) is refused.
            log.warning("tokenizer not converted: the checkpoint holds weights only, and "
                        "serve/generate will refuse it: %s", e)
            tok = None
    elif args.source in models and models[args.source].get("source") == "gguf-package":
        import importlib

        from model.gguf_loader import load_gguf
        from model.tokenizer import Tokenizer
        from serving.server_config import cache_dir

        path = importlib.import_module(models[args.source]["package"]).assemble()
        cfg, params = load_gguf(path, name=args.source, cache_dir=cache_dir("weights"))
        tok = Tokenizer.from_gguf(path, cache_dir=cache_dir("tokenizer")).serialized_model
    elif args.source in models and models[args.source].get("source") == "random":
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
        raise ValueError(f"convert: {args.source!r} is neither a .gguf file nor a model in configs/models.yaml")
    if getattr(args, "name", None):
        cfg = dataclasses.replace(cfg, name=args.name)
    out = save_checkpoint(args.out_dir, cfg, params, tokenizer_model=tok)
    print(f"wrote {out} ({cfg.name}, {len(params)} arrays) in {time.perf_counter() - t0:.1f} s")
    return 0


def load_for_serving(cfg):
    """The model (on its mesh) and tokenizer that ``serve`` / ``generate`` run.

    ``cfg.mesh`` (e.g. "data=1,tensor=4,expert=1") builds the mesh over all
    processes' devices; ``cfg.checkpoint`` restores an orbax checkpoint straight
    into the mesh's shardings; otherwise ``cfg.model`` is loaded as before and
    placed on the mesh by the engine.

    Returns:
      (model, tokenizer, mesh or None).

    Raises:
      ValueError: a mesh the devices or the model cannot take, or a checkpoint or
        GGUF that carries no usable tokenizer (text in and out would not be the
        model's; the registry's ``tiny-*`` test models keep their test vocabulary).
    """
    from serving.model_registry import load_model
    from sharding.mesh import MeshConfig, build_mesh

    mesh_cfg = MeshConfig.parse(cfg.mesh) if cfg.mesh else None
    mesh = build_mesh(mesh_cfg) if mesh_cfg is not None and mesh_cfg.size > 1 else None
    if not cfg.checkpoint:
        model, tok = load_model(cfg.model, dtype=cfg.dtype)
        if mesh_cfg is not None:
            log.info("serving %s on mesh %s (%d devices)", model.cfg.name, mesh_cfg, mesh_cfg.size)
        return model, with_chat_template(tok, cfg.chat_template), mesh
    import jax.numpy as jnp

    from model.checkpoint import load_config, restore_params, tokenizer_model
    from model.factory import abstract_params, build_model
    from model.tokenizer import Tokenizer
    from sharding.placement import abstract_targets
    from sharding.rules import ShardingRules

    t0 = time.perf_counter()
    mcfg = load_config(cfg.checkpoint)
    # Restored as stored (float32), each device reading its own shard; cast after.
    targets = abstract_targets(abstract_params(mcfg, "float32"), mesh, ShardingRules.default())
    params = restore_params(cfg.checkpoint, targets)
    model = build_model(mcfg, params=params, dtype=jnp.dtype(cfg.dtype))
    spm = tokenizer_model(cfg.checkpoint)
    if not spm:
        raise ValueError(
            f"checkpoint {cfg.checkpoint} has no tokenizer (tokenizer.model), so its text cannot "
            f"be served; write the checkpoint from a source with one (xlaserve convert of a "
            f"Gemma 3 GGUF, or of a registry test model)")
    tok = with_chat_template(Tokenizer(spm), cfg.chat_template)
    log.info("restored %s from %s onto mesh %s in %.1f s", mcfg.name, cfg.checkpoint,
             mesh_cfg or "1x1x1", time.perf_counter() - t0)
    return model, tok, mesh


def with_chat_template(tok, override_file=None, checkpoint_template=None):
    """``tok`` with the chat template to serve (``model.chat_template_source.pick_chat_template``).

    Args:
      tok: the model's tokenizer (its own ``apply_chat_template`` is Gemma 3's).
      override_file: ``--chat-template FILE``, or None.
      checkpoint_template: the model's own ``JinjaChatTemplate``, or None.

    Returns:
      ``tok`` itself when neither is given, else a ``TemplatedTokenizer`` whose
      ``apply_chat_template`` renders the chosen template (its variables: the
      checkpoint template's, else ``tok.special_tokens``).

    Raises:
      ValueError: an unreadable or invalid template file, or a tokenizer without
        ``encode_markup``.
    """
    from model.chat_template_source import TemplatedTokenizer, pick_chat_template

    template = pick_chat_template(override_file, checkpoint_template,
                                  None if checkpoint_template else getattr(tok, "special_tokens", None))
    if template is None:
        return tok
    log.info("chat template: %s", template.name)
    return TemplatedTokenizer(tok, template)


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

    from serving.backend_policy import BackendPolicy
    from serving.engine import Engine
    from serving.engine_config import EngineConfig
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
