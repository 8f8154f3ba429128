"""Paged decode attention: the Pallas kernel against the XLA reference, at serving shapes.

    python -m benchmarks.kernels            # default sweep (about 3 minutes on a GPU)
    python -m benchmarks.kernels --full     # more batch sizes, contexts and page sizes
    python -m benchmarks.kernels --impls xla --batch 8 --context 512   # a quick CPU look

For each shape it checks the kernel against the reference (max abs error),
times both (median of --iters runs after a warm-up), and prints the bytes a
decode step must move (the live K/V pages of every slot, plus q and the
output) over the time, as a fraction of the device's memory bandwidth. The
bandwidth comes from a table for accelerators (--bandwidth-gbs overrides it);
on CPU it is measured in the same run with a large array copy.

Needs only jax and this repository (no gguf, FastAPI or model file), so it
runs from the source tree on a lent GPU. On CPU the Pallas kernel runs in
interpret mode, whose timings say nothing about a real lowering.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/kernels.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention_xla import paged_decode_attention_xla
from kernels_pallas.paged_decode_pallas import paged_decode_attention_pallas

HEAD_CONFIGS = {  # name: (num_heads, kv_heads, head_dim)
    "gemma3-270m": (4, 1, 256),
    "llama3-8b": (32, 8, 128),
}
PEAK_BANDWIDTH_GBS = {  # HBM bandwidth by device kind (substring match), GB/s
    "H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "TPU v5 lite": 819.0, "TPU v6": 1640.0,
}


def device_bandwidth_gbs(override: float | None) -> tuple[float, str]:
    if override:
        return override, "given"
    kind = jax.devices()[0].device_kind
    for name, gbs in PEAK_BANDWIDTH_GBS.items():
        if name in kind:
            return gbs, f"{kind} datasheet"
    x = jnp.ones((256 * 1024 * 1024 // 4,), jnp.float32)  # 256 MiB
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    t = _median_time(lambda: copy(x), 5)
    return 2 * x.nbytes / t / 1e9, f"{kind}, measured copy"


def _median_time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_case(batch, context, page_size, heads, dtype, seed=0):
    num_heads, kv_heads, head_dim = heads
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    q = jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), dtype)
    table = jnp.asarray(1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    live_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    io_bytes = 2 * q.size * q.dtype.itemsize
    return (q, k, v, lengths, table), live_bytes + io_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the larger sweep")
    ap.add_argument("--batch", type=int, nargs="+")
    ap.add_argument("--context", type=int, nargs="+")
    ap.add_argument("--page-size", type=int, nargs="+")
    ap.add_argument("--heads", nargs="+", choices=sorted(HEAD_CONFIGS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impls", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth-gbs", type=float)
    args = ap.parse_args(argv)

    batches = args.batch or ([1, 8, 32, 64, 128] if args.full else [1, 8, 64])
    contexts = args.context or ([512, 2048, 4096, 8192] if args.full else [512, 4096])
    page_sizes = args.page_size or ([16, 32, 64] if args.full else [16, 64])
    heads = args.heads or sorted(HEAD_CONFIGS)
    dtype = jnp.dtype(args.dtype)
    interpret = jax.default_backend() == "cpu"
    bw, bw_src = device_bandwidth_gbs(args.bandwidth_gbs)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"bandwidth {bw:.0f} GB/s ({bw_src}); dtype {dtype.name}"
          + ("; Pallas in interpret mode (timings not meaningful)" if interpret else ""))
    print(f"{'heads':12} {'batch':>5} {'ctx':>5} {'page':>4} {'impl':7} {'ms':>8} {'GB/s':>8} {'of peak':>8} {'max err':>9}")
    for h, b, c, ps in itertools.product(heads, batches, contexts, page_sizes):
        inputs, nbytes = make_case(b, c, ps, HEAD_CONFIGS[h], dtype)
        scale = HEAD_CONFIGS[h][2] ** -0.5
        fns = {
            "xla": jax.jit(lambda *a: paged_decode_attention_xla(*a, scale=scale)),
            "pallas": jax.jit(lambda *a: paged_decode_attention_pallas(*a, scale=scale, interpret=interpret)),
        }
        ref = np.asarray(fns["xla"](*inputs).astype(jnp.float32))
        for impl in args.impls:
            try:
                out = fns[impl](*inputs)
                err = float(np.abs(np.asarray(out.astype(jnp.float32)) - ref).max())
                t = _median_time(lambda: fns[impl](*inputs), args.iters)
            except Exception as e:  # a lowering or launch failure is a result too
                print(f"{h:12} {b:5} {c:5} {ps:4} {impl:7} FAILED: {type(e).__name__}: {str(e)[:200]}")
                continue
            gbs = nbytes / t / 1e9
            print(f"{h:12} {b:5} {c:5} {ps:4} {impl:7} {t * 1e3:8.3f} {gbs:8.1f} {gbs / bw:8.1%} {err:9.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
