"""Paged attention kernels (decode, chunked prefill) against the XLA reference, at serving shapes.

    python -m benchmarks.kernels            # default sweep (about 3 minutes on a GPU)
    python -m benchmarks.kernels --full     # more batch sizes, contexts and page sizes
    python -m benchmarks.kernels --impls xla --batch 8 --context 512   # a quick CPU look

"pallas" is what ``attention_impl: pallas`` runs on this backend (the Mosaic
kernels on TPU, the Triton-style ones elsewhere). For each shape it checks
the kernel against the reference (max abs error), times both (median of
--iters runs after a warm-up), and prints the bytes the step must move (the
live K/V pages of every sequence, plus q and the output) over the time, as a
fraction of the device's memory bandwidth. Decode rows have one query token
per slot at the given context; prefill rows are one 512-token chunk per
sequence ending at the given context. The bandwidth comes from a table for
accelerators (--bandwidth-gbs overrides it); on CPU it is measured in the same
run with a large array copy. Also times the KV write (a fused, in-place XLA
scatter into the donated cache) for one decode step.

Needs only jax and this repository (no gguf, FastAPI or model file), so it
runs from the source tree on a lent GPU. On CPU the Pallas kernel runs in
interpret mode, whose timings say nothing about a real lowering.
"""

from __future__ import annotations

import argparse
import functools
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

from benchmarks.roofline import PEAK_BANDWIDTH_GBS, measure_limits, median_time  # noqa: F401 (re-exported)
from kernels_pallas.attention import paged_attention, select_attention
from kernels_pallas.kv_storage import storage_dtype
from kernels_pallas.paged_attention_xla import write_kv_pages
from model.attention_metadata import AttentionMetadata

HEAD_CONFIGS = {  # name: (num_heads, kv_heads, head_dim)
    "gemma3-270m": (4, 1, 256),
    "llama3-8b": (32, 8, 128),
}


def device_bandwidth_gbs(override: float | None) -> tuple[float, str]:
    """(GB/s, where the figure comes from): a datasheet figure, the override, or the copy probe."""
    limits = measure_limits(dtypes=(), bandwidth_override=override)
    return limits.bandwidth_gbs, f"{limits.device}, {limits.bandwidth_source}"


def make_case(kind, batch, context, page_size, heads, dtype, chunk=512, seed=0):
    """Inputs of one step (q, k_pages, v_pages, metadata) and the bytes it must move."""
    num_heads, kv_heads, head_dim = heads
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    table = jnp.asarray(1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq), jnp.int32)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    q_len = 1 if kind == "decode" else min(chunk, context)
    tokens = batch * q_len
    q = jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), dtype)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((tokens,), jnp.int32), page_table=table, kv_lens=kv_lens,
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32) * q_len, num_seqs=jnp.int32(batch), mode=kind)
    live_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    io_bytes = 2 * q.size * q.dtype.itemsize
    return (q, k, v, md), live_bytes + io_bytes


def time_kv_write(batch, heads, dtype, page_size=16, num_pages=4096, layers=18, iters=20) -> float:
    """Seconds for one decode step's KV write into the stacked, donated cache (all layers)."""
    _, kv_heads, head_dim = heads
    shape = (layers, kv_heads, num_pages, page_size, head_dim)
    stored = storage_dtype(dtype, jax.default_backend())  # as the engine stores it (bf16 as bits on CPU)
    kc, vc = jnp.zeros(shape, stored), jnp.zeros(shape, stored)
    new = jnp.ones((batch, kv_heads, head_dim), dtype)
    slots = jnp.arange(batch, dtype=jnp.int32) * page_size + page_size

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def write_all_layers(kc, vc):
        for layer in range(layers):
            kc, vc = write_kv_pages(kc, vc, new, new, slots, layer=layer)
        return kc, vc

    kc, vc = write_all_layers(kc, vc)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        kc, vc = write_all_layers(kc, vc)
        jax.block_until_ready(kc)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the larger sweep")
    ap.add_argument("--batch", type=int, nargs="+")
    ap.add_argument("--context", type=int, nargs="+")
    ap.add_argument("--page-size", type=int, nargs="+")
    ap.add_argument("--heads", nargs="+", choices=sorted(HEAD_CONFIGS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impls", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
    ap.add_argument("--kinds", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--no-kv-write", dest="kv_write", action="store_false", help="skip the KV-write timing")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth-gbs", type=float)
    args = ap.parse_args(argv)

    batches = args.batch or ([1, 8, 32, 64, 128] if args.full else [1, 8, 64])
    contexts = args.context or ([512, 2048, 4096, 8192] if args.full else [512, 4096])
    page_sizes = args.page_size or ([16, 32, 64] if args.full else [16, 64])
    heads = args.heads or sorted(HEAD_CONFIGS)
    kinds = args.kinds
    dtype = jnp.dtype(args.dtype)
    interpret = jax.default_backend() == "cpu"
    bw, bw_src = device_bandwidth_gbs(args.bandwidth_gbs)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"bandwidth {bw:.0f} GB/s ({bw_src}); dtype {dtype.name}"
          + ("; Pallas in interpret mode (timings not meaningful)" if interpret else ""))
    print(f"{'kind':7} {'heads':12} {'batch':>5} {'ctx':>5} {'page':>4} {'impl':7} {'ms':>8} {'GB/s':>8} "
          f"{'of peak':>8} {'max err':>9}")
    for kind, h, b, c, ps in itertools.product(kinds, heads, batches, contexts, page_sizes):
        if kind == "prefill" and b > 8:
            continue  # a prefill step holds a few sequences, not a decode batch
        (q, k, v, md), nbytes = make_case(kind, b, c, ps, HEAD_CONFIGS[h], dtype)
        scale = HEAD_CONFIGS[h][2] ** -0.5
        fns = {impl: jax.jit(functools.partial(paged_attention, scale=scale,
                                               config=select_attention(impl, jax.default_backend())))
               for impl in ("xla", "pallas")}
        ref = np.asarray(fns["xla"](q, k, v, md).astype(jnp.float32))
        for impl in args.impls:
            try:
                out = fns[impl](q, k, v, md)
                err = float(np.abs(np.asarray(out.astype(jnp.float32)) - ref).max())
                t = median_time(lambda: fns[impl](q, k, v, md), args.iters)
            except Exception as e:  # a lowering or launch failure is a result too
                print(f"{kind:7} {h:12} {b:5} {c:5} {ps:4} {impl:7} FAILED: {type(e).__name__}: {str(e)[:200]}")
                continue
            gbs = nbytes / t / 1e9
            print(f"{kind:7} {h:12} {b:5} {c:5} {ps:4} {impl:7} {t * 1e3:8.3f} {gbs:8.1f} {gbs / bw:8.1%} "
                  f"{err:9.2e}", flush=True)
    if args.kv_write:
        for h in heads:
            for b in batches:
                t = time_kv_write(b, HEAD_CONFIGS[h], dtype, iters=max(1, min(args.iters, 5)))
                print(f"kv-write {h:12} batch {b:4}: {t * 1e3:.3f} ms for 18 layers (fused XLA scatter into the donated cache)")


if __name__ == "__main__":
    main()
