"""Interactive TTFT while a batch runs: the Batch API's ``batch`` priority against idle,
and against the same background work sent as interactive requests, in one run.

    python -m benchmarks.batch_interference [--model gemma-3-270m] [--lines 200]
        [--line-max-tokens 64] [--requests 20] [--max-tokens 16] [--max-slots 8]
        [--batch-concurrency 8] [--max-model-len 1024] [--num-pages N] [--skip-warmup] [--json out.json]

One ``xlaserve serve`` process (a fresh SQLite database). After a warm-up,
three phases each send ``requests`` interactive streamed chat completions one
after another (distinct prompts, so no phase is helped by the prefix cache
more than another) and time each one's first content delta (TTFT):

1. ``idle``: nothing else runs;
2. ``batch``: a ``lines``-line batch (``/v1/chat/completions``,
   ``line-max-tokens`` each, ignoring EOS) created first, measured once the
   engine runs its lines (``batch-concurrency`` at a time, ``batch``
   priority: admitted only with spare capacity, preempted first); the batch
   is cancelled after the phase;
3. ``interactive load``: the same background work as ``batch-concurrency``
   interactive streams, sent in a loop while measuring.

Reported: TTFT p50 / p90 per phase, the ratios against idle, and how many
batch lines finished during phase 2 (the batch made progress). On a 2-core
CPU machine the server and this client share the cores: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile
from benchmarks.routing import _free_port, _start, _wait_http

QUESTION = "In one sentence, what is special about the number {n}?"


async def _ttft(client: httpx.AsyncClient, model: str, content: str, max_tokens: int) -> float:
    """Seconds to the first content delta of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


async def _measure(client, model: str, phase: int, n: int, max_tokens: int) -> list[float]:
    return [await _ttft(client, model, QUESTION.format(n=phase * 1000 + i), max_tokens) for i in range(n)]


async def _running(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("xlaserve:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _line(i: int, model: str, max_tokens: int) -> dict:
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}]}}


async def _run(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _measure(client, model, 9, 2, args.max_tokens)  # warm-up: compile every shape used
        idle = await _measure(client, model, 1, args.requests, args.max_tokens)

        lines = "".join(json.dumps(_line(i, model, args.line_max_tokens)) + "\n" for i in range(args.lines))
        f = (await client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("lines.jsonl", lines.encode())})).json()
        batch = (await client.post("/v1/batches", json={"input_file_id": f["id"], "completion_window": "24h",
                                                        "endpoint": "/v1/chat/completions"})).json()
        deadline = time.monotonic() + 300
        while await _running(client) < min(args.batch_concurrency, args.max_slots):
            status = (await client.get(f"/v1/batches/{batch['id']}")).json()["status"]
            if status not in ("validating", "in_progress") or time.monotonic() > deadline:
                raise RuntimeError(f"the batch's lines did not fill the engine (batch {status}); "
                                   "give it more --lines or --line-max-tokens")
            await asyncio.sleep(0.05)
        done0 = (await client.get(f"/v1/batches/{batch['id']}")).json()["request_counts"]["completed"]
        during_batch = await _measure(client, model, 2, args.requests, args.max_tokens)
        done1 = (await client.get(f"/v1/batches/{batch['id']}")).json()["request_counts"]["completed"]
        await client.post(f"/v1/batches/{batch['id']}/cancel")
        while (await client.get(f"/v1/batches/{batch['id']}")).json()["status"] != "cancelled":
            await asyncio.sleep(0.2)

        stop = asyncio.Event()

        async def background(k: int) -> None:
            i = 0
            while not stop.is_set():
                body = _line(k * 10_000 + i, model, args.line_max_tokens)["body"]
                await client.post("/v1/chat/completions", json=body)
                i += 1

        workers = [asyncio.create_task(background(k)) for k in range(args.batch_concurrency)]
        while await _running(client) < min(args.batch_concurrency, args.max_slots):
            await asyncio.sleep(0.2)
        under_load = await _measure(client, model, 3, args.requests, args.max_tokens)
        stop.set()
        await asyncio.gather(*workers)
    return {"idle": idle, "batch": during_batch, "interactive load": under_load,
            "batch_lines_done_during": done1 - done0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--line-max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--batch-concurrency", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-pages", type=int, help="the KV pool in pages (default: the server's)")
    ap.add_argument("--skip-warmup", action="store_true",
                    help="serve with --skip-warmup: each step shape compiles at its first use, during "
                         "the measured phases (a smoke run, as the tests do; not for numbers)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as d:
        port, log = _free_port(), Path(d) / "server.log"
        proc = _start(["serve", "--model", args.model, "--max-model-len", str(args.max_model_len),
                       "--max-slots", str(args.max_slots), "--batch-concurrency", str(args.batch_concurrency),
                       *(["--num-pages", str(args.num_pages)] if args.num_pages else []),
                       *(["--skip-warmup"] if args.skip_warmup else []),
                       "--port", str(port), "--database-url", f"sqlite:///{Path(d) / 'ledger.db'}"], log)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, proc, log)
            res = asyncio.run(_run(url, args))
        finally:
            proc.kill()
            proc.wait()
    out = {"phases": {}, "batch_lines_done_during": res["batch_lines_done_during"], "args": vars(args)}
    idle_p50 = percentile(res["idle"], 50)
    for phase in ("idle", "batch", "interactive load"):
        p50, p90 = percentile(res[phase], 50), percentile(res[phase], 90)
        out["phases"][phase] = {"ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_s": res[phase]}
        print(f"{phase:17s} TTFT p50 {p50 * 1e3:7.1f} ms  p90 {p90 * 1e3:7.1f} ms  "
              f"p50 {p50 / idle_p50:.2f}x idle  ({len(res[phase])} requests, {args.max_tokens} tokens each)")
    print(f"batch lines finished while phase 'batch' was measured: {res['batch_lines_done_during']} "
          f"({args.lines} lines of {args.line_max_tokens} tokens, {args.batch_concurrency} at a time, "
          f"{args.max_slots} slots, model {args.model})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
