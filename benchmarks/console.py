"""The console's cost to the API: closed-loop TTFT with the overview polled every second, against
without, on one server, in one command.

The server's ledger is filled first with ``--rows-per-minute`` rows a minute over the last
``--minutes`` (default 1,000 a minute for an hour: the issue's load), so each overview poll
reads a full window. Then rounds alternate: N streams each send their next streamed completion
when their last ends, for ``--seconds``, without a console poller, then with one polling
``GET /console/api/overview`` (per minute, by model) every ``--poll-s`` seconds, as an open
overview page does, with an admin key. TTFT is the time to the first content chunk.

    python -m benchmarks.console [--model tiny-random] [--streams 4] [--seconds 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.load import percentile, send_request
from benchmarks.routing import _free_port, _start, _wait_http
from serving.gateway.accounts.api_keys import KeyStore
from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import apply_writes, utc_day


def fill(db_url: str, rows_per_minute: int, minutes: int) -> tuple[str, int]:
    """Creates an admin key and writes ``rows_per_minute * minutes`` completed rows ending now.
    Returns (the key, rows written)."""
    engine = open_database(db_url)
    key, _ = KeyStore(engine).create_key("ops", is_admin=True)
    now, n = time.time(), rows_per_minute * minutes
    step = 60.0 / rows_per_minute
    batch = []
    for i in range(n):
        t = now - 1 - i * step
        batch.append({"op": "open", "row": {
            "request_id": f"fill-{i:08d}", "x_request_id": f"x-{i:08d}", "tenant": f"t{i % 5}",
            "key_id": f"key_{i % 11}", "model": ("m-a", "m-b", "m-c")[i % 3], "priority": "normal",
            "stream": True, "status": "error" if i % 50 == 0 else "ok", "finish_reason": "length",
            "created_at": t, "day": utc_day(t), "first_token_at": t + 0.05, "finished_at": t + 0.5,
            "prompt_tokens": 100 + i % 300, "completion_tokens": 64, "ttft_s": 0.05 + (i % 100) * 1e-3,
            "itl_mean_s": 0.01, "e2e_s": 0.5, "cost_usd": 1e-5, "service_tier": "default"}})
        if len(batch) == 5000:
            with engine.begin() as conn:
                apply_writes(conn, batch)
            batch = []
    if batch:
        with engine.begin() as conn:
            apply_writes(conn, batch)
    engine.dispose()
    return key, n


async def closed_loop(url: str, key: str, model: str, streams: int, seconds: float, max_tokens: int) -> list[float]:
    """TTFTs (s) of the streamed completions that `streams` closed-loop clients send in `seconds`
    (each sends its next when its last ends; none starts after `seconds`)."""
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.perf_counter() + seconds
    ttfts: list[float] = []
    counter = iter(range(1 << 30))

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            i = next(counter)
            body = {"model": model, "prompt": f"Request {i}: the story of a console", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            r = await send_request(client, f"{url}/v1/completions", body)
            if r.error:
                raise RuntimeError(r.error)
            if r.ttft is not None:  # None: no token of it decoded to text (the tiny model's random ids)
                ttfts.append(r.ttft)

    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return ttfts


async def poller(url: str, key: str, every_s: float, stop: asyncio.Event, seconds: list[float]) -> None:
    """GETs the overview every `every_s` seconds until `stop`; appends each poll's latency."""
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await client.get(f"{url}/console/api/overview", params={"step": "minute", "by": "model"})
            r.raise_for_status()
            seconds.append(time.perf_counter() - t0)
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, every_s - seconds[-1]))
            except asyncio.TimeoutError:
                pass


async def run(url: str, key: str, args) -> dict:
    await closed_loop(url, key, args.model, args.streams, min(3.0, args.seconds), args.max_tokens)  # warm up
    out = {"without": [], "with": [], "poll_s": []}
    for _ in range(args.rounds):
        out["without"] += await closed_loop(url, key, args.model, args.streams, args.seconds, args.max_tokens)
        stop = asyncio.Event()
        task = asyncio.create_task(poller(url, key, args.poll_s, stop, out["poll_s"]))
        out["with"] += await closed_loop(url, key, args.model, args.streams, args.seconds, args.max_tokens)
        stop.set()
        await task
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--serve-args", default="--max-model-len 512 --max-slots 4 --num-pages 256",
                    help="more `xlaserve serve` flags (default: the tests' tiny server's)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of closed loop a round, each side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--rows-per-minute", type=int, default=1000)
    ap.add_argument("--minutes", type=int, default=60)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        db_url = f"sqlite:///{Path(d) / 'ledger.db'}"
        t0 = time.perf_counter()
        key, rows = fill(db_url, args.rows_per_minute, args.minutes)
        print(f"ledger: {rows} rows over the last {args.minutes} min ({time.perf_counter() - t0:.1f} s to write)")
        port, log = _free_port(), Path(d) / "server.log"
        proc = _start(["serve", "--model", args.model, *args.serve_args.split(), "--port", str(port),
                       "--database-url", db_url], log)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, proc, log)
            res = asyncio.run(run(url, key, args))
        finally:
            proc.kill()
            proc.wait()
    summary = {}
    for side in ("without", "with"):
        p50, p99 = percentile(res[side], 50), percentile(res[side], 99)
        summary[side] = {"ttft_p50_s": p50, "ttft_p99_s": p99, "requests": len(res[side])}
    polls = res["poll_s"]
    summary["polls"] = {"count": len(polls), "p50_s": percentile(polls, 50), "p99_s": percentile(polls, 99)}
    w, o = summary["with"], summary["without"]
    summary["ratio_p50"], summary["ratio_p99"] = w["ttft_p50_s"] / o["ttft_p50_s"], w["ttft_p99_s"] / o["ttft_p99_s"]
    print(f"{'':26s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'requests':>9s}")
    for side, label in (("without", "without the console"), ("with", f"overview every {args.poll_s:g} s")):
        s = summary[side]
        print(f"{label:26s} {s['ttft_p50_s'] * 1e3:8.1f}ms {s['ttft_p99_s'] * 1e3:8.1f}ms {s['requests']:9d}")
    print(f"with / without: p50 {summary['ratio_p50']:.3f}x, p99 {summary['ratio_p99']:.3f}x; "
          f"{len(polls)} overview polls, p50 {summary['polls']['p50_s'] * 1e3:.0f} ms, "
          f"p99 {summary['polls']['p99_s'] * 1e3:.0f} ms (model {args.model}, {args.streams} streams, "
          f"{args.rounds} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "raw": res, "args": vars(args)}, indent=2))
    return summary


if __name__ == "__main__":
    main()
