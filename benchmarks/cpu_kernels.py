"""Our int8 and bf16 matmul kernels (``kernels_cpu``) against XLA's dots, with the memory
bandwidth they are up against, measured in one run.

    python -m benchmarks.cpu_kernels                       # rows 1 2 4 8 32
    python -m benchmarks.cpu_kernels --rows 1 --iters 5 --workloads head

Workloads at Gemma 3 270M's shapes, random weights:

  * head: the tied output head ``[T, 640] x [262144, 640]^T`` ("sd,vd->sv"; weight [N, K]).
  * layer: one layer matrix ``[T, 640] x [640, 2048]`` ("td,df->tf"; weight [K, N]).
  * layers: the 18 layers' seven matmuls in one ``lax.scan``, as ``benchmarks.quantized_dot``.

Variants, each a whole ``Compute.dot`` as the model calls it: "bf16" (bfloat16 weights, the
CPU policy's one-row-as-two), "xla" (per-channel int8 weights, the "int8x2" dot as served
today: XLA's int8 dot), "kernel" (the same dot with its integer product in our kernel,
``kernels_cpu.Int8Matmul``: the same bits), "kernel-1t" (the kernel on the calling thread
only), "kernel-avx2" (the AVX2 path, forced), "kernel-strips" (the AVX-512 path's [K, N]
weights walked one 64-column strip down all of K, as before 2026-12-07: the baseline of its row
sweep; ``$XLASERVE_CPU_KERNELS_KN=strips``) and "kernel-amx" (the AMX-INT8 tiles, forced at
every row count; the default server takes them above 4 int8 rows). The table gives the median ms per call, the
kernel's speed-up over "xla", and the weight bytes each int8 variant reads per second (int8
values and scales / time).

bfloat16 weights (issue 42; a second table): "bf16" (XLA's bf16 dot, as above) against
"bf16-kernel" (``kernels_cpu.Bf16Matmul`` through ``Compute.bf16_matmul``) and
"bf16-kernel-avx2" (its AVX2 path, forced), "bf16-kernel-avx512" and "bf16-kernel-amx" (those
paths forced; "bf16-kernel" takes amx for the head where it runs), and "bf16-served" (XLA's bf16
dot with the batch-invariant row padding of the default bf16 server: at least 4 rows a tile of
16), with the bf16 weight bytes each reads per second and the first kernel's share of the read
ceiling; "kernel / xla" is over "bf16-served" when it is measured, else over "bf16".

The bandwidth probe copies a 512 MiB float32 array with NumPy, on one thread and on two
threads (each copying half), and prints bytes moved per second (read + write) and bytes read
per second (half of it); a matrix-vector product only reads, so "read GB/s" is its ceiling.
The 1-minute load average is printed at the start and the end: on a shared machine, read
the ratios measured within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import kernels_cpu
from benchmarks.quantized_dot import D, nbytes, weights
from benchmarks.roofline import median_time
from model.compute import Compute
from serving.engine.backend_policy import CPU_INVARIANT_DOT_ROWS

VARIANTS = ("bf16", "xla", "kernel", "kernel-1t", "kernel-avx2", "kernel-strips", "kernel-amx", "bf16-kernel",
            "bf16-kernel-avx2",
            "bf16-served", "bf16-kernel-avx512", "bf16-kernel-amx")
BF16_VARIANTS = ("bf16", "bf16-kernel", "bf16-kernel-avx2", "bf16-served", "bf16-kernel-avx512", "bf16-kernel-amx")
WORKLOADS = ("head", "layer", "layers")
F = 2048


def copy_bandwidth(threads: int, mib: int = 512, iters: int = 5) -> float:
    """Bytes moved (read + write) per second by NumPy copies of a ``mib`` MiB array on ``threads``."""
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]

    def run():
        ts = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in bounds]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def _compute(variant: str) -> Compute:
    if variant.startswith("bf16-kernel"):
        isa = variant.removeprefix("bf16-kernel").removeprefix("-") or "auto"
        return Compute(pad_single_row=True, bf16_matmul=kernels_cpu.Bf16Matmul(isa=isa))
    if variant == "bf16-served":
        return Compute(pad_single_row=True, dot_rows=CPU_INVARIANT_DOT_ROWS)
    matmul = {"kernel": kernels_cpu.Int8Matmul(), "kernel-1t": kernels_cpu.Int8Matmul(),
              "kernel-strips": kernels_cpu.Int8Matmul(),
              "kernel-avx2": kernels_cpu.Int8Matmul(isa="avx2"),
              "kernel-amx": kernels_cpu.Int8Matmul(isa="amx")}.get(variant)
    return Compute(pad_single_row=True, quantized_dot="int8x2", int8_matmul=matmul)


def _fn(workload: str, variant: str):
    compute = _compute(variant)
    if workload == "head":
        return jax.jit(lambda x, w: compute.dot("sd,vd->sv", x, w, jnp.bfloat16))
    if workload == "layer":
        return jax.jit(lambda x, w: compute.dot("td,df->tf", x, w, jnp.bfloat16))

    def run(x, ws):
        def layer(h, p):
            p = {n: compute.load(w) for n, w in p.items()}
            dot = compute.dot
            q = dot("td,de->te", h, p["wq"], jnp.bfloat16)
            kv = dot("td,de->te", h, p["wk"], jnp.bfloat16) + dot("td,de->te", h, p["wv"], jnp.bfloat16)
            h = h + 0.1 * dot("te,ed->td", q + jnp.tile(kv, (1, q.shape[1] // kv.shape[1])), p["wo"],
                              jnp.bfloat16)
            g = dot("td,df->tf", h, p["w_gate"], jnp.bfloat16)
            u = dot("td,df->tf", h, p["w_up"], jnp.bfloat16)
            h = h + 0.1 * dot("tf,fd->td", jax.nn.gelu(g) * u, p["w_down"], jnp.bfloat16)
            return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6), None

        return jax.lax.scan(layer, x, ws)[0]

    return jax.jit(run)


def _weights(rng, workloads):
    """{workload: {"bf16": weights, "int8": weights}}."""
    from model.quantization import quantize_per_channel

    out = {}
    if "head" in workloads or "layers" in workloads:  # (both: building them takes a while)
        w = weights(rng)  # benchmarks.quantized_dot's: head and stacked layers, bf16 and int8
        out.update({k: {"bf16": w[k]["bf16"], "int8": w[k]["int8x2"]} for k in ("head", "layers")})
    layer = rng.standard_normal((D, F), np.float32) / np.sqrt(D)
    out["layer"] = {"bf16": jnp.asarray(layer, jnp.bfloat16), "int8": quantize_per_channel(layer, (0,))}
    return out


VARIANT_ENV = {"kernel-1t": ("XLASERVE_CPU_KERNELS_THREADS", "1"), "kernel-strips": ("XLASERVE_CPU_KERNELS_KN", "strips")}
"""The kernel's environment setting each variant runs under (read by the kernel at each call)."""


