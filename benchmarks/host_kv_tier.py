"""The host KV tier: TTFT of a prompt reloaded from host memory against computing it again.

    python -m benchmarks.host_kv_tier [--model gemma-3-270m] [--prompt-tokens 4096] [--repeats 2]

One engine, one loop with a host KV tier (``--host-kv-cache-gib``), a device pool
that holds exactly one prompt (its pages and the null page): each repeat sends a prompt nobody sent
before (TTFT *recompute*: the prefix cache is cold), then a flush prompt of the same
length (its pages evict the first prompt's from the device pool: they go to the
host tier), then the first prompt again (TTFT *host hit*: its full pages are written
back from host memory and only the last partial page is computed). Greedy; the
replay's output is compared with the first run's (which computed every token). Compilation is done first (a
warm-up repeat that is not reported). Reports each TTFT, their means and the ratio
recompute / host hit, measured in the same command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchmarks.common import build_engine
from serving.contract.engine_client import EngineRequest, SamplingParams
from serving.core.kv.host_kv_cache import GIB
from serving.runtime.engine_loop import EngineLoop


def synthetic_prompt(n: int, offset: int, vocab: int) -> list[int]:
    """``n`` token ids inside the vocabulary (BOS 2 first); ``offset`` makes prompts differ
    from their first page on."""
    return [2] + [(7 * i + 13 * offset) % (vocab - 10) + 5 for i in range(n - 1)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--host-kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    n, ps = args.prompt_tokens, args.page_size
    pages = -(-(n + args.max_tokens) // ps)
    max_len = n + args.max_tokens
    engine, _ = build_engine(args.model, dtype=args.dtype, max_slots=2, num_pages=pages + 1, page_size=ps,
                             max_model_len=-(-max_len // 128) * 128, prefill_chunk=args.prefill_chunk,
                             max_prefill_seqs=1)
    vocab = engine.model_cfg.vocab_size
    loop = EngineLoop(engine, host_kv_cache_bytes=int(args.host_kv_cache_gib * GIB))
    loop.start(warmup=False)

    async def timed(rid: str, prompt: list[int]):
        """(TTFT s, generated ids, last event) of one greedy request."""
        t0 = time.perf_counter()
        ttft, ids, last = None, [], None
        req = EngineRequest(rid, prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                        ignore_eos=True))
        async for ev in loop.submit(req):
            if ttft is None and ev.token_ids:
                ttft = time.perf_counter() - t0
            ids += ev.token_ids
            last = ev
        return ttft, ids, last

    flush = synthetic_prompt(n, 999, vocab)
    rows = []
    try:
        for rep in range(args.repeats + 1):  # repeat 0 compiles every program and is not reported
            prompt = synthetic_prompt(n, rep + 1, vocab)
            cold, cold_ids, _ = asyncio.run(timed(f"cold{rep}", prompt))
            asyncio.run(timed(f"flush{rep}", flush))  # evicts the prompt's pages into the host tier
            hits_before = loop.host_kv.hits
            hot, hot_ids, ev = asyncio.run(timed(f"hot{rep}", prompt))
            row = dict(recompute_ttft_s=cold, host_hit_ttft_s=hot, cached_tokens=ev.cached_tokens,
                       host_cached_tokens=ev.host_cached_tokens, host_hit_pages=loop.host_kv.hits - hits_before,
                       identical_output=hot_ids == cold_ids)
            if rep:
                rows.append(row)
            print(f"{'warm-up' if not rep else f'repeat {rep}'}: TTFT recompute {cold * 1e3:.1f} ms, "
                  f"host hit {hot * 1e3:.1f} ms ({ev.host_cached_tokens} of {n} prompt tokens reloaded, "
                  f"{row['host_hit_pages']} pages; identical output: {row['identical_output']})", flush=True)
        stats = loop.stats()
        num_host_pages = len(loop.host_kv)
    finally:
        loop.stop()
    recompute = statistics.mean(r["recompute_ttft_s"] for r in rows)
    host_hit = statistics.mean(r["host_hit_ttft_s"] for r in rows)
    out = dict(args=vars(args), repeats=rows, recompute_ttft_mean_s=recompute, host_hit_ttft_mean_s=host_hit,
               ratio=recompute / host_hit, identical_output=all(r["identical_output"] for r in rows),
               host_kv_stores=stats.host_kv_stores,
               host_kv_hits=stats.host_kv_hits, host_kv_usage_bytes=stats.host_kv_usage_bytes,
               page_bytes=stats.host_kv_usage_bytes // max(1, num_host_pages))
    print(f"TTFT mean: recompute {recompute * 1e3:.1f} ms, host hit {host_hit * 1e3:.1f} ms; "
          f"ratio recompute / host hit {out['ratio']:.1f}x ({args.model} {args.dtype}, {n}-token prompt, "
          f"{len(rows)} repeats); identical greedy output: {out['identical_output']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
