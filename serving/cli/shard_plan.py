"""``xlaserve shard-plan``: per-device memory and the decode floor of a model on a mesh.

    xlaserve shard-plan --model llama3-70b --mesh tensor=8 --device h200 --slots 32 --max-len 8192
    xlaserve shard-plan --model org/name --mesh tensor=8   # a Hub id's (or a directory's) config.json
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    """Adds the ``shard-plan`` subcommand to the CLI's subparsers."""
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
    sp.add_argument("--kv-dtype", default=None,
                    help="KV cache format: bfloat16 | float32 | int8 | fp8 (1-byte values and a float32 "
                         "scale per token and KV head, as --kv-cache-dtype; default: --dtype)")
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
