"""A/B of the engine benchmark: a base git ref against this tree, alternated in one command.

    python -m benchmarks.ab_engine --base main --rounds 3 -- --slots 1 8 32 --context 512 --prefill 512

Checks out ``--base`` in a temporary git worktree, then runs ``python -m
benchmarks.engine`` (each side its own code, same interpreter, same
arguments, ``--json``) alternately base, ours, base, ours, ... for
``--rounds`` rounds, so load on the machine hits both alike. Prints, per
prefill bucket and decode (slots, context) cell, the median seconds of each
side over the rounds and the ratio base / ours (> 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cells(report: dict) -> dict[tuple, float]:
    out = {}
    for r in report["prefill"]:
        out[("prefill", r["bucket"], r["dtype"])] = r["seconds"]
    for r in report["decode"]:
        out[("decode", r["slots"], r["context"], r["dtype"])] = r["seconds"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git ref to compare against (e.g. main, a commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- then benchmarks.engine arguments")
    args = ap.parse_args(argv)
    engine_args = [a for a in args.engine_args if a != "--"]
    results: dict[str, list[dict]] = {"base": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="xlaserve-ab-") as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_dir), args.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            for i in range(args.rounds):
                for side, cwd in (("base", base_dir), ("ours", ROOT)):
                    out = Path(tmp) / f"{side}-{i}.json"
                    print(f"--- round {i + 1}/{args.rounds}: {side}", flush=True)
                    subprocess.run([sys.executable, "-m", "benchmarks.engine", *engine_args, "--json", str(out)],
                                   cwd=cwd, check=True)
                    results[side].append(_cells(json.loads(out.read_text())))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT,
                           capture_output=True)
    print(f"\nmedians over {args.rounds} alternated rounds; ratio = base / ours (> 1: ours faster)")
    for cell in results["ours"][0]:
        base = statistics.median(r[cell] for r in results["base"])
        ours = statistics.median(r[cell] for r in results["ours"])
        what = (f"prefill bucket {cell[1]:5} {cell[2]}" if cell[0] == "prefill"
                else f"decode slots {cell[1]:3} context {cell[2]:5} {cell[3]}")
        print(f"  {what:40}: base {base * 1e3:8.2f} ms, ours {ours * 1e3:8.2f} ms, ratio {base / ours:5.2f}")


if __name__ == "__main__":
    main()
