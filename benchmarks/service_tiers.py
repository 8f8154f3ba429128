"""Service tiers under load: priority TTFT against idle, flex shed and unbilled, a batch not starved.

    python -m benchmarks.service_tiers [--model gemma-3-270m] [--max-slots 4] [--extra-load 8]
        [--requests 10] [--max-tokens 8] [--load-max-tokens 64] [--flex-requests 10]
        [--lines 4] [--line-max-tokens 16] [--starvation-seconds 10] [--max-model-len 1024]
        [--skip-warmup] [--json out.json]

One ``xlaserve serve`` process (a fresh SQLite ledger, ``--flex-max-waiting 0``,
``--flex-starvation-seconds`` as given). After a warm-up:

1. ``idle``: ``requests`` streamed chat completions at ``service_tier: priority``,
   one after another; TTFT (first content delta) of each;
2. ``load``: ``max_slots + extra_load`` clients each send ``default`` chat
   completions of ``load-max-tokens`` tokens (ignoring EOS) in a loop, so every
   slot holds default work and ``extra_load`` more wait; measured once the engine
   reports every slot running:
   * ``priority``: the same ``requests`` priority requests (TTFT p50 against idle:
     the must-show bound is 2x);
   * ``default``: as many default requests, for comparison (they queue);
   * ``flex``: ``flex-requests`` flex requests: each should get 429
     ``resource_unavailable`` with ``Retry-After``; the ledger must hold a ``shed``
     row with no tokens and no cost for each;
   * ``batch``: a ``lines``-line Batch API batch (flex-class work) created under the
     same steady load; it must finish within the stated bound
     ``starvation_seconds + line_bound_factor * ceil(lines / max_slots) * e2e``, where
     ``e2e`` is the p90 end-to-end time of a default load request measured in this
     phase: a waiting line is promoted to default after ``starvation_seconds``
     (the scheduler's starvation guard), then runs ahead of later default work.

On a 2-core CPU machine the server and this client share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

import httpx
import sqlalchemy as sa

from benchmarks.common import percentile
from benchmarks.routing import _free_port, _start, _wait_http

QUESTION = "In one sentence, what is special about the number {n}?"
LINE_BOUND_FACTOR = 2.0


async def _ttft(client: httpx.AsyncClient, model: str, n: int, max_tokens: int, tier: str) -> float:
    """Seconds to the first content delta of one streamed chat completion at `tier`."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION.format(n=n)}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "service_tier": tier}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert chunk["service_tier"] == tier, chunk
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


async def _measure(client, model: str, base: int, n: int, max_tokens: int, tier: str) -> list[float]:
    return [await _ttft(client, model, base + i, max_tokens, tier) for i in range(n)]


async def _gauge(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"xlaserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _load_body(model: str, i: int, max_tokens: int) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}]}


async def _flex(client: httpx.AsyncClient, model: str, n: int, max_tokens: int) -> dict:
    statuses, retry_after = [], []
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION.format(n=7000 + i)}],
                "max_tokens": max_tokens, "service_tier": "flex"}
        r = await client.post("/v1/chat/completions", json=body)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "resource_unavailable", r.text
            retry_after.append(r.headers.get("Retry-After"))
    return {"sent": n, "status_429": statuses.count(429), "status_200": statuses.count(200),
            "retry_after_headers": sum(1 for h in retry_after if h)}


async def _batch(client: httpx.AsyncClient, model: str, lines: int, max_tokens: int, timeout_s: float) -> float:
    """Seconds from creating a ``lines``-line batch to its completion."""
    text = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": _load_body(model, 90_000 + i, max_tokens)}) + "\n" for i in range(lines))
    f = (await client.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("lines.jsonl", text.encode())})).json()
    t0 = time.perf_counter()
    batch = (await client.post("/v1/batches", json={"input_file_id": f["id"], "completion_window": "24h",
                                                    "endpoint": "/v1/chat/completions"})).json()
    while True:
        b = (await client.get(f"/v1/batches/{batch['id']}")).json()
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            if b["status"] != "completed" or b["request_counts"]["completed"] != lines:
                raise RuntimeError(f"the batch ended {b['status']}: {b['request_counts']}")
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            await client.post(f"/v1/batches/{batch['id']}/cancel")
            return math.inf
        await asyncio.sleep(0.2)