def _time(fn, x, w, variant: str, iters: int) -> float:
    name, value = VARIANT_ENV.get(variant, (None, None))
    env = os.environ.get(name) if name else None
    if name:
        os.environ[name] = value
    try:
        jax.block_until_ready(fn(x, w))  # compile
        return median_time(lambda: fn(x, w), iters)
    finally:
        if name:
            if env is None:
                os.environ.pop(name)
            else:
                os.environ[name] = env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--copy-mib", type=int, default=512, help="the copy probe's array, MiB")
    args = ap.parse_args(argv)
    if not kernels_cpu.available():
        print(f"the CPU kernels are unavailable: {kernels_cpu.load_error()}")
        return 1
    variants = [v for v in args.variants if not v.endswith(("avx2", "amx", "avx512"))
                or ("amx_int8" if v == "kernel-amx" else v.rsplit("-", 1)[1]) in kernels_cpu.isas()]
    bf16_variants = [v for v in variants if v in BF16_VARIANTS]
    variants = [v for v in variants if v not in BF16_VARIANTS[1:]]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; jax {jax.__version__}; kernel paths "
          f"{kernels_cpu.isas()}; cores usable {len(os.sched_getaffinity(0))}")
    copy = {t: copy_bandwidth(t, args.copy_mib) for t in (1, 2)}
    for t, bw in copy.items():
        print(f"copy probe, {t} thread(s): {bw / 1e9:.1f} GB/s moved, {bw / 2e9:.1f} GB/s read")
    read_ceiling = max(copy.values()) / 2
    rng = np.random.default_rng(0)
    ws = _weights(rng, args.workloads)
    int8_variants = [v for v in variants if v != "bf16"]
    if not int8_variants:
        variants = []
    if variants:
        print("\n| workload | rows | " + " | ".join(f"{v} ms" for v in variants)
              + " | kernel / xla | " + " | ".join(f"{v} GB/s" for v in int8_variants) + " | kernel % of read |")
        print("|---" * (4 + len(variants) + len(int8_variants)) + "|")
    for workload in args.workloads if variants else ():
        fns = {v: _fn(workload, v) for v in variants}
        wbytes = nbytes(ws[workload]["int8"])
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
            ms = {v: 1e3 * _time(fns[v], x, ws[workload]["bf16" if v == "bf16" else "int8"], v, args.iters)
                  for v in variants}
            speed = f"{ms['xla'] / ms['kernel']:.2f}x" if "xla" in ms and "kernel" in ms else "-"
            gbs = {v: wbytes / (ms[v] / 1e3) / 1e9 for v in int8_variants}
            share = f"{100 * gbs['kernel'] * 1e9 / read_ceiling:.0f}%" if "kernel" in gbs else "-"
            print(f"| {workload} | {rows} | " + " | ".join(f"{ms[v]:.2f}" for v in variants) + f" | {speed} | "
                  + " | ".join(f"{gbs[v]:.1f}" for v in int8_variants) + f" | {share} |", flush=True)
    if len(bf16_variants) > 1:
        _bf16_table(args, ws, bf16_variants, read_ceiling, rng)
    for workload in args.workloads:
        print(f"{workload}: int8 weights + scales {nbytes(ws[workload]['int8']) / 1e6:.1f} MB, "
              f"bf16 {nbytes(ws[workload]['bf16']) / 1e6:.1f} MB")
    print(f"(kernel % of read: the kernel's weight GB/s over the faster copy probe's read GB/s, "
          f"{read_ceiling / 1e9:.1f})")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


