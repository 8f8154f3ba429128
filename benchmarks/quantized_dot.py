"""The dots of a decode step with int8 weights against bfloat16, side by side in one run.

    python -m benchmarks.quantized_dot                  # Gemma 3 270M's shapes, rows 1 2 8 32
    python -m benchmarks.quantized_dot --rows 2 --iters 5

Two workloads at Gemma 3 270M's shapes, random weights:

  * head: the tied output head ``[T, 640] x [262144, 640]^T`` ("sd,vd->sv").
  * layers: the 18 layers' seven matmuls (q, k, v, o, gate, up, down) in one
    ``lax.scan`` over stacked weights, as the decoder runs them (bfloat16 weights
    held as uint16 bits and bit-cast after the slice, as the CPU policy stores them).

Formulations (``model.quantization``): bf16 (``Compute.dot``, one row computed
as two, as the CPU policy does), and with per-channel int8 weights "dequantize"
(the int8 -> bf16 convert fused into the dot), "int8" (int8 activations x int8
weights, int32 accumulation) and "int8x2" (activations as two int8 terms in one
dot of 2T rows). Prints the median time per call, the ratio to bf16 and the
weight bytes each reads, and the 1-minute load average at the start and end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.roofline import median_time
from kernels_pallas.kv_storage import to_storage
from model.compute import Compute
from model.quantization import QuantizedArray, quantize_per_channel

V, D, L, NH, KVH, F = 262144, 640, 18, 1024, 256, 2048
LAYER_SHAPES = {"wq": (D, NH), "wk": (D, KVH), "wv": (D, KVH), "wo": (NH, D),
                "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
FORMULATIONS = ("bf16", "dequantize", "int8", "int8x2")


def _compute(formulation: str) -> Compute:
    return Compute(pad_single_row=True, quantized_dot="int8" if formulation == "bf16" else formulation)


def head_fn(formulation: str):
    compute = _compute(formulation)
    return jax.jit(lambda x, w: compute.dot("sd,vd->sv", x, w, jnp.bfloat16))


def layers_fn(formulation: str):
    compute = _compute(formulation)

    def run(x, ws):
        def layer(h, p):
            p = {n: compute.load(w) for n, w in p.items()}
            dot = compute.dot
            q = dot("td,de->te", h, p["wq"], jnp.bfloat16)
            kv = dot("td,de->te", h, p["wk"], jnp.bfloat16) + dot("td,de->te", h, p["wv"], jnp.bfloat16)
            h = h + 0.1 * dot("te,ed->td", q + jnp.tile(kv, (1, NH // KVH)), p["wo"], jnp.bfloat16)
            g = dot("td,df->tf", h, p["w_gate"], jnp.bfloat16)
            u = dot("td,df->tf", h, p["w_up"], jnp.bfloat16)
            h = h + 0.1 * dot("tf,fd->td", jax.nn.gelu(g) * u, p["w_down"], jnp.bfloat16)
            return h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6), None

        return jax.lax.scan(layer, x, ws)[0]

    return jax.jit(run)


def weights(rng):
    """{workload: {formulation: weights}} and the bytes each formulation's weights take."""
    head = rng.standard_normal((V, D), np.float32) * 0.05
    head_q = quantize_per_channel(head, (1,))
    layers = {n: rng.standard_normal((L,) + s, np.float32) / np.sqrt(s[0]) for n, s in LAYER_SHAPES.items()}
    layers_bf16 = {n: to_storage(jnp.asarray(w, jnp.bfloat16), jnp.uint16) for n, w in layers.items()}
    layers_q = {n: quantize_per_channel(w, (1,)) for n, w in layers.items()}
    out = {"head": {"bf16": jnp.asarray(head, jnp.bfloat16)}, "layers": {"bf16": layers_bf16}}
    for f in FORMULATIONS[1:]:
        out["head"][f], out["layers"][f] = head_q, layers_q
    return out


def nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree, is_leaf=lambda a: isinstance(a, QuantizedArray))
               for a in ([a.values, a.scales] if isinstance(a, QuantizedArray) else [a]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--formulations", nargs="+", default=list(FORMULATIONS), choices=FORMULATIONS)
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; jax {jax.__version__}, {jax.devices()[0]}")
    rng = np.random.default_rng(0)
    ws = weights(rng)
    fns = {"head": head_fn, "layers": layers_fn}
    print("| workload | rows | " + " | ".join(f"{f} ms" for f in args.formulations)
          + " | " + " | ".join(f"{f} / bf16" for f in args.formulations if f != "bf16") + " |")
    print("|---" * (2 + 2 * len(args.formulations) - ("bf16" in args.formulations)) + "|")
    for workload in ("head", "layers"):
        compiled = {f: fns[workload](f) for f in args.formulations}
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
            ms = {}
            for f in args.formulations:
                w = ws[workload][f]
                jax.block_until_ready(compiled[f](x, w))  # compile
                ms[f] = 1e3 * median_time(lambda: compiled[f](x, w), args.iters)
            base = ms.get("bf16")
            ratios = [f"{base / ms[f]:.2f}x" if base else "-" for f in args.formulations if f != "bf16"]
            print(f"| {workload} | {rows} | " + " | ".join(f"{ms[f]:.1f}" for f in args.formulations)
                  + " | " + " | ".join(ratios) + " |", flush=True)
    for workload in ("head", "layers"):
        print(f"{workload} weight bytes: bf16 {nbytes(ws[workload]['bf16']) / 1e6:.0f} MB, "
              f"int8 + scales {nbytes(ws[workload]['int8']) / 1e6:.0f} MB")
    print("(ratio: bf16 time / this formulation's time; above 1 is faster than bf16)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
