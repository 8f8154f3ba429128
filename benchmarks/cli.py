"""``xlaserve bench ...``: the benchmarks as subcommands of the xlaserve command.

    xlaserve bench engine [args of python -m benchmarks.engine]
    xlaserve bench load   [args of python -m benchmarks.load]
    xlaserve bench kernels [args of python -m benchmarks.kernels]
    xlaserve bench cpu-kernels [args of python -m benchmarks.cpu_kernels]
    xlaserve bench vs-llamacpp [args of python -m benchmarks.vs_llamacpp]

Each subcommand hands its remaining arguments, unchanged, to the module's
``main(argv)``; ``xlaserve bench engine --help`` shows them.
"""

from __future__ import annotations

import argparse
import importlib

_COMMANDS = {
    "engine": ("benchmarks.engine", "offline prefill/decode tokens/s with a roofline; optional baselines"),
    "load": ("benchmarks.load", "load generator for any OpenAI-compatible endpoint"),
    "kernels": ("benchmarks.kernels", "paged-attention kernels against the XLA reference"),
    "cpu-kernels": ("benchmarks.cpu_kernels", "our int8 matmul kernel against XLA's dots, with a copy-bandwidth probe"),
    "routing": ("benchmarks.routing", "kv-aware against round-robin routing over 2 replicas (shared prefixes)"),
    "lora": ("benchmarks.lora", "32 streams over 4 LoRA adapters against 32 base streams, tokens/s ratio"),
    "vs-llamacpp": ("benchmarks.vs_llamacpp", "xlaserve serve variants through HTTP against llama.cpp's "
                    "batched decode"),
}


def register(subparsers) -> None:
    """Adds ``bench`` to the xlaserve command's subparsers (an ``xlaserve.commands`` entry point,
    pyproject.toml: serving/cli/main.py finds it without importing this package)."""
    bench = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(_COMMANDS),
                                  description=__doc__.splitlines()[0])
    bench.add_argument("benchmark", choices=sorted(_COMMANDS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs ``benchmarks.<name>.main(args.args)``; returns its exit code (0 if it returns None)."""
    module = importlib.import_module(_COMMANDS[args.benchmark][0])
    return module.main(args.args) or 0