def _bf16_table(args, ws, variants, read_ceiling, rng) -> None:
    """The bf16 kernel's table: ms per call, speed-up over XLA's bf16 dot, weight GB/s."""
    kernels = [v for v in variants if v.startswith("bf16-kernel")] or variants[-1:]
    base = "bf16-served" if "bf16-served" in variants else "bf16"
    print("\n| workload | rows | " + " | ".join(f"{v} ms" for v in variants) + " | kernel / xla | "
          + " | ".join(f"{v} GB/s" for v in variants) + " | kernel % of read |")
    print("|---" * (4 + 2 * len(variants)) + "|")
    for workload in args.workloads:
        fns = {v: _fn(workload, v) for v in variants}
        wbytes = nbytes(ws[workload]["bf16"])
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
            ms = {v: 1e3 * _time(fns[v], x, ws[workload]["bf16"], v, args.iters) for v in variants}
            speed = f"{ms[base] / ms[kernels[0]]:.2f}x" if base in ms else "-"
            gbs = {v: wbytes / (ms[v] / 1e3) / 1e9 for v in variants}
            print(f"| {workload} | {rows} | " + " | ".join(f"{ms[v]:.2f}" for v in variants) + f" | {speed} | "
                  + " | ".join(f"{gbs[v]:.1f}" for v in variants)
                  + f" | {100 * gbs[kernels[0]] * 1e9 / read_ceiling:.0f}% |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
