"""What the gateway's metering costs per request: bare gateway vs keys + limits + ledger.

Both apps run in this process over an instant engine (no model), driven through
ASGI (httpx.ASGITransport) with the same requests, interleaved in rounds so
machine noise hits both alike. The metered app authenticates a key with rate
limits, writes its ledger row to a SQLite (WAL) file and waits for it before
the response ends, and updates the Prometheus metrics.

    python -m benchmarks.gateway_overhead [--requests 200] [--rounds 3] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

import httpx

from serving.contract.engine_client import EngineRequest, TokenEvent
from serving.gateway.accounts.api_keys import Limits
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices


class InstantEngine:
    """Generates `max_tokens` copies of token 65 at once (an EngineClient)."""

    max_model_len = 4096

    def is_ready(self) -> bool:
        return True

    async def cancel(self, request_id: str) -> None:
        pass

    async def _events(self, r: EngineRequest) -> AsyncIterator[TokenEvent]:
        now = time.time()
        n = r.sampling.max_tokens
        for i in range(n):
            yield TokenEvent(r.request_id, (65,), "length" if i == n - 1 else None,
                             prompt_tokens=len(r.prompt_ids), completion_tokens=i + 1,
                             scheduled_time=now, first_token_time=now)

    def submit(self, r: EngineRequest) -> AsyncIterator[TokenEvent]:
        return self._events(r)


class ByteTokenizer:
    bos_id, eos_id, vocab_size, stop_token_ids, chat_stop_token_ids = 1, 2, 259, (2,), (2,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([1] if add_bos else []) + [3 + b for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def apply_chat_template(self, messages) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages), add_bos=True)


async def _run(app, n: int, headers: dict, stream: bool) -> list[float]:
    body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 16, "stream": stream}
    lat = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            lat.append(time.perf_counter() - t0)
    return lat


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per app per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args(argv)

    models = {"m": ServedModel("m", InstantEngine(), ByteTokenizer(), 4096)}
    bare = create_app(models)
    with tempfile.TemporaryDirectory() as d:
        services = GatewayServices.open_server(database_url=f"sqlite:///{Path(d) / 'ledger.db'}")
        key, _ = services.authenticator.key_store.create_key(
            "bench", limits=Limits(rpm=10**7, tpm=10**9, max_concurrent=1000))
        metered = create_app(models, services)
        results = {"bare": [], "metered": []}
        for _ in range(args.rounds):
            results["bare"] += asyncio.run(_run(bare, args.requests, {}, args.stream))
            results["metered"] += asyncio.run(
                _run(metered, args.requests, {"Authorization": f"Bearer {key}"}, args.stream))
        rows = len(services.ledger.rows())
        services.close()
    print(f"{'app':8} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for name, lat in results.items():
        lat.sort()
        print(f"{name:8} {len(lat):8d} {statistics.median(lat) * 1e3:8.2f} "
              f"{lat[int(0.99 * len(lat))] * 1e3:8.2f} {len(lat) / sum(lat):8.1f}")
    ratio = statistics.median(results["metered"]) / statistics.median(results["bare"])
    extra = (statistics.median(results["metered"]) - statistics.median(results["bare"])) * 1e3
    print(f"metered / bare p50 latency: {ratio:.2f}x (+{extra:.2f} ms per request); "
          f"ledger rows written: {rows}")


if __name__ == "__main__":
    main()
