"""Engine latency without HTTP: compile time per bucket, TTFT, decode tokens/s at N streams.

    python -m benchmarks.engine_latency [--model gemma-3-270m] [--dtype float32] [--streams 1 8]

Numbers are printed, never asserted (tests assert behaviour, benchmarks/ measures).
TTFT here is submit -> first token event (prefill + one read-back); decode
tokens/s is completion tokens over the time after each stream's first token.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from serving.contract.engine_client import EngineRequest, SamplingParams


async def _one(loop, rid: str, prompt: list[int], max_tokens: int):
    t0 = time.perf_counter()
    first = None
    n = 0
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True))
    async for ev in loop.submit(req):
        if ev.token_ids and first is None:
            first = time.perf_counter()
        n += len(ev.token_ids)
    end = time.perf_counter()
    return first - t0, n, end - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from serving.cli.bootstrap import build_engine
    from serving.config.server_config import load_server_config

    cfg = load_server_config(model=args.model, dtype=args.dtype, max_slots=max(8, max(args.streams)),
                             num_pages=2048)
    t0 = time.perf_counter()
    loop, tok, name = build_engine(cfg, warmup=True)
    print(f"model {name} {args.dtype}: load + warmup {time.perf_counter() - t0:.1f} s")
    for key, secs in sorted(loop.engine.compile_times.items()):
        print(f"  compile {key}: {secs:.2f} s")
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 40, add_bos=True)
    prompt = base[: args.prompt_len]

    async def run(n: int):
        return await asyncio.gather(
            *(_one(loop, f"b{n}-{i}", prompt[:-1] + [prompt[-1] + i], args.max_tokens) for i in range(n)))

    asyncio.run(run(1))  # compiles the page buckets this prompt length needs
    try:
        for n in args.streams:
            res = asyncio.run(run(n))
            ttft = statistics.mean(r[0] for r in res)
            per_stream = statistics.mean((r[1] - 1) / r[2] for r in res)
            total = sum(r[1] - 1 for r in res) / max(r[2] for r in res)
            print(f"streams={n}: TTFT {ttft * 1000:.0f} ms ({len(prompt)}-token prompt), "
                  f"decode {per_stream:.1f} tokens/s per stream, {total:.1f} tokens/s aggregate")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
