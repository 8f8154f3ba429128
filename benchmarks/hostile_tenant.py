"""One hostile tenant next to a victim on one gateway: the victim's TTFT and metering.

A real gateway process (uvicorn with the server's header timeout and ``limit_concurrency``,
the real app, keys, SQLite ledger and spool) serves the tiny-random model (float32, 8 slots,
the real engine loop) and a fake vision model (the scripted fake engine with a vision spec:
images are fetched, checked and decoded by the gateway as for Gemma 3, no tower runs). The
victim tenant runs a closed loop of ``--streams`` streamed completions on the tiny model,
first alone for ``--seconds``, then for as long again while the attacker tenant sends, all at
once:

* image bombs: chat requests of 8 single-colour PNGs of 40 Mpx each (the most a request may
  carry; a few hundred kB of base64 each), ``--bombers`` at a time;
* trickling fetches: ``image_url``s on a local server that sends its headers, then one byte
  every 0.5 s, ``--tricklers`` at a time (the benchmark's gateway process takes loopback
  for a public address, so that the fetch reaches that server; refusing internal addresses
  is tests/gateway/test_image_fetch.py's);
* quota-busting uploads: 1 MB files against a tenant quota of 4 files and 2 MB
  (``xlaserve tenants set --max-files 4 --max-file-bytes 2000000``), ``--uploaders`` at a time;
* ``--idle`` idle connections that send nothing (reopened when the header timeout closes them).

The gateway runs with the server's defaults for images: each tenant's decodes one at a time,
at most 4 x 40 Mpx waiting or decoding, 20 M pixels a second after a burst of 80 M
(``serving/gateway/media/tenant_decodes.py``).

The attacker's client is a process of its own at nice ``--attacker-nice`` (10): on a machine of
few cores its own CPU (building the bomb bodies and the uploads) would otherwise come out of the
gateway's, which a remote attacker's does not.

Reported: the victim's TTFT p50/p99 alone and under attack and their ratio, the attacker's
answers by status, the gateway process's CPU seconds in each phase (all its threads), the
machine's one-minute load average at each phase's start and end (the
benchmark's own processes count in it: compare runs by it, not against zero), and the
metering check: the victim's ledger rows equal its requests (one row per response id, none
missing or doubled, completion tokens as its clients were told).

    python -m benchmarks.hostile_tenant [--seconds 30] [--streams 8] [--idle 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import dataclasses
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TINY, VISION = "tiny-random", "fake-vision"
MAX_TOKENS = 24


# ------------------------------------------------------------------ the gateway process


def serve(args) -> None:
    """The gateway process (``--serve``)."""
    import uvicorn

    from model.tokenizer import Tokenizer
    from serving.contract.engine_client import VisionSpec
    from serving.gateway.app import ServedModel, create_app
    from serving.gateway.http.header_timeout import header_timeout_protocol
    from serving.gateway.http.limits import GatewayLimits, MediaLimits
    from serving.gateway.media import image_input
    from serving.gateway.services.gateway_services import GatewayServices
    from tests.support.gateway_fakes import BOS_ID, FakeEngine, FakeTokenizer
    from tests.support.tiny_engine import make_loop

    spec = VisionSpec(image_size=8, tokens_per_image=4, image_token_id=5, boi_token_id=6, eoi_token_id=7)

    class VisionTokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, tools=None):
            ids = [BOS_ID]
            for m in messages:
                parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
                for p in parts:
                    ids += [spec.boi_token_id] if p["type"] == "image" else self.encode(p["text"])
            return ids

    @dataclasses.dataclass(eq=False)
    class VisionEngine(FakeEngine):
        vision: VisionSpec = spec

    image_input.is_public_address = lambda address: True  # the trickling server is on loopback
    services = GatewayServices.open_server(database_url=args.database_url, ledger_spool_dir=args.spool_dir)
    loop = make_loop(max_slots=8, num_pages=128)
    loop.start(warmup=True)
    models = {TINY: ServedModel(TINY, loop, Tokenizer.tiny(), loop.max_model_len, created=1),
              VISION: ServedModel(VISION, VisionEngine(text="ok"), VisionTokenizer(), 4096, created=1)}
    limits = GatewayLimits(media=MediaLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=args.fetch_timeout))
    app = create_app(models, services, limits)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                http=header_timeout_protocol(args.header_timeout), limit_concurrency=args.limit_concurrency)


# ------------------------------------------------------------------ the load


def _bomb_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (6000, 6666), (200, 10, 10)).save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


async def _trickle_server() -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader, writer):
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n")
            while True:
                writer.write(b"\x89")
                await writer.drain()
                await asyncio.sleep(0.5)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the fetch gave up (its deadline), or the attack is over
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@dataclasses.dataclass
class Victim:
    ttfts: list[float] = dataclasses.field(default_factory=list)
    usage: dict[str, int] = dataclasses.field(default_factory=dict)  # response id -> completion tokens
    failures: list[str] = dataclasses.field(default_factory=list)


async def _victim(url: str, key: str, streams: int, seconds: float) -> Victim:
    out = Victim()
    deadline = time.monotonic() + seconds

    async def one_stream(c: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            body = {"model": TINY, "prompt": f"stream {k} request {i}: the quick brown fox", "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first, last = None, None
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        out.failures.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                            first = time.perf_counter() - t0
                        last = chunk
            except httpx.HTTPError as e:
                out.failures.append(repr(e))
                continue
            if first is None or last is None or not last.get("usage"):
                out.failures.append("a stream without text or usage")
                continue
            out.ttfts.append(first)
            out.usage[last["id"]] = last["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                                 limits=limits) as c:
        await asyncio.gather(*(one_stream(c, k) for k in range(streams)))
    return out


async def _attacker(url: str, key: str, args, trickle_port: int, stop: asyncio.Event) -> collections.Counter:
    answers: collections.Counter = collections.Counter()
    bomb = _bomb_url()
    headers = {"Authorization": f"Bearer {key}"}

    async def loop(kind: str, send) -> None:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
            while not stop.is_set():
                try:
                    r = await send(c)
                    code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
                    answers[f"{kind} {r.status_code}" + (f" {code}" if code else "")] += 1
                except (httpx.HTTPError, ValueError) as e:
                    answers[f"{kind} {type(e).__name__}"] += 1
                    await asyncio.sleep(0.1)

    def chat(image_url: str, n: int):
        return {"model": VISION, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what"}, *[{"type": "image_url", "image_url": {"url": image_url}}] * n]}]}

    async def bomb_one(c):
        return await c.post("/v1/chat/completions", json=chat(bomb, 8))

    async def trickle_one(c):
        return await c.post("/v1/chat/completions", json=chat(f"http://127.0.0.1:{trickle_port}/x.png", 1))

    async def upload_one(c):
        return await c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", b"x" * 1_000_000)})

    async def idle() -> None:
        socks: list[socket.socket] = []
        host, port = url.split("//")[1].split(":")
        try:
            while not stop.is_set():
                socks = [s for s in socks if s.fileno() >= 0 and not _closed(s)]
                while len(socks) < args.idle and not stop.is_set():
                    s = socket.socket()
                    s.setblocking(False)
                    try:
                        await asyncio.get_running_loop().sock_connect(s, (host, int(port)))
                    except OSError:
                        s.close()
                        answers["idle connect refused"] += 1
                        await asyncio.sleep(0.1)
                        continue
                    socks.append(s)
                    answers["idle connections opened"] += 1
                await asyncio.sleep(0.5)
        finally:
            for s in socks:
                s.close()

    await asyncio.gather(*(loop("bomb", bomb_one) for _ in range(args.bombers)),
                         *(loop("trickle", trickle_one) for _ in range(args.tricklers)),
                         *(loop("upload", upload_one) for _ in range(args.uploaders)), idle())
    return answers


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used (Linux's /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _attack_main(args) -> None:
    """The attacker process (``--attack``): the trickling server and the attack, until its
    stdin closes; then its answers as one JSON line."""
    server, trickle_port = await _trickle_server()
    stop = asyncio.Event()
    attack = asyncio.create_task(_attacker(args.url, args.key, args, trickle_port, stop))
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set()
    answers = await attack
    server.close()
    print(json.dumps(dict(answers)), flush=True)


async def _run(args, url: str, victim_key: str, attacker_key: str, gateway_pid: int) -> dict:
    warm = await _victim(url, victim_key, args.streams, 3)  # warm: connections, first requests
    load = {"alone_start": os.getloadavg()[0]}
    cpu = [_cpu_seconds(gateway_pid)]
    alone = await _victim(url, victim_key, args.streams, args.seconds)
    load["alone_end"] = os.getloadavg()[0]
    cpu.append(_cpu_seconds(gateway_pid))
    # The attacker in a process of its own, so that its work is not the victim's client's, at
    # nice 10: on a machine of few cores, its client's own CPU (building 2.4 MB bomb bodies and
    # 1 MB uploads) would otherwise be taken from the gateway, which a remote attacker's is not.
    attacker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.hostile_tenant", "--attack", "--url", url, "--key", attacker_key,
        "--bombers", str(args.bombers), "--tricklers", str(args.tricklers), "--uploaders", str(args.uploaders),
        "--idle", str(args.idle), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        preexec_fn=lambda: os.nice(args.attacker_nice))
    await asyncio.sleep(5)  # the attack under way (idle connections open, decodes running)
    load["attacked_start"] = os.getloadavg()[0]
    cpu.append(_cpu_seconds(gateway_pid))
    attacked = await _victim(url, victim_key, args.streams, args.seconds)
    load["attacked_end"] = os.getloadavg()[0]
    cpu.append(_cpu_seconds(gateway_pid))
    out, _ = await attacker.communicate(b"")
    answers = json.loads(out.decode().strip().splitlines()[-1])
    gateway_cpu = None if None in cpu else dict(alone=round(cpu[1] - cpu[0], 1), attacked=round(cpu[3] - cpu[2], 1))
    return dict(warm=warm, alone=alone, attacked=attacked, answers=answers, load=load, gateway_cpu=gateway_cpu)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of victim load alone, then under attack")
    p.add_argument("--streams", type=int, default=8, help="the victim's concurrent streams")
    p.add_argument("--bombers", type=int, default=2, help="image-bomb requests at a time")
    p.add_argument("--tricklers", type=int, default=4, help="trickling fetches at a time")
    p.add_argument("--uploaders", type=int, default=2, help="quota-busting uploads at a time")
    p.add_argument("--idle", type=int, default=1000, help="idle connections held open")
    p.add_argument("--attacker-nice", type=int, default=10, help="the attacker client process's nice value")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--attack", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--database-url", help=argparse.SUPPRESS)
    p.add_argument("--spool-dir", help=argparse.SUPPRESS)
    p.add_argument("--fetch-timeout", type=float, default=2.0, help="the gateway's image fetch deadline (s)")
    p.add_argument("--header-timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--limit-concurrency", type=int, default=2048, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    if args.attack:
        asyncio.run(_attack_main(args))
        return 0

    from serving.gateway.accounts.api_keys import KeyStore, Quotas
    from serving.gateway.accounts.database import open_database
    from serving.gateway.accounts.ledger import Ledger
    from tests.support.server_process import free_port

    work = Path(tempfile.mkdtemp(prefix="xlaserve-hostile-"))
    db_url = f"sqlite:///{work / 'ledger.db'}"
    keys = KeyStore(open_database(db_url))
    victim_key, _ = keys.create_key("victim")
    attacker_key, _ = keys.create_key("attacker")
    keys.set_tenant("attacker", quotas=Quotas(file_bytes=2_000_000, files=4))
    port = free_port()
    log = open(work / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.hostile_tenant", "--serve", "--port", str(port),
                             "--database-url", db_url, "--spool-dir", str(work / "spool"),
                             "--fetch-timeout", str(args.fetch_timeout)],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not start: {(work / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.5)
        out = asyncio.run(_run(args, url, victim_key, attacker_key, proc.pid))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = Ledger(open_database(db_url)).rows(tenant="victim")
    alone, attacked = out["alone"], out["attacked"]
    told = {**out["warm"].usage, **alone.usage, **attacked.usage}  # the warm-up's requests are metered too
    by_id = {r["request_id"]: r for r in rows}
    ms = lambda x: round(1000 * x, 1)  # noqa: E731
    report = dict(
        machine=os.uname().nodename, streams=args.streams, seconds_each=args.seconds, idle_connections=args.idle,
        alone=dict(requests=len(alone.ttfts), ttft_p50_ms=ms(statistics.median(alone.ttfts)),
                   ttft_p99_ms=ms(_p(alone.ttfts, 0.99)), failures=len(alone.failures)),
        attacked=dict(requests=len(attacked.ttfts), ttft_p50_ms=ms(statistics.median(attacked.ttfts)),
                      ttft_p99_ms=ms(_p(attacked.ttfts, 0.99)), failures=len(attacked.failures)),
        attacker=dict(sorted(out["answers"].items())), cores=os.cpu_count(),
        load_average_1min={k: round(v, 2) for k, v in out["load"].items()},
        gateway_cpu_seconds=out["gateway_cpu"],
        victim_ledger_rows=len(rows), victim_requests_told=len(told),
        missing=sum(1 for rid in told if rid not in by_id), extra=sum(1 for rid in by_id if rid not in told),
        doubled=len(rows) - len({r["request_id"] for r in rows}),
        token_mismatches=sum(1 for rid, n in told.items() if rid in by_id and by_id[rid]["completion_tokens"] != n),
        statuses=sorted({r["status"] for r in rows}),
    )
    report["ttft_p99_ratio"] = round(report["attacked"]["ttft_p99_ms"] / report["alone"]["ttft_p99_ms"], 2)
    report["ttft_p50_ratio"] = round(report["attacked"]["ttft_p50_ms"] / report["alone"]["ttft_p50_ms"], 2)
    print(json.dumps(report, indent=2))
    metered = (report["missing"] == report["extra"] == report["doubled"] == report["token_mismatches"] == 0
               and report["statuses"] == ["ok"] and len(rows) == len(told))
    ok = metered and report["ttft_p99_ratio"] <= 2.0 and not alone.failures and not attacked.failures
    print("PASS" if ok else "FAIL", f"- victim TTFT p99 {report['ttft_p99_ratio']}x alone (goal <= 2x); "
          f"metered exactly once: {metered}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
