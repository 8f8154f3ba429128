"""ITL of running streams while a long prompt arrives (chunked prefill), against the ITL without it.

    python -m benchmarks.chunked_prefill_itl [--model tiny-random] [--streams 32] [--long-prompt 4096]

Runs the same decode load twice in one process: once alone, once with a long
prompt submitted mid-run. Reports the streams' inter-token latency (mean,
p50, p99, max) for each and the p99 ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from benchmarks.common import build_engine, percentile, timed_request
from serving.runtime.engine_loop import EngineLoop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    args = ap.parse_args()

    engine, _ = build_engine(args.model, max_slots=args.streams + 1, num_pages=1024,
                             max_model_len=args.long_prompt + 512, prefill_chunk=args.prefill_chunk)
    loop = EngineLoop(engine)
    loop.start(warmup=True)
    vocab = engine.model_cfg.vocab_size

    async def load(with_long: bool):
        streams = [asyncio.ensure_future(
            timed_request(loop, f"s{with_long}-{i}", [2] + [(i * 7 + j) % (vocab - 10) + 10 for j in range(16)],
                          args.max_tokens)) for i in range(args.streams)]
        if with_long:
            await asyncio.sleep(0.5)
            long = [2] + [(j * 13) % (vocab - 10) + 10 for j in range(args.long_prompt - 1)]
            await timed_request(loop, f"long-{with_long}", long, 1)
        res = await asyncio.gather(*streams)
        return [b - a for _, times, _ in res for a, b in zip(times, times[1:])]

    try:
        asyncio.run(load(True))  # compiles the chunk shapes
        out = {}
        for with_long in (False, True):
            itl = asyncio.run(load(with_long))
            out[with_long] = percentile(itl, 99)
            print(f"{'with' if with_long else 'without'} a {args.long_prompt}-token prompt: ITL mean "
                  f"{statistics.mean(itl) * 1e3:.1f} ms, p50 {percentile(itl, 50) * 1e3:.1f} ms, "
                  f"p99 {percentile(itl, 99) * 1e3:.1f} ms, max {max(itl) * 1e3:.1f} ms "
                  f"({args.streams} streams, chunk {args.prefill_chunk})")
        print(f"p99 ITL ratio with/without: {out[True] / out[False]:.2f}x")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
