"""The disk KV tier across a restart: a long system prompt's TTFT from disk vs recomputed.

    python -m benchmarks.kv_disk [--model gemma-3-270m] [--system-tokens 4096]

Starts ``xlaserve serve`` (a real server process) with a host tier and a disk tier
(``--host-kv-cache-gib``, ``--kv-disk-dir``, ``--kv-disk-max-bytes``), sends the system prompt
plus a question, and stops the server with SIGTERM (it saves its cached pages to disk as it
stops). A second server process over the same directory then gets

  1. the same prompt: its prefix is read back from disk (the trace's
     ``cached_tokens_by_tier``, ``/metrics``' disk counters say so);
  2. the same prompt under another tenant's ``cache_salt``: no hit (the salt is in every
     page's key), so it is recomputed: the baseline, in the same server process.

It reports both TTFTs and their ratio, the cached tokens by tier, and the disk tier's
counters. No measured TTFT counts a compile: the servers start with ``--skip-warmup`` (a full
warmup of every bucket of a 4k context takes many minutes on a small CPU) and warm exactly
the paths measured with other prompts of the same length first: the first server computes a
warm-up prompt W too (saved to disk with P), the restarted one reads W back from disk (the
page-copy programs, the one-token chunk over a long page table) and computes another prompt
(the full prefill's programs) before P is sent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.routing import _free_port, _start, _wait_http

SYSTEM_TEXT = " ".join(f"Rule {i}: answer politely, cite the sources you used, and keep every reply short."
                       for i in range(2000))


def _tokenize(url: str, model: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=120)
    r.raise_for_status()
    return r.json()["tokens"]


def _ttft(url: str, model: str, prompt: list[int], salt: str, rid: str, max_tokens: int) -> tuple[float, dict]:
    """(seconds to the first streamed token, the request's trace)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "cache_salt": salt}
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-ID": rid},
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
    for _ in range(50):  # the ledger row is written as the request ends
        t = httpx.get(f"{url}/v1/requests/{rid}", timeout=10)
        if t.status_code == 200:
            return ttft, t.json()
        time.sleep(0.1)
    raise RuntimeError(f"no trace for {rid}: {t.status_code} {t.text[:200]}")


def _disk_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("xlaserve:disk_kv_cache_"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("xlaserve:disk_kv_cache_")] = float(value)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-pages", type=int, default=640, help="the device KV pool (16-token pages)")
    ap.add_argument("--host-kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--kv-disk-max-bytes", type=int, default=2 << 30)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    out: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        disk = Path(d) / "kv"
        serve = ["serve", "--model", args.model, "--max-model-len", str(-(-(args.system_tokens + 512) // 512) * 512),
                 "--num-pages", str(args.num_pages), "--host-kv-cache-gib", str(args.host_kv_cache_gib),
                 "--kv-disk-dir", str(disk), "--kv-disk-max-bytes", str(args.kv_disk_max_bytes),
                 "--skip-warmup",
                 "--database-url", f"sqlite:///{Path(d) / 'ledger.db'}"]

        def server(tag: str):
            port, log = _free_port(), Path(d) / f"server-{tag}.log"
            proc = _start([*serve, "--port", str(port)], log)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, proc, log)
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            return proc, url, model

        proc, url, model = server("first")
        try:
            system = _tokenize(url, model, SYSTEM_TEXT)[:args.system_tokens]
            question = _tokenize(url, model, " Question: what is rule 7?")[1:]
            prompt = system + question
            warm = [t + 1 for t in prompt]  # same length, other pages
            other = [t + 2 for t in prompt]
            _ttft(url, model, warm, "warmup", "warm-first", args.max_tokens)
            first, trace = _ttft(url, model, prompt, "tenant-a", "first", args.max_tokens)
            out["first_server"] = {"ttft_s": first, "cached_tokens_by_tier": trace.get("cached_tokens_by_tier")}
        finally:
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)  # a graceful stop: the cached pages go to disk
            proc.wait(timeout=300)
            out["stop_seconds"] = time.perf_counter() - t0
        files = sorted(disk.iterdir())
        out["files"], out["file_bytes"] = len(files), sum(f.stat().st_size for f in files)

        proc, url, model = server("restarted")
        try:
            # (computing first, and again after W: a program's first call, on the state the server
            # started with, compiles apart from its later calls on a step's output state)
            _ttft(url, model, other, "warmup", "warm-restarted-compute", args.max_tokens)
            _, warm_trace = _ttft(url, model, warm, "warmup", "warm-restarted-disk", args.max_tokens)
            out["warmup_cached_tokens_by_tier"] = warm_trace.get("cached_tokens_by_tier")
            _ttft(url, model, other, "warmup-2", "warm-restarted-compute-2", args.max_tokens)  # (again, after a step)
            hit, hit_trace = _ttft(url, model, prompt, "tenant-a", "after-restart", args.max_tokens)
            miss, miss_trace = _ttft(url, model, prompt, "tenant-b", "other-tenant", args.max_tokens)
            metrics = _disk_metrics(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
    out.update(
        prompt_tokens=len(prompt), ttft_restart_disk_s=hit, ttft_recompute_s=miss, speedup=miss / hit,
        restart_cached_tokens_by_tier=hit_trace.get("cached_tokens_by_tier"),
        other_tenant_cached_tokens_by_tier=miss_trace.get("cached_tokens_by_tier"), disk_metrics=metrics)
    reads = metrics.get("read_seconds_count", 0)
    print(f"model {args.model}, {len(prompt)}-token prompt ({args.system_tokens}-token system prompt), "
          f"{args.max_tokens} tokens out, {os.cpu_count()} CPUs")
    print(f"first server: TTFT {first:.2f} s (computed); stopped in {out['stop_seconds']:.1f} s, "
          f"{out['files']} page files ({out['file_bytes'] / 2**20:.1f} MiB) on disk")
    print(f"restarted server, same prompt:  TTFT {hit:.2f} s, cached tokens by tier "
          f"{out['restart_cached_tokens_by_tier']}")
    print(f"restarted server, other tenant: TTFT {miss:.2f} s (recomputed), cached tokens by tier "
          f"{out['other_tenant_cached_tokens_by_tier']}")
    print(f"TTFT recompute / disk hit after restart: {miss / hit:.1f}x")
    print(f"disk tier: {metrics.get('hits_total', 0):.0f} pages read, {metrics.get('read_bytes_total', 0) / 2**20:.1f} "
          f"MiB, mean read {metrics.get('read_seconds_sum', 0) / max(reads, 1) * 1e3:.2f} ms/page; "
          f"{metrics.get('ignored_files_total', 0):.0f} files ignored")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
