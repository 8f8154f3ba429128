"""Running streams while long prompts arrive: one co-located replica against a prefill and a
decode replica (disaggregated serving), in one run.

    python -m benchmarks.disaggregation [--model gemma-3-270m] [--streams 8] [--long-prompt 4096]
        [--long-prompts 3] [--max-slots 12] [--kv-transport auto] [--modes colocated,disaggregated,disaggregated-pinned]
        [--json out.json]

Each mode gets fresh processes behind ``xlaserve serve --engines``:
``colocated`` one ``xlaserve engine --role both``; ``disaggregated`` one
``--role prefill`` and one ``--role decode``; ``disaggregated-pinned`` the same
pair with the prefill replica on the first half of this process's CPUs and the
decode replica on the rest (``sched_setaffinity``), a stand-in for a device
per pool. In each, ``streams`` streamed completions (short distinct prompts,
greedy, EOS ignored) run until the end; once every stream has its first
token, one long prompt compiles the steps that mix it with the streams (not
measured: the persistent compilation cache would otherwise favour whichever
mode runs second), then ``long-prompts`` distinct ``long-prompt``-token
prompts are sent one after another (``max_tokens`` 8). Reported per mode: the
streams' inter-token latency (ITL: gaps between streamed chunks, counted per
token) p50 / p99 / max while the long prompts run, the long prompts' TTFT,
and the KV bytes moved per long prompt (from each request's trace); then each
mode's ratios against the first.

On a 2-core CPU machine unpinned replicas share both cores, so a prefill
replica computing a 4k-token prompt takes them from the decode replica's
steps (two XLA thread pools oversubscribing two cores); pinned, each replica
has one core: the decode steps no longer wait on prompt compute, at half the
compute each. What neither shows is the isolation with the full speed of a
device per pool, nor a transfer over a real interconnect (loopback here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile
from benchmarks.routing import _free_port, _start, _wait_http

MODES = {"colocated": ("both",), "disaggregated": ("prefill", "decode"),
         "disaggregated-pinned": ("prefill", "decode")}


async def _stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                  gaps: list[tuple[float, float]] | None, stop: asyncio.Event | None,
                  started: list | None = None) -> tuple[float, str]:
    """Streams one completion: (TTFT seconds, response id); appends (time, gap) to gaps, and
    itself to started at its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, rid, last = None, None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
                if started is not None:
                    started.append(rid)
            elif gaps is not None:
                gaps.append((now, now - last))
            last = now
            if stop is not None and stop.is_set():
                break  # closing the stream cancels the request
    return ttft, rid


async def _load(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gaps: list[tuple[float, float]] = []
        stop = asyncio.Event()
        started: list[str] = []
        streams = [asyncio.create_task(_stream(client, model, [2] + [(13 * i + j) % 400 + 10 for j in range(31)],
                                               args.long_prompt, gaps, stop, started))
                   for i in range(args.streams)]
        while len(started) < args.streams:  # every stream runs
            await asyncio.sleep(0.05)
        # One long prompt while the streams run, not measured: it compiles the steps that mix
        # its prompt (or, disaggregated, its partial last page) with the streams' decode rows.
        warm = [2] + [(5 * j + 1) % 400 + 10 for j in range(args.long_prompt - 1)]
        await _stream(client, model, warm, 8, None, None)
        t_start = time.perf_counter()
        long_ttft, moved, pulled = [], [], []
        for k in range(args.long_prompts):
            prompt = [2] + [(7 * j + 97 * (k + 1)) % 400 + 10 for j in range(args.long_prompt - 1)]
            ttft, rid = await _stream(client, model, prompt, 8, None, None)
            long_ttft.append(ttft)
            trace = (await client.get(f"/v1/requests/{rid}")).json()
            moved.append(trace.get("kv_transfer_bytes", 0))
            pulled.append(trace.get("kv_transfer_seconds", 0.0))
        t_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    window = [g for t, g in gaps if t_start <= t <= t_end]
    return {"itl_p50_ms": 1e3 * percentile(window, 50), "itl_p99_ms": 1e3 * percentile(window, 99),
            "itl_max_ms": 1e3 * max(window), "itl_samples": len(window),
            "long_ttft_p50_s": percentile(long_ttft, 50), "long_ttft_max_s": max(long_ttft),
            "long_ttft_s": long_ttft,
            "kv_bytes_per_prompt": sum(moved) / len(moved), "kv_transfer_s": pulled}


def run_mode(mode: str, args, tmp: Path) -> dict:
    engine_args = ["--model", args.model, "--max-model-len", str(args.long_prompt + 256), "--max-slots",
                   str(args.max_slots), "--num-pages", str(args.num_pages), "--kv-transport", args.kv_transport]
    ports = [_free_port() for _ in MODES[mode]]
    cpus = sorted(os.sched_getaffinity(0))
    if mode == "disaggregated-pinned" and len(cpus) < 2:
        raise SystemExit("disaggregated-pinned needs 2 CPUs")
    half = len(cpus) // 2  # pinned: the prefill replica on the first half, the decode replica on the rest
    pins = [set(cpus[:half]), set(cpus[half:])] if mode == "disaggregated-pinned" else [None, None]
    engines = [_start(["engine", *engine_args, "--role", role, "--grpc-port", str(p)],
                      tmp / f"{mode}-{role}.log", cpus=pin)
               for role, p, pin in zip(MODES[mode], ports, pins)]
    port = _free_port()
    gateway = None
    try:
        gateway = _start(["serve", "--engines", ",".join(f"grpc://127.0.0.1:{p}" for p in ports),
                          "--port", str(port), "--database-url", f"sqlite:///{tmp / (mode + '.db')}"],
                         tmp / f"{mode}-gateway.log")
        url = f"http://127.0.0.1:{port}"
        _wait_http(url, gateway, tmp / f"{mode}-gateway.log")
        while True:  # every replica up (the gateway is healthy once one is)
            up = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                  if line.startswith("xlaserve:replica_up{")]
            if len(up) == len(ports) and all(line.endswith(" 1.0") for line in up):
                break
            time.sleep(0.5)
        return {"mode": mode, **asyncio.run(_load(url, args))}
    finally:
        for p in [gateway, *engines]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--max-slots", type=int, default=12)
    ap.add_argument("--num-pages", type=int, default=1024)
    ap.add_argument("--kv-transport", default="auto", choices=("auto", "jax", "grpc"))
    ap.add_argument("--modes", default="colocated,disaggregated,disaggregated-pinned")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for mode in args.modes.split(","):
            results.append(run_mode(mode, args, Path(d)))
            print(json.dumps(results[-1]), flush=True)
    out = {"config": vars(args), "results": results}
    if len(results) >= 2:  # every mode against the first
        base = results[0]
        out["ratios"] = {pd["mode"]: {k: pd[k] / base[k] for k in ("itl_p50_ms", "itl_p99_ms", "long_ttft_p50_s")
                                      if base[k]} for pd in results[1:]}
        print(json.dumps({"ratios": out["ratios"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
