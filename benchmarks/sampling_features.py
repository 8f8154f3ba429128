"""Decode-step time with the sampling features on against off, interleaved in one run.

    python -m benchmarks.sampling_features --shape gemma3-270m --dtype float32 --slots 8 --context 512

Every decode row of a step gets the same settings; each feature set is timed
in turn (``--rounds`` alternations, median of the medians) on one engine, so
all share the compiled decode program and machine load hits all alike.
Feature sets: ``plain`` (greedy, nothing else: the branches skip), ``sampled``
(temperature 1, top-p 0.9), ``penalties`` (presence, frequency and repetition
penalties, a 300-entry logit_bias), ``logprobs`` (log probabilities with the top
20), ``all`` (the last three together). Prints ms/step and the ratio to
``plain``. Read ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from benchmarks.engine import SHAPES, make_engine, random_model
from serving.contract.engine_client import MAX_LOGIT_BIAS, MAX_LOGPROBS
from serving.core.sched.step_plan import DecodeRow, SamplingSettings

FEATURES = {
    "plain": SamplingSettings(),
    "sampled": SamplingSettings(temperature=1.0, top_p=0.9, seed=1),
    "penalties": SamplingSettings(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                  logit_bias=tuple((7 * i, 0.5) for i in range(MAX_LOGIT_BIAS))),
    "logprobs": SamplingSettings(logprobs=MAX_LOGPROBS),
}
FEATURES["all"] = SamplingSettings(
    temperature=1.0, top_p=0.9, seed=1, presence_penalty=0.5, frequency_penalty=0.5,
    repetition_penalty=1.2, logit_bias=FEATURES["penalties"].logit_bias, logprobs=MAX_LOGPROBS)


def time_steps(engine, rows, steps: int) -> float:
    jax.block_until_ready(engine.decode(rows))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = engine.decode(rows)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-270m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--features", nargs="+", default=list(FEATURES), choices=list(FEATURES))
    args = ap.parse_args(argv)
    engine = make_engine(random_model(args.shape, args.dtype), args.dtype, args.slots, args.context)
    ps = engine.cfg.page_size
    per_seq = -(-args.context // ps)

    def rows(settings):
        return [DecodeRow(f"bench-{s}", s, args.context - 1,
                          tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq)), settings)
                for s in range(args.slots)]

    times = {name: [] for name in args.features}
    for _ in range(args.rounds):
        for name in args.features:
            times[name].append(time_steps(engine, rows(FEATURES[name]), args.steps))
    base = statistics.median(times["plain"]) if "plain" in times else None
    print(f"{args.shape} {args.dtype}, {args.slots} slots, context {args.context}, {jax.default_backend()}")
    for name, ts in times.items():
        t = statistics.median(ts)
        ratio = f"  x{t / base:.2f} of plain" if base else ""
        print(f"  {name:10} {t * 1e3:8.2f} ms/step{ratio}", flush=True)


if __name__ == "__main__":
    main()
