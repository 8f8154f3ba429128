"""MoE expert matmuls: dropless ``ragged_dot`` against the capacity einsum (model/moe.py).

    python -m benchmarks.moe_dispatch [--hidden 1024 --mlp 3584 --experts 8 --top-k 2]

Times one jitted MoE layer (router, dispatch, SwiGLU experts, combine) on
JAX's default device for decode-sized and prefill-sized token counts, and
prints milliseconds per call (median of repeats, after a warm-up call).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.moe import moe_ffn

IMPLS = ("ragged", "capacity")


def time_layer(impl: str, T: int, D: int, F: int, E: int, k: int, dtype, repeats: int) -> float:
    rng = np.random.default_rng(0)
    p = {"router": jnp.asarray(rng.normal(size=(D, E)), jnp.float32),
         "w_gate": jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype),
         "w_up": jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype),
         "w_down": jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), dtype)}
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    fn = jax.jit(lambda x, p: moe_ffn(x, p, k=k, dtype=dtype, impl=impl))
    fn(x, p).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x, p).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mlp", type=int, default=3584)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    print(f"device {jax.devices()[0].device_kind}; D={a.hidden} F={a.mlp} E={a.experts} "
          f"top-{a.top_k} {a.dtype}")
    print("tokens | " + " | ".join(f"{i} ms" for i in IMPLS))
    for T in map(int, a.tokens.split(",")):
        ms = [time_layer(i, T, a.hidden, a.mlp, a.experts, a.top_k, dtype, a.repeats) * 1e3
              for i in IMPLS]
        print(f"{T:6d} | " + " | ".join(f"{m:8.2f}" for m in ms), flush=True)


if __name__ == "__main__":
    main()
