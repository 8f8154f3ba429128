"""Routing over replicas: a multi-tenant shared-prefix load through one gateway and 2 replicas,
kv-aware against round-robin (and least-load) in one run.

    python -m benchmarks.routing [--model tiny-random] [--tenants 8] [--requests-per-tenant 64]
                                 [--system-tokens 1024] [--num-pages 320] [--policies kv-aware,round-robin]

Each policy gets fresh processes: two ``xlaserve engine`` replicas (empty prefix
caches) and ``xlaserve serve --engines`` over them. The load: ``tenants``
system prompts (token ids, one per tenant, each request carrying its
tenant's ``cache_salt``), each followed by a 32-token question, sent in a
shuffled order ``concurrency`` at a time, streamed. Reported per policy: the
prefix-cache hit rate (cached / prompt tokens, from the responses' usage) and
TTFT p50 / p90 (first streamed chunk); then the ratios against the last policy.

The replicas' KV pools are sized (``--num-pages``) so that one replica holds
about half the tenants' prompts: round-robin makes each replica cycle through
all of them (evictions), kv-aware splits them. On a 2-core machine the
replicas share the cores, so read the hit rate and the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path, cpus: set[int] | None = None) -> subprocess.Popen:
    """``xlaserve ARGS`` in a child process logging to ``log``, on the CPUs ``cpus`` (all: None)."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen([sys.executable, "-m", "serving.cli.main", "--log-level", "WARNING", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, preexec_fn=pin)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], salt: str,
               max_tokens: int) -> tuple[float, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft if ttft is not None else time.perf_counter() - t0, usage


async def _load(url: str, work: list[tuple[list[int], str]], concurrency: int, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]  # the replicas' own name

        async def run(prompt, salt):
            async with sem:
                return await _one(client, model, prompt, salt, max_tokens)

        return await asyncio.gather(*(run(p, s) for p, s in work))


def run_policy(policy: str, args, work, tmp: Path) -> dict:
    engine_args = ["--model", args.model, "--max-model-len", str(args.max_model_len), "--max-slots",
                   str(args.max_slots), "--num-pages", str(args.num_pages)]
    ports = [_free_port() for _ in range(2)]
    engines = [_start(["engine", *engine_args, "--grpc-port", str(p)], tmp / f"{policy}-engine{i}.log")
               for i, p in enumerate(ports)]
    port = _free_port()
    gateway = None
    try:
        gateway = _start(["serve", "--engines", ",".join(f"grpc://127.0.0.1:{p}" for p in ports),
                          "--router", policy, "--router-prefill-weight", str(args.prefill_weight),
                          "--router-balance-abs", str(args.balance_abs),
                          "--port", str(port), "--database-url",
                          f"sqlite:///{tmp / (policy + '.db')}"], tmp / f"{policy}-gateway.log")
        url = f"http://127.0.0.1:{port}"
        _wait_http(url, gateway, tmp / f"{policy}-gateway.log")
        # Wait for both replicas (the gateway is healthy once one is up).
        while True:
            up = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                  if line.startswith("xlaserve:replica_up{")]
            if len(up) == 2 and all(line.endswith(" 1.0") for line in up):
                break
            time.sleep(0.5)
        t0 = time.perf_counter()
        res = asyncio.run(_load(url, work, args.concurrency, args.max_tokens))
        wall = time.perf_counter() - t0
        decisions = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                     if line.startswith("xlaserve:router_decisions_total")]
    finally:
        for p in [gateway, *engines]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    ttft = [t for t, _ in res]
    prompt = sum(u["prompt_tokens"] for _, u in res)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for _, u in res)
    return {"policy": policy, "hit_rate": cached / prompt, "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "wall_s": wall, "decisions": decisions}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--requests-per-tenant", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=320, help="each replica's KV pool (pages of 16 tokens)")
    ap.add_argument("--policies", default="kv-aware,round-robin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-weight", type=float, default=2.0, help="kv-aware's --router-prefill-weight")
    ap.add_argument("--balance-abs", type=int, default=16, help="kv-aware's --router-balance-abs")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    systems = [[2] + [rng.randrange(100, 500) for _ in range(args.system_tokens - 1)] for _ in range(args.tenants)]
    work = [(systems[t] + [rng.randrange(100, 500) for _ in range(args.question_tokens)], f"tenant-{t}")
            for t in range(args.tenants) for _ in range(args.requests_per_tenant)]
    rng.shuffle(work)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for policy in args.policies.split(","):
            r = run_policy(policy, args, work, Path(d))
            results.append(r)
            print(f"{policy:12s} hit rate {r['hit_rate']:.1%}  TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms  "
                  f"p90 {r['ttft_p90'] * 1e3:.0f} ms  wall {r['wall_s']:.1f} s  ({len(work)} requests, "
                  f"{args.tenants} tenants x {args.system_tokens}-token system prompts, 2 replicas of "
                  f"{args.num_pages} pages)")
            for line in r["decisions"]:
                print("    " + line)
    base = results[-1]
    for r in results[:-1]:
        print(f"{r['policy']} / {base['policy']}: hit rate {r['hit_rate']:.1%} vs {base['hit_rate']:.1%}; "
              f"TTFT p50 {base['ttft_p50'] / r['ttft_p50']:.2f}x lower, p90 {base['ttft_p90'] / r['ttft_p90']:.2f}x")


if __name__ == "__main__":
    main()
