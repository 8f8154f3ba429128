"""Several prompts per prefill step: the XLA prefill attention's cost when it packs S rows,
the engine's prefill step, and TTFT through HTTP, each against one prompt per step.

    python -m benchmarks.prefill_packing attention   # attention alone: per-row vs blocked, per block_q
    python -m benchmarks.prefill_packing engine      # the engine's prefill step (Gemma 3 270M shapes)
    python -m benchmarks.prefill_packing http        # two `xlaserve serve`s, 32 and 8 simultaneous prompts

``attention`` times ``paged_prefill_attention_xla`` alone at Gemma 3 270M's
attention shapes (4 query heads, 1 KV head of 256, pages of 16, a 512-token
page table): the formulation before issue 17 (:func:`per_row_prefill_attention`,
every token scored against every packed row's pages) and the blocked ragged form
at each query block size, so the block-size rule
(``PREFILL_BLOCK_GATHER_ROWS``) can be read off.

``engine`` times the engine's whole prefill step (``Engine.prefill``, random
weights in Gemma 3 270M's shapes, bfloat16 as the server runs it) for an engine
compiled for S rows: k prompts of 20 tokens packed into one step, one
512-token prompt, and 8 prompts of 64 tokens, with either attention
formulation (the old one is swapped in for the run).

``http`` starts ``xlaserve serve`` twice, with ``--max-prefill-seqs 1`` and with
the configured default, and drives each with ``benchmarks.load``'s client: 32
simultaneous streamed greedy completions of ~20-token prompts, then 8
simultaneous ~512-token prompts (every request its own worker, so all arrive
at once after one warm-up request). It prints TTFT percentiles of both servers
and their ratio.

Each mode prints the 1-minute load average at its start and end; read the
ratios, which are measured in the same command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/prefill_packing.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ----------------------------------------------------------------------------- the old formulation


def per_row_prefill_attention(q, k_pages, v_pages, cu_q_lens, kv_lens, page_table, num_seqs, *, scale,
                              sliding_window=None, soft_cap=None, layer=None, ordered_sums=False):
    """The XLA prefill attention as it was before issue 17 (the baseline of this benchmark):
    one pass per row slot, each scoring all T tokens against that row's pages and keeping
    only its own tokens, so S packed rows cost S x the work of one. Same signature and
    result as ``paged_prefill_attention_xla``."""
    from kernels_pallas.paged_attention_xla import (
        _gather_pages,
        _softmax_weighted_sum,
        _window_mask,
        token_sequence_ids,
    )

    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[-4]
    group = num_heads // kv_heads
    max_seqs = kv_lens.shape[0]
    k = _gather_pages(k_pages, page_table, layer)
    v = _gather_pages(v_pages, page_table, layer)
    seq = token_sequence_ids(cu_q_lens, num_tokens)
    valid_tok = (jnp.arange(num_tokens) < cu_q_lens[num_seqs]) & (seq < num_seqs)
    seq = jnp.minimum(seq, max_seqs - 1)
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = kv_lens[seq] - q_len[seq] + (jnp.arange(num_tokens) - cu_q_lens[seq])
    qg = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    k_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    out = jnp.zeros((kv_heads, num_tokens, group, head_dim), jnp.float32)
    for s in range(max_seqs):
        scores = jnp.einsum("ktgd,kld->ktgl", qg, k[s], preferred_element_type=jnp.float32) * scale
        mask = (_window_mask(q_pos[:, None], k_pos[None, :], sliding_window)
                & (k_pos[None, :] < kv_lens[s]) & ((seq == s) & valid_tok)[:, None])
        probs = _softmax_weighted_sum(scores, mask[None, :, None, :], v, soft_cap, ordered_sums)
        vs = jnp.where(((k_pos < kv_lens[s]) & (s < num_seqs))[None, :, None], v[s], 0)
        out = out + jnp.einsum("ktgl,kld->ktgd", probs.astype(vs.dtype), vs, preferred_element_type=jnp.float32)
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@contextlib.contextmanager
def prefill_formulation(name: str, block_q: int | None = None):
    """Within the block, the attention dispatch uses the named XLA prefill ("per-row" or
    "blocked", optionally with a fixed block_q; "none" passes q through, to time the rest
    of the step). Programs traced inside keep it."""
    import kernels_pallas.attention as dispatch
    from kernels_pallas.paged_attention_xla import paged_prefill_attention_xla

    fn = {"per-row": per_row_prefill_attention,
          "blocked": functools.partial(paged_prefill_attention_xla, block_q=block_q),
          "none": lambda q, *args, **kwargs: q}[name]  # the step's other work alone
    saved = dispatch.paged_prefill_attention_xla
    dispatch.paged_prefill_attention_xla = fn
    try:
        yield
    finally:
        dispatch.paged_prefill_attention_xla = saved


def _median_time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- attention alone


def bench_attention(args) -> None:
    """Attention alone at Gemma 3 270M's shapes, bfloat16 pages as the CPU stores them."""
    from kernels_pallas.kv_storage import to_storage
    from kernels_pallas.paged_attention_xla import paged_prefill_attention_xla, prefill_query_blocks

    heads, kv_heads, d, ps = 4, 1, 256, 16
    rng = np.random.default_rng(0)
    print(f"load average at the start: {_loadavg()}")
    print("| T | S | rows x tokens | keys (page table) | formulation | block_q | blocks | ms | vs per-row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, S, rows, n, width in args.cases:
        num_pages = 1 + S * width
        kp = to_storage(jnp.asarray(rng.standard_normal((kv_heads, num_pages, ps, d)), jnp.bfloat16), jnp.uint16)
        vp = to_storage(jnp.asarray(rng.standard_normal((kv_heads, num_pages, ps, d)), jnp.bfloat16), jnp.uint16)
        q = jnp.asarray(rng.standard_normal((T, heads, d)), jnp.bfloat16)
        cu = np.full(S + 1, rows * n, np.int32)
        cu[:rows + 1] = np.arange(rows + 1) * n
        kv = np.zeros(S, np.int32)
        kv[:rows] = n
        table = np.zeros((S, width), np.int32)
        table[:rows] = 1 + np.arange(rows * width).reshape(rows, width)
        operands = (q, kp, vp, jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(table), jnp.int32(rows))
        opts = dict(scale=d ** -0.5, sliding_window=512, ordered_sums=True)
        per_row = jax.jit(functools.partial(per_row_prefill_attention, **opts))
        base = _median_time(lambda: per_row(*operands), args.repeats)
        print(f"| {T} | {S} | {rows} x {n} | {width * ps} | per-row | - | {S} | {base * 1e3:.1f} | 1.00 |",
              flush=True)
        block_qs = [None] + [bq for bq in args.block_q if bq <= T]
        for bq in block_qs:
            resolved, blocks = prefill_query_blocks(T, S, bq)
            blocked = jax.jit(functools.partial(paged_prefill_attention_xla, block_q=bq, **opts))
            t = _median_time(lambda: blocked(*operands), args.repeats)
            label = f"{resolved} (rule)" if bq is None else str(bq)
            print(f"| {T} | {S} | {rows} x {n} | {width * ps} | blocked | {label} | {blocks} | {t * 1e3:.1f} | "
                  f"{base / t:.2f} |", flush=True)
    print(f"load average at the end: {_loadavg()}")


# ----------------------------------------------------------------------------- the engine's step


def bench_engine(args) -> None:
    """The engine's prefill step, random Gemma 3 270M weights, per (S, formulation, workload)."""
    from benchmarks.engine import random_model
    from serving.config.engine_config import EngineConfig
    from serving.core.sched.step_plan import PrefillRow
    from serving.engine.engine import Engine

    model = random_model("gemma3-270m", args.dtype)
    vocab = model.cfg.vocab_size
    print(f"load average at the start: {_loadavg()}")
    print("| S (compiled) | step | formulation | ms per step | ms per prompt | vs 1 x 20 at S=1 |")
    print("|---|---|---|---|---|---|")
    base_per_prompt = None
    for S in args.seqs:
        workloads = [(min(S, 25), 20), (1, 512)] + ([(8, 64)] if S >= 8 else [])
        for formulation in args.formulations:
            cfg = EngineConfig(max_slots=32, page_size=16, num_pages=1 + 32 * 32, max_model_len=512,
                               prefill_chunk=512, max_prefill_seqs=S, min_decode_batch=1, kv_dtype=args.dtype)
            with prefill_formulation(formulation):
                engine = Engine(model, cfg)
                for k, n in workloads:
                    rows = [PrefillRow(f"p{i}", i, 0, tuple((7 * i + 3 * j + 5) % vocab for j in range(n)),
                                       tuple(range(1 + 32 * i, 1 + 32 * (i + 1))), samples=True)
                            for i in range(k)]
                    t = _median_time(lambda: engine.prefill(rows), args.repeats)
                    per_prompt = t / k
                    if S == 1 and (k, n) == (1, 20) and base_per_prompt is None:
                        base_per_prompt = per_prompt
                    ratio = f"{base_per_prompt / per_prompt:.2f}" if base_per_prompt and n == 20 else "-"
                    print(f"| {S} | {k} x {n} tokens | {formulation} | {t * 1e3:.0f} | {per_prompt * 1e3:.1f} "
                          f"| {ratio} |", flush=True)
            engine = None  # let the next formulation's engine take its memory
    print(f"load average at the end: {_loadavg()}")


# ----------------------------------------------------------------------------- through HTTP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(serve_args: list[str], log_path: Path, timeout_s: float):
    """Runs `python -m serving.cli.main serve ARGS` on a free loopback port until /health is 200;
    yields its /v1 base URL and kills it on exit (as tests/support/server_process.py does)."""
    import httpx

    port = _free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "serving.cli.main", "--log-level", "WARNING", "serve",
                             *serve_args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"server did not become healthy:\n{log.read()[-4000:]}")
            time.sleep(0.5)
        yield f"{url}/v1"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _load_runs(base_url: str, model: str, runs: list[tuple[int, float, int]]) -> list[dict]:
    """benchmarks.load summaries: one run of N simultaneous requests per (N, words, max_tokens)."""
    from benchmarks.load import LoadConfig, run_benchmark

    out = []
    for n, words, max_tokens in runs:
        cfg = LoadConfig(base_url=base_url, model=model, concurrency=[n], num_requests=n, input_len=words,
                         output_len=max_tokens, ignore_eos=True, progress=False, seed=n)
        out.append(asyncio.run(run_benchmark(cfg))["runs"][0]["summary"])
    return out


