"""Where a test run's compile time went, from the logs of tests/support/compile_log.

    python -m tests.support.compile_report DIR [--top 40]

Prints the totals (backend compile, lowering, tracing, in seconds of wall time: under two
workers they include waiting for a core) and the tests that spent the most on them, with their
compile count and persistent-cache hits and misses (a test whose programs are all hits
shares its shapes with an earlier one; ``hits=0 miss=0`` means the process had no cache).
Then the programs (jitted functions, by module name) that took the most compile time, with
how many distinct programs (cache keys) of that name compiled and how many seconds went to
compiling a key that another process had also compiled (two processes racing for a shape, or
a process with no cache).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

COMPILE = "/jax/core/compile/backend_compile_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
HIT = "/jax/compilation_cache/cache_hits"
MISS = "/jax/compilation_cache/cache_misses"


def read(folder: Path) -> tuple[dict[str, collections.Counter], dict[str, collections.Counter]]:
    """Per test (or ``- <argv>`` outside a test): seconds and counts by event."""
    seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) != 5:
                continue  # a line cut by a killed process
            test, event, value, _, argv = parts
            key = test.rsplit(" (", 1)[0] if test != "-" else f"- {argv[:100]}"
            seconds[key][event] += float(value)
            counts[key][event] += 1
    return seconds, counts


def programs(folder: Path) -> dict[str, list[tuple[str, float]]]:
    """Per module name: (cache key, backend-compile seconds) of every compile that followed a
    cache miss (a process's miss and its compile are consecutive lines of its log)."""
    out: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    for path in folder.glob("*.tsv"):
        pending = None
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) != 5:
                continue
            _, event, value, detail, _ = parts
            if event == "/xlaserve/cache_miss":
                pending = detail.rsplit(" ", 1)
            elif event == COMPILE and pending is not None and len(pending) == 2:
                out[pending[0]].append((pending[1], float(value)))
                pending = None
    return out


def print_programs(by_name: dict[str, list[tuple[str, float]]], top: int) -> None:
    rows = []
    for name, compiles in by_name.items():
        keys = collections.Counter(k for k, _ in compiles)
        seen: set[str] = set()
        again = 0.0
        for k, sec in compiles:  # every compile of a key after its first
            again += sec if k in seen else 0.0
            seen.add(k)
        rows.append((sum(sec for _, sec in compiles), len(compiles), len(keys), again, name))
    print(f"\nprograms: {sum(r[1] for r in rows)} compiles after a cache miss, "
          f"{sum(r[3] for r in rows):.0f} s of them a key compiled before by another process")
    for total, n, distinct, again, name in sorted(rows, reverse=True)[:top]:
        print(f"{total:7.1f} s  n={n:4d} keys={distinct:4d} again={again:6.1f} s  {name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    seconds, counts = read(args.folder)
    total = collections.Counter()
    for s in seconds.values():
        total.update(s)
    print(f"compile {total[COMPILE]:.0f} s, lowering {total[LOWER]:.0f} s, tracing {total[TRACE]:.0f} s; "
          f"{sum(c[COMPILE] for c in counts.values())} compiles, {sum(c[HIT] for c in counts.values())} cache hits")
    for key in sorted(seconds, key=lambda k: -seconds[k][COMPILE])[:args.top]:
        s, c = seconds[key], counts[key]
        print(f"{s[COMPILE]:7.1f} s  lower {s[LOWER]:5.1f}  trace {s[TRACE]:5.1f}  n={c[COMPILE]:4d} "
              f"hits={c[HIT]:4d} miss={c[MISS]:4d}  {key}")
    print_programs(programs(args.folder), args.top)


if __name__ == "__main__":
    main()
