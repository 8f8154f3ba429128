"""Prefix caching: 32 requests sharing a 1k-token system prompt, with and without the cache.

    python -m benchmarks.prefix_cache [--model gemma-3-270m] [--requests 32] [--system-tokens 1024]

Both runs use the same engine (same compiled programs) in one process; the
report gives the cache hit rate and TTFT (mean, p50, p90) of each, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from benchmarks.common import build_engine, percentile, timed_request
from serving.runtime.engine_loop import EngineLoop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    engine, tok = build_engine(args.model)
    text = " ".join(f"Rule {i}: answer politely and cite sources." for i in range(400))
    system = tok.encode(text, add_bos=True)[: args.system_tokens]
    filler = tok.encode(" ".join(f"question {i}" for i in range(4 * args.suffix_tokens)))
    prompts = [system + filler[i: i + args.suffix_tokens] for i in range(args.requests)]

    async def burst(loop):
        return await asyncio.gather(*(timed_request(loop, f"r{i}", p, args.max_tokens)
                                      for i, p in enumerate(prompts)))

    def run(caching: bool, warmup: bool = False):
        loop = EngineLoop(engine, enable_prefix_caching=caching)  # a fresh, empty prefix cache
        loop.start(warmup=warmup)
        try:
            return asyncio.run(burst(loop)), loop.kv
        finally:
            loop.stop()

    run(False, warmup=True)  # compiles every shape this load needs
    run(True)
    results = {}
    for caching in (False, True):
        res, kv = run(caching)
        ttft = [r[0] for r in res]
        results[caching] = statistics.mean(ttft)
        print(f"prefix caching {'on ' if caching else 'off'}: hit rate {kv.hits / max(1, kv.queries):.1%} "
              f"of prompt tokens; TTFT mean {statistics.mean(ttft):.2f} s, p50 {percentile(ttft, 50):.2f} s, "
              f"p90 {percentile(ttft, 90):.2f} s ({args.requests} requests, "
              f"{len(prompts[0])}-token prompts, {args.system_tokens} shared)")
    print(f"TTFT ratio off/on: {results[False] / results[True]:.1f}x")


if __name__ == "__main__":
    main()
