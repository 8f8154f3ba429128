"""The benchmarks a lent accelerator runs (``benchmarks/device.sh``): engine and kernels, bf16.

    python -m benchmarks.device              # on the accelerator (a few minutes)
    python -m benchmarks.device --cpu-smoke  # the same phases at toy sizes, on any machine

Phases, each printed as it finishes:

1. the machine's limits (datasheet HBM bandwidth where known, the copy probe
   beside it, and the measured bf16 matmul rate);
2. the engine (``benchmarks.engine``) with random weights in Gemma 3 270M's
   shapes and in Llama-3-8B's widths (4 layers; per-step numbers scale with
   layers), bf16 weights and KV: prefill tokens/s per bucket and decode
   tokens/s per slot count and context, each with its roofline line, which
   gives the fraction of HBM bandwidth the decode step reaches;
3. the paged-attention kernels (``benchmarks.kernels``): Pallas against the XLA
   reference at serving shapes, with their errors.

Needs only jax, flax and numpy: no GGUF, tokenizer, HTTP stack or YAML (the
engine imports none of them). A phase that fails prints its error and the
next one runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/device.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax

from benchmarks import engine, kernels

# (shape, extra engine args): 6 decode and 2 prefill programs per shape, so compiles and runs
# stay within a few minutes; each phase prints as it finishes.
FULL = [
    ("gemma3-270m", ["--slots", "1", "32", "128", "--context", "512", "4096",
                     "--prefill", "128", "512", "--steps", "10", "--repeats", "3"]),
    ("llama3-8b", ["--layers", "4", "--slots", "1", "32", "64", "--context", "512", "4096",
                   "--prefill", "128", "512", "--steps", "10", "--repeats", "3"]),
]
FULL_KERNELS = ["--kinds", "decode", "prefill", "--batch", "8", "64", "--context", "4096",
                "--page-size", "16", "--iters", "10"]
SMOKE = [
    ("tiny", ["--slots", "1", "4", "--context", "64", "--prefill", "16", "--steps", "2", "--repeats", "1"]),
]
SMOKE_KERNELS = ["--kinds", "decode", "--impls", "xla", "--batch", "2", "--context", "64",
                 "--page-size", "16", "--heads", "gemma3-270m", "--iters", "1", "--no-kv-write"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes (checks the script, not the device)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip", nargs="*", default=[], choices=["engine", "kernels"])
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
    plan = SMOKE if args.cpu_smoke else FULL
    failures = 0
    t_start = time.perf_counter()
    if "engine" not in args.skip:
        for shape, extra in plan:
            print(f"\n=== engine: {shape}, {args.dtype} ({time.perf_counter() - t_start:.0f} s in)", flush=True)
            failures += _phase(engine.main, ["--shape", shape, "--dtype", args.dtype, *extra])
    if "kernels" not in args.skip:
        print(f"\n=== kernels ({time.perf_counter() - t_start:.0f} s in)", flush=True)
        failures += _phase(kernels.main, [*(SMOKE_KERNELS if args.cpu_smoke else FULL_KERNELS),
                                          "--dtype", args.dtype])
    print(f"\ndone in {time.perf_counter() - t_start:.0f} s, {failures} phase(s) failed", flush=True)
    return 1 if failures else 0


def _phase(fn, argv) -> int:
    try:
        fn(argv)
        return 0
    except Exception:  # one failing phase must not hide the others' numbers
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
