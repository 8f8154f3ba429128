"""The llama-server anchor of ``benchmarks.vs_llamacpp``: the same token ids through the same HTTP load.

``run_anchor`` starts llama.cpp's own server (``benchmarks.llama_server``:
``-np`` = the largest stream count, continuous batching, ``--threads``
threads, the GGUF xlaserve serves), sends it the warm-up and each run's
requests exactly as ``vs_llamacpp`` sends them to our server in this mode
(``POST /v1/completions``, the prompt as the token ids our server's
``/tokenize`` gave, BOS first; ``max_tokens``, ``temperature`` 0,
``ignore_eos``, ``stream`` with ``stream_options.include_usage``; a closed
loop of N streams per run, ``benchmarks.load``'s client and statistics), and
stops it. llama-server closes the connection after each streamed response, so
in this mode both servers get one new connection per request
(``request_limits(..., keepalive=False)``).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Sequence

from benchmarks.load import LoadConfig, RequestResult, _payload, _run_one, send_request, summarize
from benchmarks.vs_tables import ANCHOR, Row, decode_throughput, median_run


def request_limits(max_conn: int, keepalive: bool):
    """``httpx.Limits`` for ``max_conn`` concurrent requests (plus 2); ``keepalive=False`` keeps
    no idle connection, so each request opens (and the response's end closes) its own."""
    import httpx

    return httpx.Limits(max_connections=max_conn + 2, max_keepalive_connections=max_conn + 2 if keepalive else 0)


def load_config(url: str, model: str, output_len: int, timeout_s: float) -> LoadConfig:
    """The load of this mode, for either server: greedy (``temperature`` 0), ``ignore_eos``,
    ``output_len`` tokens, ``timeout_s`` seconds per request, no progress bar."""
    return LoadConfig(base_url=f"{url}/v1", model=model, output_len=output_len, ignore_eos=True,
                      temperature=0.0, timeout_s=timeout_s, progress=False)


async def drive(url: str, warmup: list[int], runs: Sequence[tuple[int, Sequence[list[int]]]], output_len: int,
                timeout_s: float) -> tuple[str, list[list[RequestResult]]]:
    """Against one healthy server: (its model id from ``/v1/models``, the results of each
    ``(streams, prompts as token ids)`` run), after one 16-token warm-up request (not counted).

    Raises:
      RuntimeError: the warm-up request failed.
      httpx.HTTPError: ``/v1/models`` failed.
    """
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                                 limits=request_limits(max(n for n, _ in runs), keepalive=False)) as client:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
        cfg = load_config(url, model, output_len, timeout_s)
        w = await send_request(client, f"{url}/v1/completions", _payload(cfg, list(warmup), 16))
        if not w.ok:
            raise RuntimeError(f"warm-up request to {url} failed: {w.error}")
        results = [await _run_one(cfg, client, f"{url}/v1/completions", "concurrency", n,
                                  [(list(p), output_len) for p in prompts]) for n, prompts in runs]
    return model, results


def median_rows(name: str, plan: Sequence[int], streams: Sequence[int],
                results: Sequence[Sequence[RequestResult]]) -> list[Row]:
    """One ``Row`` per stream count: the run (of ``plan``'s runs with that count) with the median
    output tokens/s, its TTFT and ITL distributions (seconds)."""

    summaries = [summarize(r) for r in results]
    rows = []
    for n in streams:
        k = median_run(plan, [s["output_throughput"] for s in summaries], n)
        s = summaries[k]
        rows.append(Row(n, name, s["completed"], s["requests"], s["output_throughput"], decode_throughput(results[k]),
                        s["ttft"]["p50"], s["itl"]["p50"], ttft=s["ttft"], itl=s["itl"]))
    return rows


def run_anchor(gguf: Path, warmup: list[int], runs: Sequence[tuple[int, Sequence[list[int]]]], output_len: int,
               threads: int, timeout_s: float, binary: Path | None = None) -> tuple[str, list[list[RequestResult]]]:
    """llama-server on each ``(streams, prompts as token ids)`` run: (a line describing it, the
    results per run). Builds the binary first when ``binary`` is None and none is cached
    (``llama_server.ensure_built``: minutes, printed). Prints one line per run.

    Raises:
      RuntimeError: the build failed, llama-server did not start (its log's tail in the
        message), or the warm-up request failed.
    """
    from benchmarks import llama_server as ls

    binary = Path(binary) if binary else ls.ensure_built()
    slots = max(n for n, _ in runs)
    ctx = ls.context_size(slots, max(len(p) for _, prompts in runs for p in [warmup, *prompts]), output_len)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        with ls.LlamaServer(binary, gguf, Path(tmp), slots, threads, ctx, timeout_s) as server:
            print(f"   {' '.join(server.command[1:])}\n   ready after {time.perf_counter() - t0:.0f} s"
                  + (" (AMX denied)" if server.amx_denied else ""), flush=True)
            try:
                _, results = asyncio.run(drive(server.url, warmup, runs, output_len, timeout_s))
            except Exception:
                print(f"   the end of llama-server's log:\n{ls.log_tail(server.log_path)}", flush=True)
                raise
    for (n, prompts), res in zip(runs, results):
        s = summarize(res)
        bad = sum(r.ok and r.prompt_tokens != len(p) for r, p in zip(res, prompts))
        if bad:
            print(f"   warning: {bad} requests' usage.prompt_tokens differ from the ids sent")
        for e in sorted({r.error for r in res if r.error})[:3]:
            print(f"   error: {e}")
        tps = "-" if s["output_throughput"] is None else f"{s['output_throughput']:.1f}"
        print(f"   streams {n:3}: {s['completed']}/{s['requests']} ok, {tps} out tok/s", flush=True)
    return f"{ANCHOR} (llama.cpp of llama-cpp-python {ls.SDIST_VERSION}'s sdist), {threads} threads, " \
           f"-np {slots}, -c {ctx}" + (", AMX denied" if server.amx_denied else ""), results
