"""Durable metering under a database outage: PostgreSQL stopped for 30 s under load.

A real gateway process (``tests/support/fake_gateway.py``: the real app, keys,
ledger and spool over the scripted fake engine, no model) on a throwaway
PostgreSQL (``tests/support/postgres_process.py``); concurrent clients send
completions (every other one streamed, with the usage chunk) through HTTP with
an API key, for `--before` seconds, then PostgreSQL is stopped for `--outage`
seconds, started again, and the load goes on for `--after` seconds. Then, once
``/metrics`` shows the spool empty, the ledger is read back and compared with
what the clients received: one row per response id, none missing, none
doubled, completion tokens equal to the usage each client was told.

    python -m benchmarks.ledger_outage [--outage 30] [--clients 8] [--before 5] [--after 5] [--full-disk]

Needs PostgreSQL's server binaries (Debian's ``postgresql`` package). With ``--full-disk`` the
database is instead a SQLite file on a filesystem of its own (a 64 MB tmpfs this benchmark
mounts: Linux, as root) whose disk fills: the outage is a file filling it to the last byte
(SQLite answers "database or disk is full"), the end of it that file's removal; the spool
is on another filesystem (the start-up check refuses one without room).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serving.gateway.accounts.api_keys import KeyStore
from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.ledger import Ledger
from tests.support.postgres_process import PostgresCluster
from tests.support.server_process import free_port

MODEL = "fake"


class FullDisk:
    """A SQLite ledger on a small tmpfs of its own; :meth:`stop` fills the disk, :meth:`start`
    frees it (the ``PostgresCluster`` interface the benchmark drives)."""

    def __init__(self, size_mb: int = 64) -> None:
        self.mount = Path(tempfile.mkdtemp(prefix="xlaserve-fulldisk-"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(self.mount)], check=True)
        self.url = f"sqlite:///{self.mount / 'ledger.db'}"
        self.filler = self.mount / "filler"

    def stop(self) -> None:
        """Fills the filesystem: a file written until ENOSPC."""
        with open(self.filler, "wb", buffering=0) as f:
            chunk = b"\0" * (1 << 20)
            while True:
                try:
                    f.write(chunk)
                except OSError:
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: len(chunk) // 2]

    def start(self) -> None:
        self.filler.unlink()

    def remove(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=False)


def _spool(metrics: str) -> tuple[float, float]:
    values = {}
    for line in metrics.splitlines():
        for name in ("xlaserve:ledger_spool_records", "xlaserve:ledger_spool_bytes"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values["xlaserve:ledger_spool_records"], values["xlaserve:ledger_spool_bytes"]


async def _run(args, url: str, key: str, pg: PostgresCluster) -> dict:
    received: dict[str, int] = {}
    phase_of: dict[str, str] = {}
    latency: dict[str, list[float]] = {"before": [], "outage": [], "after": []}
    failures: list[str] = []
    phase = "before"
    stop = asyncio.Event()
    peak = [0.0, 0.0, 0.0]

    async def client(c: httpx.AsyncClient, k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": MODEL, "prompt": f"client {k} request {i}", "max_tokens": 8 + (i * 7 + k) % 40}
            t0, p = time.perf_counter(), phase
            try:
                if i % 2:
                    r = await c.post("/v1/completions", json=body)
                    if r.status_code == 200:
                        rid, used = r.json()["id"], r.json()["usage"]["completion_tokens"]
                else:
                    r = await c.post("/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}})
                    if r.status_code == 200:
                        last = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")][-1]
                        rid, used = last["id"], last["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                failures.append(repr(e))
                continue
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
                continue
            latency[p].append(time.perf_counter() - t0)
            received[rid] = used
            phase_of[rid] = p

    async def watch(c: httpx.AsyncClient) -> None:
        while not stop.is_set():
            text = (await c.get("/metrics")).text
            records, nbytes = _spool(text)
            peak[0], peak[1] = max(peak[0], records), max(peak[1], nbytes)
            full = [float(x.split()[1]) for x in text.splitlines() if x.startswith("xlaserve:ledger_database_full ")]
            peak[2] = max(peak[2], full[0] if full else 0.0)
            await asyncio.sleep(0.5)

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as c:
        tasks = [asyncio.create_task(client(c, k)) for k in range(args.clients)]
        watcher = asyncio.create_task(watch(c))
        await asyncio.sleep(args.before)
        phase = "outage"
        await asyncio.to_thread(pg.stop)
        t_down = time.monotonic()
        await asyncio.sleep(args.outage)
        await asyncio.to_thread(pg.start)
        outage_s = time.monotonic() - t_down
        phase = "after"
        t_up = time.monotonic()
        while _spool((await c.get("/metrics")).text)[0] > 0:
            await asyncio.sleep(0.1)
        drained_s = time.monotonic() - t_up
        await asyncio.sleep(max(0.0, args.after - drained_s))
        stop.set()
        await asyncio.gather(*tasks, watcher)
        while _spool((await c.get("/metrics")).text)[0] > 0:
            await asyncio.sleep(0.1)
        replayed = next(float(x.split()[1]) for x in (await c.get("/metrics")).text.splitlines()
                        if x.startswith("xlaserve:ledger_spool_replayed_total "))
    ms = lambda xs: round(1000 * statistics.median(xs), 1) if xs else None  # noqa: E731
    return dict(received=received, phase_of=phase_of, failures=failures, outage_s=round(outage_s, 1),
                drain_s=round(drained_s, 2), peak_spool_records=int(peak[0]), peak_spool_bytes=int(peak[1]),
                database_full_seen=bool(peak[2]),
                replayed_writes=int(replayed),
                p50_ms={p: ms(v) for p, v in latency.items()},
                requests={p: len(v) for p, v in latency.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outage", type=float, default=30.0, help="seconds PostgreSQL is down")
    p.add_argument("--before", type=float, default=5.0, help="seconds of load before it")
    p.add_argument("--after", type=float, default=5.0, help="seconds of load after it is back")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--delay", type=float, default=0.005, help="the fake engine's seconds per token")
    p.add_argument("--full-disk", action="store_true", help="a full disk under a SQLite ledger instead of a "
                   "stopped PostgreSQL (mounts a tmpfs: Linux, as root)")
    args = p.parse_args(argv)

    pg = FullDisk() if args.full_disk else PostgresCluster()
    work = Path(tempfile.mkdtemp(prefix="xlaserve-outage-"))
    proc = None
    try:
        key, _ = KeyStore(open_database(pg.url)).create_key("bench")
        port = free_port()
        log = open(work / "gateway.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_gateway", "--port", str(port),
                                 "--database-url", pg.url, "--spool-dir", str(work / "spool"),
                                 "--delay", str(args.delay), "--text", "y" * 64],
                                stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not start: {(work / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.2)
        out = asyncio.run(_run(args, url, key, pg))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        rows = Ledger(open_database(pg.url)).rows()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pg.remove()

    received = out.pop("received")
    phase_of = out.pop("phase_of")
    ids = [r["request_id"] for r in rows]
    by_id = {r["request_id"]: r for r in rows}
    report = dict(
        out,
        outage_kind="full disk (SQLite on a filled tmpfs)" if args.full_disk else "PostgreSQL stopped",
        served=len(received),
        served_during_outage=sum(1 for v in phase_of.values() if v == "outage"),
        ledger_rows=len(rows),
        doubled=len(ids) - len(set(ids)),
        missing=sum(1 for rid in received if rid not in by_id),
        extra=sum(1 for rid in by_id if rid not in received),
        token_mismatches=sum(1 for rid, n in received.items()
                             if rid in by_id and by_id[rid]["completion_tokens"] != n),
        statuses=sorted({r["status"] for r in rows}),
        completion_tokens_clients=sum(received.values()),
        completion_tokens_ledger=sum(r["completion_tokens"] for r in rows),
    )
    report["failures"] = len(out["failures"])
    print(json.dumps(report, indent=2))
    ok = (report["doubled"] == report["missing"] == report["extra"] == report["token_mismatches"] == 0
          and report["failures"] == 0 and report["served_during_outage"] > 0)
    print("PASS" if ok else "FAIL", "- one row per request, tokens as the clients saw them" if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
