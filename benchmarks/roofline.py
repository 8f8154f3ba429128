"""Roofline pieces shared by the engine and device benchmarks: machine probes and per-step costs.

The limits come from the machine the benchmark runs on, in the same run:

* memory bandwidth: a JAX stream copy (``y = x + 1`` over 256 MiB: read and
  write) and a JAX read (``sum(x)``); the larger of the two is the limit. On an
  accelerator whose kind is in :data:`PEAK_BANDWIDTH_GBS` the datasheet figure
  is the limit instead (the probe is printed beside it).
* matmul rate: a ``[512, 2048] x [2048, 2048]`` product (8192 cubed on an
  accelerator) in the model's compute dtype (float32, or bfloat16 inputs with float32 accumulation, as the model
  runs it).

A step's cost (:func:`step_cost`) counts the bytes it must move (every weight
the step multiplies by once, the KV entries its queries attend to and the ones
it writes) and its FLOPs (2 per multiply-add: the projections, the MLP, the
output head for the rows whose logits are sampled, and attention over the keys
each query sees, sliding windows included). Its floor is
``max(bytes / bandwidth, FLOPs / matmul rate)``; the fraction printed is that
floor over the measured step time (1.0 = at the limit).

Needs only jax and numpy (it runs from the source tree on a lent GPU).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

PEAK_BANDWIDTH_GBS = {  # HBM bandwidth by device kind (substring match), GB/s; datasheets
    "H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "TPU v5 lite": 819.0, "TPU v6": 1640.0,
}


def median_time(fn, iters: int) -> float:
    """Median wall time of ``fn()`` (blocked until ready) over ``iters`` calls, in seconds."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class MachineLimits:
    """Limits measured on this machine (or taken from a datasheet), in SI units.

    Attributes:
      device: device kind and backend, for the report.
      copy_gbs: JAX stream copy, (read + written bytes) / s / 1e9.
      read_gbs: JAX reduction, read bytes / s / 1e9.
      bandwidth_gbs: the limit used (max of the probes, or the datasheet figure).
      bandwidth_source: "measured" or "<kind> datasheet".
      matmul_gflops: {compute dtype name: measured GFLOP/s}.
    """

    device: str
    copy_gbs: float
    read_gbs: float
    bandwidth_gbs: float
    bandwidth_source: str
    matmul_gflops: dict

    def describe(self) -> str:
        mm = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in self.matmul_gflops.items())
        return (f"{self.device}: stream copy {self.copy_gbs:.1f} GB/s, read {self.read_gbs:.1f} GB/s; "
                f"bandwidth limit {self.bandwidth_gbs:.1f} GB/s ({self.bandwidth_source}); matmul {mm}")


