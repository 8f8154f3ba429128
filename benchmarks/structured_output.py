"""Decode-step time with one structured-output (constrained) row against none, same run.

    python -m benchmarks.structured_output [--model gemma-3-270m] [--streams 8] [--max-tokens 64]

Runs ``--streams`` greedy streams through the engine loop, alternately all
unconstrained ("none") and with one of them constrained by a regex ("one"):
the loop then reads back every step before planning the next (no pipelining),
fills that row's bitmask with llguidance, and the sampler applies the mask.
Reports the mean time per decode step (the unconstrained streams' mean
inter-token time) of each and their ratio, over ``--repeats`` interleaved runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from benchmarks.common import build_engine
from serving.contract.engine_client import EngineRequest, SamplingParams, StructuredOutput
from serving.runtime.engine_loop import EngineLoop

REGEX = StructuredOutput("regex", "[a-z ]{1000}")  # never complete within max_tokens: every step constrained


async def _stream(loop, rid, prompt, max_tokens, so):
    times = []
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                    structured_output=so))
    async for ev in loop.submit(req):
        times += [time.perf_counter()] * len(ev.token_ids)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    engine, tok = build_engine(args.model, args.dtype, max_slots=args.streams, num_pages=512,
                               max_model_len=1024, min_decode_batch=args.streams)
    loop = EngineLoop(engine, tokenizer=tok)
    loop.start(warmup=True)
    prompt = tok.encode("Once upon a time in a small village", add_bos=True)

    async def run(tag: str, constrained: bool) -> float:
        outs = await asyncio.gather(*(
            _stream(loop, f"{tag}-{i}", prompt, args.max_tokens, REGEX if constrained and i == 0 else None)
            for i in range(args.streams)))
        # The unconstrained streams' steps, after the first token (all streams decode together).
        gaps = [b - a for times in outs[1:] for a, b in zip(times[1:], times[2:])]
        return statistics.mean(gaps)

    try:
        asyncio.run(run("warm", True))
        res = {"none": [], "one": []}
        for r in range(args.repeats):
            for kind in ("none", "one"):
                res[kind].append(asyncio.run(run(f"{kind}{r}", kind == "one")))
        for kind, xs in res.items():
            print(f"{kind:>4} constrained row(s): decode step {statistics.mean(xs) * 1e3:.1f} ms "
                  f"(runs {', '.join(f'{x * 1e3:.1f}' for x in xs)}; {args.streams} streams, "
                  f"{args.model} {args.dtype})")
        print(f"ratio one/none: {statistics.mean(res['one']) / statistics.mean(res['none']):.2f}x")
    finally:
        loop.stop()


if __name__ == "__main__":
    main()
