"""How long one running stream stalls while another client sends a huge request or a long prompt.

    python -m benchmarks.stream_stall [--server-dir DIR] [--rounds 3] [--big-bytes 10000000]

Starts ``xlaserve serve --model tiny-random`` (the test suite's small shapes)
from ``--server-dir`` (default: this tree; give a checkout of another commit
to measure that one), then, per round and per disturbance, streams one
completion and, once its first chunks have arrived, sends from another thread:

* nothing (the baseline);
* a maximal request: a ``--big-bytes`` JSON body (one long prompt), over the
  server's ``max_request_bytes`` (4 MiB by default);
* a ``--prompt-chars`` prompt (random words; 100k characters by default),
  which is tokenized and then refused for the context window (512 tokens);
* a prompt of ``--large-prompt-chars`` characters (the most the server
  accepts by default), the same way.

Reports, per disturbance and round, the status and latency of the disturbing
request, the stream's longest gap between two chunks while that request was
sent and answered, the longest gap of the whole stream, and the median gap.
The gateway's event loop is what the two requests share besides the engine
thread, so a gap far above the median during the request is the time the
event loop was held. (A full garbage collection of the server process, about
0.2-0.3 s on the 2-core VM, stalls every thread and can land anywhere: hence
the whole-stream column.) Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import cli_module
from benchmarks.load import synthetic_prompts

ROOT = Path(__file__).resolve().parents[1]
SERVER_ARGS = ["--model", "tiny-random", "--max-model-len", "512", "--max-slots", "4", "--num-pages", "256"]


def start_server(server_dir: Path, port: int, workdir: Path) -> subprocess.Popen:
    """``xlaserve serve`` (``python -m``) from `server_dir` on 127.0.0.1:`port`, once /health is 200."""
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", cli_module(server_dir), "--log-level", "WARNING", "serve", *SERVER_ARGS,
         "--port", str(port), "--database-url", f"sqlite:///{workdir / 'ledger.db'}"],
        cwd=server_dir, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{(workdir / 'server.log').read_text()[-3000:]}")


def stream_chunk_times(url: str, max_tokens: int, started: threading.Event, out: list[float]) -> None:
    """Streams one completion, appending each chunk's arrival time (perf_counter) to `out`."""
    body = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(time.perf_counter())
                if len(out) == 20:
                    started.set()
    started.set()


def disturb(client: httpx.Client, body: bytes | None) -> tuple[str, float, float]:
    """Sends `body` to /v1/completions; returns (status, start and end perf_counter times)."""
    t0 = time.perf_counter()
    if body is None:
        return "-", t0, t0
    try:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        status = f"{r.status_code} {r.json()['error'].get('code') or ''}".strip()
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, t0, time.perf_counter()


def one_run(url: str, body: bytes | None, max_tokens: int) -> dict:
    times: list[float] = []
    started = threading.Event()
    with httpx.Client(base_url=url, timeout=300) as client:  # made before the clock starts
        t = threading.Thread(target=stream_chunk_times, args=(url, max_tokens, started, times))
        t.start()
        started.wait(120)
        status, t0, t1 = disturb(client, body)
        t.join()
    gaps = [(a, b) for a, b in zip(times, times[1:])]
    during = [b - a for a, b in gaps if a < t1 and b > t0]  # overlapping [send, answer]
    return {"status": status, "latency_s": t1 - t0, "max_gap_during_s": max(during, default=None),
            "max_gap_s": max(b - a for a, b in gaps), "median_gap_s": statistics.median(b - a for a, b in gaps),
            "chunks": len(times)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-dir", type=Path, default=ROOT, help="source tree to serve from (default: this one)")
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=480, help="tokens of the measured stream")
    ap.add_argument("--big-bytes", type=int, default=10_000_000, help="size of the maximal request body")
    ap.add_argument("--prompt-chars", type=int, default=100_000)
    ap.add_argument("--large-prompt-chars", type=int, default=1_000_000)
    args = ap.parse_args(argv)

    def prompt_body(chars: int) -> bytes:
        words = synthetic_prompts(1, chars // 4, 0, 1, seed=chars)[0][0]
        text = (words + " ") * (chars // (len(words) + 1) + 1)
        return json.dumps({"model": "tiny-random", "prompt": text[:chars], "max_tokens": 16}).encode()

    big = json.dumps({"model": "tiny-random", "prompt": "x" * (args.big_bytes - 60)}).encode()
    disturbances = [
        ("none (baseline)", None),
        (f"{len(big) / 1e6:.1f} MB body", big),
        (f"{args.prompt_chars // 1000}k-character prompt", prompt_body(args.prompt_chars)),
        (f"{args.large_prompt_chars // 1000}k-character prompt", prompt_body(args.large_prompt_chars)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(args.server_dir.resolve(), args.port, Path(tmp))
        try:
            url = f"http://127.0.0.1:{args.port}"
            one_run(url, None, 32)  # warm-up
            results: dict[str, list[dict]] = {name: [] for name, _ in disturbances}
            for _ in range(args.rounds):
                for name, body in disturbances:
                    results[name].append(one_run(url, body, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(30)
    rev = subprocess.run(["git", "-C", str(args.server_dir), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    print(f"server tree {args.server_dir} ({rev}); {args.rounds} rounds; stream of {args.max_tokens} tokens")
    print("| while another client sends | its answer | answered after | stream's longest chunk gap "
          "while it was sent and answered | stream's longest gap, whole stream | stream's median gap |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        ms = lambda key: " / ".join(f"{r[key] * 1e3:.0f}" for r in runs) + " ms"  # noqa: E731
        sent = runs[0]["status"] != "-"
        median = statistics.median(r["median_gap_s"] for r in runs) * 1e3
        print(f"| {name} | {runs[0]['status']} | {ms('latency_s') if sent else '-'} | "
              f"{ms('max_gap_during_s') if sent else '-'} | {ms('max_gap_s')} | {median:.1f} ms |")

if __name__ == "__main__":
    main()