def measure_limits(dtypes=("float32", "bfloat16"), mib: int = 256, iters: int = 5,
                   bandwidth_override: float | None = None) -> MachineLimits:
    """Runs the bandwidth and matmul probes (a few seconds on a 2-core CPU)."""
    # Donated, so the copy writes into memory it has touched before (no page faults).
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    read = jax.jit(jnp.sum)
    box = [copy(jnp.ones((mib * 1024 * 1024 // 4,), jnp.float32))]
    nbytes = box[0].nbytes

    def copy_once():
        box[0] = copy(box[0])
        return box[0]

    copy_once()
    read(box[0]).block_until_ready()
    copy_gbs = 2 * nbytes / median_time(copy_once, iters) / 1e9
    read_gbs = nbytes / median_time(lambda: read(box[0]), iters) / 1e9
    box.clear()
    kind = jax.devices()[0].device_kind
    device = f"{kind} ({jax.default_backend()})"
    bw, src = max(copy_gbs, read_gbs), "measured"
    for name, gbs in PEAK_BANDWIDTH_GBS.items():
        if name in kind:
            bw, src = gbs, f"{name} datasheet"
    if bandwidth_override:
        bw, src = bandwidth_override, "given"
    # Large enough to be compute-bound: a few ms on a 2-core CPU, ~1 ms on an H200.
    m, k, n = (512, 2048, 2048) if jax.default_backend() == "cpu" else (8192, 8192, 8192)
    mm = {}
    for name in dtypes:
        dt = jnp.dtype(name)
        a = jnp.ones((m, k), dt)
        b = jnp.ones((k, n), dt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        mm[dt.name] = 2 * m * k * n / median_time(lambda: f(a, b), iters) / 1e9
    return MachineLimits(device, copy_gbs, read_gbs, bw, src, mm)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs one step must move and compute.

    Attributes:
      weight_bytes: every matmul weight once, plus the norms.
      kv_bytes: KV entries read by attention (live keys only) plus those written.
      flops: multiply-adds x 2.
    """

    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def matmul_params(cfg) -> tuple[int, int]:
    """(weights multiplied per token in the layers, in the output head) of a ModelConfig."""
    D, N, K, H, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
    return cfg.num_layers * per_layer, cfg.vocab_size * D


def _keys_seen(cfg, layer: int, position: int) -> int:
    """Keys a query at ``position`` attends to in ``layer`` (itself included)."""
    keys = position + 1
    if not cfg.is_global_layer(layer) and cfg.sliding_window > 0:
        keys = min(keys, cfg.sliding_window)
    return keys


def step_cost(cfg, weight_dtype, kv_dtype, *, queries: list[tuple[int, int]], logits_rows: int) -> StepCost:
    """Cost of one step.

    Args:
      cfg: the ModelConfig.
      weight_dtype, kv_dtype: dtypes (their item sizes count).
      queries: (first position, number of tokens) per sequence in the step:
        a decode row is (context - 1, 1), a prompt chunk (start, length).
      logits_rows: rows that go through the output head.
    """
    w_item = jnp.dtype(weight_dtype).itemsize
    kv_item = jnp.dtype(kv_dtype).itemsize
    layer_mm, head_mm = matmul_params(cfg)
    D, N, K, H, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    norms = (4 * L * D + 2 * L * H + D) * 4
    weight_bytes = (layer_mm + head_mm) * w_item + norms
    tokens = sum(n for _, n in queries)
    flops = 2 * tokens * layer_mm + 2 * logits_rows * head_mm
    kv_read = 0
    for start, n in queries:
        last = start + n - 1
        for layer in range(L):
            # Keys read once per sequence: the widest window any of its queries needs.
            keys = min(last + 1, _keys_seen(cfg, layer, last) + n - 1)
            kv_read += keys
            pairs = sum(_keys_seen(cfg, layer, p) for p in range(start, start + n)) if n <= 4096 else n * keys
            flops += 2 * 2 * N * H * pairs  # q.k and p.v
    kv_bytes = (kv_read + tokens * L) * 2 * K * H * kv_item
    return StepCost(weight_bytes, kv_bytes, flops)


def roofline_line(cost: StepCost, seconds: float, limits: MachineLimits, compute_dtype) -> str:
    """'W MB weights + KV MB, G GFLOP: memory floor a ms (x of BW), compute floor b ms (y of rate)'."""
    rate = limits.matmul_gflops.get(jnp.dtype(compute_dtype).name) or max(limits.matmul_gflops.values())
    mem_floor = cost.bytes / (limits.bandwidth_gbs * 1e9)
    cmp_floor = cost.flops / (rate * 1e9)
    bound = "memory" if mem_floor >= cmp_floor else "compute"
    return (f"{cost.weight_bytes / 1e6:.0f} MB weights + {cost.kv_bytes / 1e6:.0f} MB KV, "
            f"{cost.flops / 1e9:.2f} GFLOP; floors: memory {mem_floor * 1e3:.1f} ms "
            f"({mem_floor / seconds:.0%} of {limits.bandwidth_gbs:.0f} GB/s reached), "
            f"compute {cmp_floor * 1e3:.1f} ms ({cmp_floor / seconds:.0%} of {rate:.0f} GFLOP/s); "
            f"{bound}-bound")


def fractions(cost: StepCost, seconds: float, limits: MachineLimits, compute_dtype) -> dict:
    """The roofline numbers as a dict (for JSON output)."""
    rate = limits.matmul_gflops.get(jnp.dtype(compute_dtype).name) or max(limits.matmul_gflops.values())
    return dict(weight_bytes=cost.weight_bytes, kv_bytes=cost.kv_bytes, flops=cost.flops,
                memory_floor_s=cost.bytes / (limits.bandwidth_gbs * 1e9),
                compute_floor_s=cost.flops / (rate * 1e9),
                bandwidth_fraction=cost.bytes / (limits.bandwidth_gbs * 1e9) / seconds,
                compute_fraction=cost.flops / (rate * 1e9) / seconds)
