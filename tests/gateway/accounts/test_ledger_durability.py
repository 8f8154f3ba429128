"""Durable metering: the ledger's spool while the database is away, its replay, the
503 when it is full, and the reconciliation of a killed gateway's running rows.

A real PostgreSQL (``tests/support/postgres_process.py``) is stopped and started
again under load; a real gateway process (``tests/support/fake_gateway.py``) is
killed with SIGKILL. Waits are bounded polls on state, never sleeps as assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import sqlalchemy as sa

from serving.gateway.accounts.database import open_database
from serving.gateway.accounts.database import requests as requests_table
from serving.gateway.accounts.ledger import Ledger, replay_spool
from serving.gateway.accounts.ledger_spool import LedgerSpool
from serving.gateway.accounts.pricing import PriceTable
from serving.gateway.accounts.rate_limit import RateLimiter
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.metering import Metering
from serving.gateway.services.metrics import GatewayMetrics
from serving.gateway.services.tracing import RequestTracer
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.postgres_process import PostgresCluster, postgres_bin
from tests.support.server_process import free_port

MODEL = "fake"
WAIT_S = 30  # each poll's own bound


async def _until(what: str, probe, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


def _app(engine, services):
    return create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 4096, created=1)}, services)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                             timeout=30)


def _open(i: int) -> dict:
    return {"op": "open", "row": dict(request_id=f"r{i}", model=MODEL, priority="normal", stream=False,
                                      status="running", created_at=1.7e9 + i, day="2023-11-14")}


def _close(i: int) -> dict:
    return {"op": "close", "request_id": f"r{i}", "values": dict(status="ok", completion_tokens=i)}


# ------------------------------------------------------------------ the spool file


def test_spool_cuts_a_torn_line_and_a_repeated_replay_doubles_nothing(tmp_path):
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 20)
    spool.append([_open(1), _open(2), _close(1)])
    spool.append([_close(2), _open(3)])
    spool.close()
    with open(tmp_path / "spool" / "spool.jsonl", "ab") as f:  # a crash mid-append
        f.write(b'{"op":"open","row":{"request_')
    copy = (tmp_path / "spool" / "spool.jsonl").read_bytes()

    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 20)
    assert spool.depth_records == 5 and not (tmp_path / "spool" / "spool.jsonl").read_bytes().endswith(b"_")
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert replay_spool(spool, engine) == 5
    assert (spool.depth_records, spool.size_bytes) == (0, 0)
    spool.close()

    # A crash after the database took the writes and before the offset was recorded:
    # the same records again change nothing.
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "spool.jsonl").write_bytes(copy)
    again = LedgerSpool(tmp_path / "again", max_bytes=1 << 20)
    assert replay_spool(again, engine) == 5
    rows = {r["request_id"]: r for r in Ledger(engine).rows()}
    assert {k: (r["status"], r["completion_tokens"]) for k, r in rows.items()} == {
        "r1": ("ok", 1), "r2": ("ok", 2), "r3": ("running", 0)}


def test_a_write_the_database_refuses_is_skipped_and_the_rest_replayed(tmp_path):
    spool = LedgerSpool(tmp_path / "spool", max_bytes=1 << 20)
    bad = {"op": "close", "request_id": "r1", "values": {"no_such_column": 1}}
    spool.append([_open(1), bad, _close(1), _open(2)])
    engine = open_database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert replay_spool(spool, engine) == 4 and spool.depth_records == 0
    rows = {r["request_id"]: r["status"] for r in Ledger(engine).rows()}
    assert rows == {"r1": "ok", "r2": "running"}


# ------------------------------------------------------------------ a full spool


@pytest.mark.anyio
async def test_a_full_spool_refuses_new_requests_with_503_and_serves_nothing_unmetered(tmp_path):
    # Nothing listens on this port: every connection is refused, as with a stopped server.
    down = sa.create_engine(f"postgresql+psycopg://u@127.0.0.1:{free_port()}/x",
                            connect_args={"connect_timeout": 2})
    ledger = Ledger(down, LedgerSpool(tmp_path / "spool", max_bytes=300), retry_s=60)
    metering = Metering(ledger, PriceTable(models={}), GatewayMetrics(), RateLimiter(),
                        RequestTracer(False))
    engine = FakeEngine(text="hello")
    async with _client(_app(engine, GatewayServices(metering=metering, ledger=ledger))) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 200, r.text  # metered into the spool
        assert ledger.spooled_records == 2 and not ledger.admitting
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "b"})
        assert r.status_code == 503 and r.headers["retry-after"] == "30"
        assert r.json()["error"]["code"] == "ledger_unavailable"
        metrics = (await c.get("/metrics")).text
    assert len(engine.submitted) == 1
    assert "xlaserve:ledger_unavailable_rejections_total 1.0" in metrics
    ledger.close()


# ------------------------------------------------------------------ PostgreSQL away under load


@pytest.fixture(scope="module")
def postgres():
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed")
    cluster = PostgresCluster()
    yield cluster
    cluster.remove()


def _spool_metric(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith("xlaserve:ledger_spool_records "))
    return float(line.split()[1])


@pytest.mark.anyio
async def test_postgres_stopped_under_load_every_request_has_exactly_one_row(postgres, tmp_path):
    services = GatewayServices.open_server(database_url=postgres.url, ledger_spool_dir=str(tmp_path))
    key, _ = services.authenticator.key_store.create_key("acme")
    ledger = services.ledger
    engine = FakeEngine(responder=lambda req: [3 + (ord("a") + len(req.request_id) % 7)] * 40,
                        chunk=4, delay=0.002)
    received: dict[str, int] = {}  # response id -> completion tokens the client was told
    failures: list[str] = []
    stop = asyncio.Event()

    async def client_loop(c: httpx.AsyncClient, k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": MODEL, "prompt": f"client {k} request {i}", "max_tokens": 5 + (i * 7 + k) % 30}
            if i % 2:
                r = await c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    failures.append(r.text)
                    continue
                received[r.json()["id"]] = r.json()["usage"]["completion_tokens"]
            else:
                r = await c.post("/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
                if r.status_code != 200:
                    failures.append(r.text)
                    continue
                chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
                received[chunks[-1]["id"]] = chunks[-1]["usage"]["completion_tokens"]

    try:
        async with _client(_app(engine, services)) as c:
            c.headers["Authorization"] = f"Bearer {key}"
            clients = [asyncio.create_task(client_loop(c, k)) for k in range(4)]
            await _until("requests before the outage", lambda: len(received) >= 10)
            await asyncio.to_thread(postgres.stop)
            at_stop = len(received)
            await _until("writes spooled", lambda: ledger.spooled_records >= 10)
            await _until("requests served during the outage", lambda: len(received) >= at_stop + 20)
            assert _spool_metric((await c.get("/metrics")).text) > 0
            # Keys seen before the outage keep working (above); one never seen cannot be checked.
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                             headers={"Authorization": "Bearer xls-never-seen"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable"
            await asyncio.to_thread(postgres.start)
            await _until("the spool replayed", lambda: ledger.spooled_records == 0)
            stop.set()
            await asyncio.gather(*clients)
            await asyncio.to_thread(ledger.flush)
            assert _spool_metric((await c.get("/metrics")).text) == 0
        assert not failures, failures[:3]
        rows = ledger.rows()
        ids = [r["request_id"] for r in rows]
        assert len(ids) == len(set(ids)) == len(received)
        assert {r["request_id"]: r["completion_tokens"] for r in rows} == received
        assert {r["status"] for r in rows} == {"ok"}
        assert {r["gateway_instance"] for r in rows} == {services.instance.id}
        assert ledger.replayed_total >= 10
    finally:
        stop.set()
        services.close()


# ------------------------------------------------------------------ a gateway killed


def test_a_gateway_killed_with_sigkill_is_reconciled_at_the_next_start(tmp_path):
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    spool_dir = tmp_path / "spool"
    # A live gateway sharing the database and the spool directory: its running row must stay.
    live = GatewayServices.open_server(database_url=db, ledger_spool_dir=str(spool_dir))
    live.ledger.open_row(dict(request_id="live-1", model=MODEL, priority="normal", stream=True,
                              status="running", created_at=time.time()))
    live.ledger.flush()

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fake_gateway", "--port", str(port),
                             "--database-url", db, "--spool-dir", str(spool_dir), "--delay", "0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    streams = []
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        client = httpx.Client(base_url=url, timeout=30)
        for i in range(3):  # each has sent its first chunk: admitted, row "running"
            cm = client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": f"p{i}", "max_tokens": 300, "stream": True})
            lines = cm.__enter__().iter_lines()
            next(lines)
            streams.append((cm, lines))
        done = client.post("/v1/completions", json={"model": MODEL, "prompt": "short", "max_tokens": 3})
        assert done.status_code == 200
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
    finally:
        for cm, _ in streams:
            try:
                cm.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    engine = open_database(db)
    with engine.connect() as conn:
        killed = conn.execute(sa.select(requests_table.c.gateway_instance).where(
            requests_table.c.request_id == done.json()["id"])).scalar_one()
    assert (spool_dir.glob(f"*/{killed}"))  # its directory is left behind, unlocked

    restarted = GatewayServices.open_server(database_url=db, ledger_spool_dir=str(spool_dir))
    try:
        rows = {r["request_id"]: r for r in restarted.ledger.rows()}
        mine = [r for r in rows.values() if r["gateway_instance"] == killed]
        assert sorted(r["status"] for r in mine) == ["interrupted"] * 3 + ["ok"]
        for r in mine:
            if r["status"] == "interrupted":
                assert killed in r["error"] and restarted.instance.id in r["error"]
                assert r["finished_at"] is not None and r["completion_tokens"] == 0
                assert json.loads(r["trace"])["requested_max_tokens"] == 300
        assert rows["live-1"]["status"] == "running"  # a live instance's rows are not touched
        assert not list(spool_dir.glob(f"*/{killed}"))
        usage = restarted.ledger.usage(group_by="status")
        assert {u["group"]: u["incomplete"] for u in usage}["interrupted"] == 3
    finally:
        restarted.close()
        live.close()


def test_a_database_from_before_the_instance_column_gets_it_at_open(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    old = sa.create_engine(url)
    with old.begin() as conn:  # the requests table as an earlier version created it
        conn.execute(sa.text("CREATE TABLE requests (request_id VARCHAR(128) PRIMARY KEY, "
                             "model VARCHAR(256) NOT NULL, status VARCHAR(16) NOT NULL)"))
    old.dispose()
    engine = open_database(url)
    columns = {c["name"] for c in sa.inspect(engine).get_columns("requests")}
    assert "gateway_instance" in columns
    assert "ix_requests_gateway_instance" in {i["name"] for i in sa.inspect(engine).get_indexes("requests")}