def bench_http(args) -> None:
    """Two servers, one prompt per step and the default, the same load on each."""
    from serving.config.server_config import load_server_config

    default_seqs = load_server_config().max_prefill_seqs
    runs = [(32, args.short_words, args.max_tokens), (8, args.long_words, args.max_tokens)]
    print(f"load average at the start: {_loadavg()}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seqs in (1, default_seqs):
            common = ["--model", args.model, "--database-url", f"sqlite:///{tmp}/ledger-{seqs}.db",
                      "--max-prefill-seqs", str(seqs), *args.serve_args]
            with serve(common, Path(tmp) / f"serve-{seqs}.log", args.start_timeout) as url:
                results[seqs] = _load_runs(url, args.model, runs)
    print(f"\nload average at the end: {_loadavg()}")
    print("| load | prompt tokens (mean) | max_prefill_seqs | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms "
          "| output tokens/s | TTFT p50 ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (n, _, max_tokens) in enumerate(runs):
        base = results[1][i]["ttft"]["p50"]
        for seqs in (1, default_seqs):
            s = results[seqs][i]
            ttft = s["ttft"]
            mean_prompt = s["prompt_tokens"] / max(1, s["completed"])
            print(f"| {n} simultaneous, {max_tokens} new | {mean_prompt:.0f} | {seqs} | {ttft['p50'] * 1e3:.0f} "
                  f"| {ttft['p90'] * 1e3:.0f} | {ttft['p99'] * 1e3:.0f} | {s['output_throughput']:.1f} "
                  f"| {base / ttft['p50']:.2f} |")


def _cases(text: str) -> tuple[int, int, int, int, int]:
    T, S, rows, n, width = (int(x) for x in text.split(","))
    return T, S, rows, n, width


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("attention", help="attention alone, per-row vs blocked per block_q")
    a.add_argument("--cases", type=_cases, nargs="+",
                   default=[_cases(c) for c in ("512,1,1,512,32", "512,32,25,20,32", "512,32,25,20,4",
                                                "512,16,16,32,4", "512,8,8,64,4", "512,8,1,512,32",
                                                "32,8,1,20,4", "128,32,6,20,4")],
                   help="T,S,rows,tokens per row,page-table width in pages (16 tokens each)")
    a.add_argument("--block-q", type=int, nargs="*", default=[4, 8, 16, 32, 64])
    a.add_argument("--repeats", type=int, default=5)
    e = sub.add_parser("engine", help="the engine's prefill step")
    e.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 16, 32])
    e.add_argument("--formulations", nargs="+", default=["per-row", "blocked"], choices=["per-row", "blocked", "none"])
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--repeats", type=int, default=3)
    h = sub.add_parser("http", help="TTFT through HTTP: --max-prefill-seqs 1 against the default")
    h.add_argument("--model", default="gemma-3-270m")
    h.add_argument("--short-words", type=float, default=16, help="words per short prompt (~20 tokens)")
    h.add_argument("--long-words", type=float, default=400, help="words per long prompt (~512 tokens)")
    h.add_argument("--max-tokens", type=int, default=32)
    h.add_argument("--start-timeout", type=float, default=900)
    h.add_argument("serve_args", nargs="*", help="more `xlaserve serve` arguments (after --)")
    args = ap.parse_args(argv)
    {"attention": bench_attention, "engine": bench_engine, "http": bench_http}[args.mode](args)


if __name__ == "__main__":
    main()
