"""Engine benchmark without HTTP: prefill tokens/s per bucket, decode tokens/s per slot count and
context, each with a roofline line against limits measured in the same run.

    python -m benchmarks.engine                                  # Gemma 3 270M, server dtype
    python -m benchmarks.engine --dtype float32 bfloat16         # both, interleaved
    python -m benchmarks.engine --shape gemma3-270m --dtype bfloat16   # random weights, no GGUF
    python -m benchmarks.engine --quantization none int8         # bf16 against int8 weights, interleaved
    python -m benchmarks.engine --quantization int8 --cpu-kernels off on   # XLA's int8 dot against ours
    python -m benchmarks.engine --quantization int8 --cpu-kernels auto auto-strips   # the kernel's [K, N] row sweep against its strip walk
    python -m benchmarks.engine --baselines llama.cpp transformers --streams 1 8 32
    xlaserve bench engine ...                                    # the same

Each decode row's roofline line is followed by where its time goes: its
attention and its output head timed alone at the step's shapes, and the rest
(``benchmarks.step_parts``; ``--no-parts`` skips it).

Decode rows are timed on the engine's own step (``Engine.decode``), steps
dispatched back to back as the batching loop dispatches them (the sampled
tokens stay on device), and the time per step is the median over
``--repeats`` runs of ``--steps`` steps. Prefill is one prompt chunk of each
token bucket at position 0. With several dtypes, each (slots, context) cell
and each prefill bucket is measured for every dtype in turn before the next
cell, the variants' timed runs alternated, so a neighbour's load hits all
dtypes alike; read ratios, not absolute numbers.

``--baselines`` adds an end-to-end comparison on the same prompts (token
ids, so no tokenizer difference) and the same GGUF: for each stream count N,
N prompts of ``--prompt-len`` tokens decode ``--new-tokens`` tokens each,
through our engine loop and through each baseline (``benchmarks.baselines``),
alternating ours and theirs for ``--rounds`` rounds; medians and ratios are
printed. Decode tokens/s counts tokens after each stream's first over the time
after the first token; end-to-end counts every generated token over the whole
time including prefill.

Needs only jax, flax and numpy for ``--shape`` (random weights): it runs
from the source tree on a lent GPU (``benchmarks/device.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/engine.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.roofline import fractions, measure_limits, roofline_line, step_cost
from benchmarks.step_parts import decode_parts
from model.config import ModelConfig

SHAPES = {
    # Gemma 3 270M's shapes (reference README).
    "gemma3-270m": ModelConfig(
        name="gemma3-270m-shaped", vocab_size=262144, num_layers=18, hidden_size=640, num_heads=4,
        num_kv_heads=1, head_dim=256, mlp_dim=2048, query_pre_attn_scalar=256.0, max_position=32768),
    # Llama-3-8B's widths (4096 wide, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256)
    # on this Gemma-style decoder, every layer global; 4 of its 32 layers by default
    # (--layers), so weights fit a short run. Per-layer numbers scale to 32 layers.
    "llama3-8b": ModelConfig(
        name="llama3-8b-shaped", vocab_size=128256, num_layers=4, hidden_size=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, mlp_dim=14336, sliding_window_pattern=0,
        rope_theta_global=500000.0, max_position=8192),
    # Tests: tiny sizes with the 270M's head layout.
    "tiny": ModelConfig(
        name="tiny-shaped", vocab_size=512, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
        head_dim=32, mlp_dim=128, sliding_window=32, sliding_window_pattern=2, max_position=4096),
}


def random_model(shape: str, dtype: str, layers: int | None = None, seed: int = 0,
                 quantization: str = "none"):
    """A Gemma3 with random weights in a named shape (SHAPES). Needs no GGUF or tokenizer."""
    from flax import nnx

    from model.gemma3 import Gemma3

    cfg = SHAPES[shape]
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    model = Gemma3(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    if quantization == "none":
        return model
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    return Gemma3(cfg, dtype=jnp.dtype(dtype), params=params, quantization=quantization)


def variant(dtype: str, quantization: str) -> str:
    """The label of a (dtype, quantization) pair: "bfloat16", "bfloat16+int8"."""
    return dtype if quantization == "none" else f"{dtype}+{quantization}"


def variant_parts(label: str) -> tuple[str, str]:
    """(dtype, the dtype whose item size the weights take) of a :func:`variant` label."""
    dtype, _, quantization = label.partition("+")
    return dtype, quantization or dtype


def load_named_model(name: str, dtype: str, quantization: str = "none"):
    """(model, tokenizer) from configs/models.yaml or a GGUF path (needs the gguf extra)."""
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.loading.model_registry import load_model

    enable_compilation_cache()
    return load_model(name, dtype=dtype, progress=False, quantization=quantization)


def make_engine(model, dtype: str, max_slots: int, max_context: int, page_size: int = 16,
                prefill_chunk: int = 512, whole_table_attention: bool = False, cpu_kernels: str = "auto"):
    """An Engine sized for ``max_slots`` sequences of ``max_context`` tokens, KV in ``dtype``
    (``whole_table_attention``: sliding layers' decode reads the whole page table, the
    formulation before the window gather, as a baseline; ``cpu_kernels``: the server's
    ``--cpu-kernels``)."""
    from serving.config.engine_config import EngineConfig
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.engine import Engine

    sliced = cpu_kernels == "auto-sliced"  # the layers' int8 matrices sliced out of their stacks first
    # (auto-strips: auto's program, its timed runs under kernel_env)
    xla_rows = cpu_kernels == "auto-xla-rows"  # XLA's int8 dot above the kernel's VNNI rows (no AMX)
    policy = BackendPolicy.detect(
        cpu_kernels="auto" if cpu_kernels in ("auto-sliced", "auto-strips", "auto-xla-rows") else cpu_kernels)
    if sliced and policy.int8_matmul is not None:
        policy = dataclasses.replace(policy, int8_matmul=dataclasses.replace(policy.int8_matmul, reads_stacked=False))
    if xla_rows and policy.int8_matmul is not None:
        policy = dataclasses.replace(policy, int8_matmul=dataclasses.replace(policy.int8_matmul, amx=False))
    if whole_table_attention:
        policy = dataclasses.replace(policy, attention=dataclasses.replace(policy.attention, window_gather=False))
    per_seq = -(-max_context // page_size)
    max_len = page_size * 2 ** math.ceil(math.log2(max(per_seq, 1)))
    return Engine(model, EngineConfig(
        max_slots=max_slots, page_size=page_size, num_pages=max_slots * per_seq + 1,
        max_model_len=max(max_len, prefill_chunk), prefill_chunk=prefill_chunk,
        min_decode_batch=1, kv_dtype=dtype), policy=policy)


KERNEL_ENV = {"auto-strips": ("XLASERVE_CPU_KERNELS_KN", "strips")}
"""``--cpu-kernels`` settings that are "auto" with a kernel environment setting, read by the
kernel at each call: "auto-strips", the int8 kernel's [K, N] layer matrices walked one 64-column
strip down all of K (its path before 2026-12-07, the baseline of the row sweep)."""


@contextlib.contextmanager
def kernel_env(label: str):
    """The environment of the engine labelled ``label`` (".../kernels-<setting>") while it runs."""
    setting = label.rpartition("/kernels-")[2]
    name, value = KERNEL_ENV.get(setting, (None, None))
    old = os.environ.get(name) if name else None
    if name:
        os.environ[name] = value
    try:
        yield
    finally:
        if name and old is None:
            os.environ.pop(name)
        elif name:
            os.environ[name] = old


def decode_rows(engine, slots: int, context: int) -> list:
    """``slots`` decode rows at ``context`` tokens, each on its own pages."""
    from serving.core.sched.step_plan import DecodeRow

    per_seq = -(-context // engine.cfg.page_size)
    return [DecodeRow(f"bench-{s}", s, context - 1, tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)))
            for s in range(slots)]


def time_decode(engine, slots: int, context: int, steps: int, repeats: int) -> float:
    """Seconds per decode step for ``slots`` rows at ``context`` tokens (median of repeats)."""
    rows = decode_rows(engine, slots, context)
    jax.block_until_ready(engine.decode(rows))  # compile (or cache hit) and warm up
    jax.block_until_ready(engine.decode(rows))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = engine.decode(rows)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def time_decode_interleaved(engines: dict, slots: int, context: int, steps: int, repeats: int) -> dict:
    """Seconds per decode step of each engine (median of repeats), the engines' timed runs
    alternated (A, B, A, B, ...) so a shared machine's load falls on every variant alike."""
    rows = {name: decode_rows(eng, slots, context) for name, eng in engines.items()}
    for name, eng in engines.items():
        with kernel_env(name):
            jax.block_until_ready(eng.decode(rows[name]))  # compile (or cache hit) and warm up
            jax.block_until_ready(eng.decode(rows[name]))
    times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            with kernel_env(name):
                t0 = time.perf_counter()
                for _ in range(steps):
                    out = eng.decode(rows[name])
                jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def _prefill_row(engine, tokens: int):
    from serving.core.sched.step_plan import PrefillRow

    ps = engine.cfg.page_size
    pages = tuple(range(1, 1 + -(-tokens // ps)))
    ids = tuple((7 * i + 3) % engine.model_cfg.vocab_size for i in range(tokens))
    return PrefillRow("bench", 0, 0, ids, pages, samples=True)


def time_prefill_interleaved(engines: dict, tokens: int, repeats: int) -> dict:
    """Seconds for one prefill step of a ``tokens``-token prompt at position 0 on each engine
    (median of repeats), the engines' timed runs alternated as in ``time_decode_interleaved``."""
    rows = {name: _prefill_row(eng, tokens) for name, eng in engines.items()}
    for name, eng in engines.items():
        with kernel_env(name):
            jax.block_until_ready(eng.prefill([rows[name]]))  # compile (or cache hit) and warm up
    times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, eng in engines.items():
            with kernel_env(name):
                t0 = time.perf_counter()
                jax.block_until_ready(eng.prefill([rows[name]]))
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run_engine_rows(models: dict, args, limits, report: dict) -> None:
    """The prefill and decode tables, every dtype (and ``--cpu-kernels`` setting) per cell in turn."""
    kernels = args.cpu_kernels
    engines = {(label if len(kernels) == 1 else f"{label}/kernels-{ck}"):
               make_engine(m, variant_parts(label)[0], max(args.slots),
                           max(max(args.context), max(args.prefill)), prefill_chunk=max(args.prefill),
                           whole_table_attention=args.whole_table_attention, cpu_kernels=ck)
               for label, m in models.items() for ck in kernels}
    models = {label: models[label.split("/")[0]] for label in engines}
    cfg = next(iter(models.values())).cfg
    print("\nprefill (one prompt per step, logits for its last token)")
    for T in args.prefill:
        interleaved = time_prefill_interleaved(engines, T, args.repeats)
        for dt in engines:
            t = interleaved[dt]
            kv_dt, w_dt = variant_parts(dt.split("/")[0])
            cost = step_cost(cfg, w_dt, kv_dt, queries=[(0, T)], logits_rows=1)
            print(f"  bucket {T:5} {dt:13}: {t * 1e3:8.1f} ms, {T / t:8.0f} tokens/s | "
                  f"{roofline_line(cost, t, limits, kv_dt)}", flush=True)
            report["prefill"].append(dict(bucket=T, dtype=dt, seconds=t, tokens_per_s=T / t,
                                          **fractions(cost, t, limits, kv_dt)))
    print("\ndecode (one token per slot per step)")
    for C in args.context:
        for B in args.slots:
            interleaved = time_decode_interleaved(engines, B, C, args.steps, args.repeats)
            for dt, eng in engines.items():
                t = interleaved[dt]
                kv_dt, w_dt = variant_parts(dt.split("/")[0])
                cost = step_cost(cfg, w_dt, kv_dt, queries=[(C - 1, 1)] * B, logits_rows=B)
                print(f"  slots {B:3} context {C:5} {dt:13}: {t * 1e3:8.1f} ms/step, "
                      f"{B / t:8.1f} tokens/s | {roofline_line(cost, t, limits, kv_dt)}", flush=True)
                row = dict(slots=B, context=C, dtype=dt, seconds=t, tokens_per_s=B / t,
                           **fractions(cost, t, limits, kv_dt))
                if args.parts:
                    parts = decode_parts(eng, models[dt], decode_rows(eng, B, C), t, args.repeats)
                    print(f"      {parts.line()}", flush=True)
                    row["parts"] = parts.as_dict()
                report["decode"].append(row)
    for eng in engines.values():
        del eng.state


# -- end to end with baselines ------------------------------------------------------------------

def bench_prompts(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of prompt_len token ids: <bos> then ordinary ids (no special tokens)."""
    rng = np.random.default_rng(seed)
    return [[2] + rng.integers(1000, min(vocab, 200000), prompt_len - 1).tolist() for _ in range(n)]


def ours_end_to_end(loop, prompts: list[list[int]], new_tokens: int) -> dict:
    """N concurrent greedy requests through the engine loop: decode and end-to-end tokens/s."""
    import asyncio

    from benchmarks.common import timed_request

    async def run():
        return await asyncio.gather(*(
            timed_request(loop, f"e2e-{time.monotonic_ns()}-{i}", p, new_tokens)
            for i, p in enumerate(prompts)))

    t0 = time.perf_counter()
    res = asyncio.run(run())
    end = max(times[-1] for _, times, _ in res)
    first = min(times[0] for _, times, _ in res)
    n = sum(len(times) for _, times, _ in res)
    return dict(decode_tokens_per_s=(n - len(prompts)) / (end - first),
                e2e_tokens_per_s=n / (end - t0), ttft_s=statistics.median(r[0] for r in res))


def run_baselines(args, report: dict) -> None:
    from benchmarks import baselines

    model, _ = load_named_model(args.model, args.dtype[0])
    loop = _start_loop(model, args.dtype[0], max(args.streams), args.prompt_len + args.new_tokens)
    gguf = baselines.model_gguf_path(args.model)
    runners = {name: baselines.make_runner(name, gguf, max(args.streams),
                                           args.prompt_len + args.new_tokens, args.threads)
               for name in args.baselines}
    print(f"\nend to end: {args.prompt_len}-token prompts, {args.new_tokens} new tokens each, greedy; "
          f"medians of {args.rounds} rounds, ours ({args.dtype[0]}) and theirs alternating")
    for n in args.streams:
        prompts = bench_prompts(n, args.prompt_len, model.cfg.vocab_size)
        ours_end_to_end(loop, prompts, 4)  # compiles this shape's buckets
        results = {"xlaserve": []} | {name: [] for name in runners}
        for _ in range(args.rounds):
            results["xlaserve"].append(ours_end_to_end(loop, prompts, args.new_tokens))
            for name, runner in runners.items():
                results[name].append(runner(prompts, args.new_tokens))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
        for name, m in med.items():
            line = (f"  streams {n:3} {name:13}: decode {m['decode_tokens_per_s']:7.1f} tokens/s, "
                    f"end to end {m['e2e_tokens_per_s']:7.1f} tokens/s")
            if name != "xlaserve":
                ours = med["xlaserve"]
                line += (f" | ours/theirs: decode {ours['decode_tokens_per_s'] / m['decode_tokens_per_s']:.2f}x, "
                         f"end to end {ours['e2e_tokens_per_s'] / m['e2e_tokens_per_s']:.2f}x")
            print(line, flush=True)
        report["end_to_end"].append(dict(streams=n, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                         medians=med))
    loop.stop()


def _start_loop(model, dtype: str, slots: int, max_len: int):
    from serving.runtime.engine_loop import EngineLoop

    loop = EngineLoop(make_engine(model, dtype, slots, max_len))
    loop.start(warmup=False)
    return loop


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m", help="configs/models.yaml name or a .gguf path")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights in a named shape instead of --model")
    ap.add_argument("--layers", type=int, help="override the layer count of --shape")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], help="weight/KV dtypes, measured interleaved")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8"],
                    help="weight quantizations, measured interleaved with the dtypes (int8: "
                         "model.quantization, the backend policy's dot)")
    ap.add_argument("--cpu-kernels", nargs="+", default=["auto"],
                    choices=["auto", "on", "off", "auto-sliced", "auto-strips", "auto-xla-rows"],
                    help="the server's --cpu-kernels settings, measured interleaved (int8 dots; "
                         "bf16 dots with on, or auto without batch invariance); auto-sliced: auto with "
                         "the layers' int8 matrices sliced out of their stacks before the kernel (the "
                         "baseline before the kernel read them in place); auto-strips: auto with the "
                         "int8 kernel's [K, N] matrices walked in 64-column strips (the baseline of its "
                         "row sweep, 2026-12-07); auto-xla-rows: auto with XLA's int8 dot above the "
                         "kernel's 4 VNNI rows instead of its AMX-INT8 tiles (the baseline before the AMX path)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048], help="tokens in cache per slot")
    ap.add_argument("--prefill", type=int, nargs="+", default=[16, 64, 256, 512], help="prefill buckets")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="skip the prefill/decode tables")
    ap.add_argument("--whole-table-attention", action="store_true",
                    help="decode attention of sliding layers reads the whole page table (the baseline "
                         "before the window gather)")
    ap.add_argument("--no-parts", dest="parts", action="store_false",
                    help="skip timing each decode row's attention and output head alone (benchmarks.step_parts)")
    ap.add_argument("--baselines", nargs="*", default=[], choices=["llama.cpp", "transformers"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="end-to-end stream counts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="baseline threads (default: all cores)")
    ap.add_argument("--bandwidth-gbs", type=float, help="override the bandwidth limit")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {platform.node()} {platform.machine()}, "
          f"python {platform.python_version()}, jax {jax.__version__} | load average "
          + (" ".join(f"{x:.2f}" for x in _loadavg()) or "n/a"))
    limits = measure_limits(tuple(args.dtype), bandwidth_override=args.bandwidth_gbs)
    print(limits.describe())
    report = dict(limits=dataclasses.asdict(limits), prefill=[], decode=[], end_to_end=[],
                  jax=jax.__version__, backend=jax.default_backend())
    if args.engine:
        combos = [(dt, q) for dt in args.dtype for q in args.quantization]
        if args.shape:
            models = {variant(dt, q): random_model(args.shape, dt, args.layers, quantization=q)
                      for dt, q in combos}
        else:
            models = {variant(dt, q): load_named_model(args.model, dt, q)[0] for dt, q in combos}
        m = next(iter(models.values()))
        print(f"model {m.cfg.name}: {m.cfg.num_layers} layers, hidden {m.cfg.hidden_size}, "
              f"vocab {m.cfg.vocab_size}; backend {jax.default_backend()}")
        run_engine_rows(models, args, limits, report)
        del models
    if args.baselines:
        run_baselines(args, report)
    print("load average at the end: " + " ".join(f"{x:.2f}" for x in _loadavg()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _loadavg() -> tuple:
    try:
        import os

        return os.getloadavg()
    except OSError:
        return ()


if __name__ == "__main__":
    main()
