"""The ``xlaserve`` command: one module of ``serving.cli`` a subcommand (``serve``, ``engine``,
``generate``, ``convert``, ``shard-plan``; the gateway's ``keys``, ``tenants``, ``usage`` in
``admin``), and extra subcommands found through entry points (``xlaserve bench``).

    xlaserve serve                       # Gemma 3 270M on 127.0.0.1:8000
    xlaserve serve --model tiny-random --port 8100
    xlaserve serve --model path/to/hf_checkpoint_dir     # or a .gguf file, or a Hub id org/name
    xlaserve engine --grpc-port 50051                    # a replica behind gRPC (serving/cli/engine.py)
    xlaserve serve --engines grpc://127.0.0.1:50051,grpc://127.0.0.1:50052
    xlaserve generate "The capital of France is" --max-tokens 24
    xlaserve keys create --tenant acme --rpm 60
    xlaserve usage --group-by day
"""

from __future__ import annotations

import argparse
import logging
import sys

from serving.cli import admin, convert, engine, generate, serve, shard_plan
from serving.gateway.http.log_context import LOG_FORMAT, RequestIdLogFilter

log = logging.getLogger("xlaserve")

PLUGIN_COMMANDS_GROUP = "xlaserve.commands"
"""Entry-point group of extra subcommands: each entry is a ``register(subparsers)``
function (pyproject.toml registers ``bench`` from ``benchmarks.cli``)."""


def _register_plugin_commands(sub) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_COMMANDS_GROUP):
        try:
            register = ep.load()
        except ImportError as e:  # e.g. a source tree without the benchmarks package
            log.debug("xlaserve command %r not available: %s", ep.name, e)
            continue
        register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xlaserve", description="LLM inference on JAX/XLA")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    sub = parser.add_subparsers(dest="command", required=True)

    serve.register(sub)
    engine.register(sub)
    generate.register(sub)
    admin.register(sub)
    convert.register(sub)
    shard_plan.register(sub)
    _register_plugin_commands(sub)  # e.g. `xlaserve bench` (benchmarks/cli.py)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdLogFilter())
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("xlaserve: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # bad settings: a clear message, not a traceback
        print(f"xlaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