async def _run(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _measure(client, model, 9000, 2, args.max_tokens, "priority")  # warm-up: compile the shapes used
        idle = await _measure(client, model, 1000, args.requests, args.max_tokens, "priority")

        stop = asyncio.Event()
        e2e: list[float] = []

        async def background(k: int) -> None:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions",
                                      json=_load_body(model, k * 10_000 + i, args.load_max_tokens))
                r.raise_for_status()
                e2e.append(time.perf_counter() - t0)
                i += 1

        workers = [asyncio.create_task(background(k)) for k in range(args.max_slots + args.extra_load)]
        try:
            deadline = time.monotonic() + 300
            while (await _gauge(client, "num_requests_running") < args.max_slots
                   or await _gauge(client, "num_requests_waiting") < 1):
                if time.monotonic() > deadline:
                    raise RuntimeError("the default load did not fill every slot")
                await asyncio.sleep(0.1)
            # Warm-up under load: the shapes a preemption and its recomputation compile.
            await _measure(client, model, 8000, 2, args.max_tokens, "priority")
            prio = await _measure(client, model, 2000, args.requests, args.max_tokens, "priority")
            default = await _measure(client, model, 3000, args.requests, args.max_tokens, "default")
            flex = await _flex(client, model, args.flex_requests, args.max_tokens)
            e2e_p90 = percentile(e2e, 90) if e2e else 60.0
            bound = (args.starvation_seconds
                     + LINE_BOUND_FACTOR * math.ceil(args.lines / args.max_slots) * e2e_p90)
            batch_s = await _batch(client, model, args.lines, args.line_max_tokens, timeout_s=3 * bound + 60)
            e2e_p90 = percentile(e2e, 90)  # again, with the batch phase's requests
            bound = (args.starvation_seconds
                     + LINE_BOUND_FACTOR * math.ceil(args.lines / args.max_slots) * e2e_p90)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
    return {"idle": idle, "priority": prio, "default": default, "flex": flex, "batch_s": batch_s,
            "batch_bound_s": bound, "load_e2e_p90_s": e2e_p90}


def _shed_rows(db_url: str) -> dict:
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        row = conn.execute(sa.text(
            "SELECT COUNT(*), COALESCE(SUM(cost_usd), 0), COALESCE(SUM(prompt_tokens + completion_tokens), 0) "
            "FROM requests WHERE status = 'shed' AND service_tier = 'flex'")).one()
    engine.dispose()
    return {"rows": row[0], "cost_usd": row[1], "tokens": row[2]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--max-slots", type=int, default=4)
    ap.add_argument("--extra-load", type=int, help="default clients beyond the slots, which wait "
                    "(default: twice as many as the slots, so the queue seldom runs dry)")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--load-max-tokens", type=int, default=64)
    ap.add_argument("--flex-requests", type=int, default=10)
    ap.add_argument("--lines", type=int, default=4)
    ap.add_argument("--line-max-tokens", type=int, default=16)
    ap.add_argument("--starvation-seconds", type=float, default=10.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-pages", type=int, help="the KV pool in pages (default: the server's)")
    ap.add_argument("--skip-warmup", action="store_true",
                    help="serve with --skip-warmup: each step shape compiles at its first use, during "
                         "the measured phases (a smoke run, as the tests do; not for numbers)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.extra_load is None:
        args.extra_load = 2 * args.max_slots

    with tempfile.TemporaryDirectory() as d:
        port, log = _free_port(), Path(d) / "server.log"
        db_url = f"sqlite:///{Path(d) / 'ledger.db'}"
        proc = _start(["serve", "--model", args.model, "--max-model-len", str(args.max_model_len),
                       "--max-slots", str(args.max_slots), "--batch-concurrency", str(args.lines),
                       "--flex-max-waiting", "0", "--flex-starvation-seconds", str(args.starvation_seconds),
                       *(["--num-pages", str(args.num_pages)] if args.num_pages else []),
                       *(["--skip-warmup"] if args.skip_warmup else []),
                       "--port", str(port), "--database-url", db_url], log)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, proc, log)
            res = asyncio.run(_run(url, args))
        finally:
            proc.kill()
            proc.wait()
        shed = _shed_rows(db_url)
    idle_p50 = percentile(res["idle"], 50)
    out = {"ttft": {}, "flex": {**res["flex"], "shed_rows": shed},
           "batch": {"lines": args.lines, "seconds": res["batch_s"], "bound_s": res["batch_bound_s"],
                     "within_bound": res["batch_s"] <= res["batch_bound_s"],
                     "load_e2e_p90_s": res["load_e2e_p90_s"]},
           "args": vars(args)}
    for phase, label in (("idle", "priority, idle"), ("priority", "priority, slots full"),
                         ("default", "default, slots full")):
        p50, p90 = percentile(res[phase], 50), percentile(res[phase], 90)
        out["ttft"][phase] = {"p50_s": p50, "p90_s": p90, "ratio_to_idle_p50": p50 / idle_p50, "ttft_s": res[phase]}
        print(f"{label:21s} TTFT p50 {p50 * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms  p50 {p50 / idle_p50:5.2f}x idle")
    f = out["flex"]
    print(f"flex, slots full      {f['status_429']}/{f['sent']} got 429 resource_unavailable "
          f"({f['retry_after_headers']} with Retry-After); ledger: {shed['rows']} shed rows, "
          f"{shed['tokens']} tokens, ${shed['cost_usd']:.6f} billed")
    b = out["batch"]
    print(f"batch under steady load: {args.lines} lines of {args.line_max_tokens} tokens finished in "
          f"{b['seconds']:.1f} s; bound {b['bound_s']:.1f} s = starvation {args.starvation_seconds:g} s + "
          f"{LINE_BOUND_FACTOR:g} x ceil({args.lines}/{args.max_slots}) x default e2e p90 "
          f"{b['load_e2e_p90_s']:.2f} s: {'within' if b['within_bound'] else 'OVER'} the bound "
          f"(model {args.model}, {args.max_slots} slots, {args.max_slots + args.extra_load} default clients)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
