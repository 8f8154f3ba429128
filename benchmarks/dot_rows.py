"""Decode step time with each row padding of the batch-invariant matmuls, interleaved in one run.

    python -m benchmarks.dot_rows                                   # Gemma 3 270M shapes, bf16
    python -m benchmarks.dot_rows --rows 1x0 4x16 8x16 --slots 1 2 4 --context 512

Each ``MINxTILE`` builds an engine whose backend policy pads low-precision
matmuls with ``kernels_pallas.dot_rows.DotRows(MIN, TILE)`` in batch-invariant
mode (``1x0``: no padding beyond the CPU policy's one-row-as-two, i.e. the
policy before issue 17). Random weights in a ``benchmarks.engine`` shape, so no
GGUF is needed. Every (slots, context) cell is timed for every padding in turn,
``--rounds`` times, and the median seconds per step is printed with the ratio
to the first padding (> 1: slower than it). Read ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

from benchmarks.engine import SHAPES, make_engine, random_model, time_decode
from kernels_pallas.dot_rows import DotRows
from serving.engine.backend_policy import BackendPolicy
from serving.engine.engine import Engine


def _parse_rows(text: str) -> DotRows:
    lo, tile = text.lower().split("x")
    return DotRows(int(lo), int(tile))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gemma3-270m", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", nargs="+", default=["1x0", "4x16", "8x16"], help="MINxTILE paddings")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    print(f"load average at start: {os.getloadavg()}", flush=True)
    model = random_model(args.shape, args.dtype)
    base = BackendPolicy.for_platform("cpu")
    cfg = make_engine(model, args.dtype, max(args.slots), args.context).cfg
    engines = {text: Engine(model, cfg, policy=dataclasses.replace(base, invariant_dot_rows=_parse_rows(text)))
               for text in args.rows}
    times = {(text, s): [] for text in args.rows for s in args.slots}
    for _ in range(args.rounds):
        for s in args.slots:
            for text in args.rows:
                times[(text, s)].append(time_decode(engines[text], s, args.context, args.steps, args.repeats))
    first = args.rows[0]
    print(f"\n{args.shape} {args.dtype}, context {args.context}: median ms per decode step over "
          f"{args.rounds} interleaved rounds; ratio to {first}")
    print("| slots | " + " | ".join(args.rows) + " | " + " | ".join(f"{t} / {first}" for t in args.rows[1:]) + " |")
    print("|---" * (1 + 2 * len(args.rows) - 1) + "|")
    for s in args.slots:
        med = {t: statistics.median(times[(t, s)]) for t in args.rows}
        cells = [f"{med[t] * 1e3:.1f}" for t in args.rows] + [f"{med[t] / med[first]:.2f}" for t in args.rows[1:]]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
