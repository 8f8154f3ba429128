"""The Files and Batch APIs in-process, with the official ``openai`` client.

The app runs over httpx's ASGI transport with the scripted fake engine and a
SQLite ledger per test; its lifespan (which starts the batch runner) is
entered by hand, as the transport does not run it. Engines that hold requests
until a test lets them go make "while a line runs" a state the test waits
for, never a time; the 24 h window is passed by moving the runner's injected
clock. Every wait is a bounded poll on state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import openai
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.batch.batch_runner import BatchSettings
from serving.gateway.http.limits import GatewayLimits
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer

pytestmark = pytest.mark.anyio
MODEL = "gemma-3-270m"  # priced in configs/prices.yaml


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


class GatedEngine(FakeEngine):
    """A fake engine whose requests wait for ``gate`` (except the first ``free`` ones)."""

    def __init__(self, free: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.free = free
        self.gate = asyncio.Event()

    def submit(self, request):
        inner = super().submit(request)
        if len(self.submitted) <= self.free:
            return inner

        async def gated():
            await self.gate.wait()
            async for ev in inner:
                yield ev

        return gated()


@contextlib.asynccontextmanager
async def gateway(tmp_path, engine=None, *, concurrency: int = 2, clock=None, **limits):
    """(app, services, openai client for `key`) with the runner started."""
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    engine = engine or FakeEngine(text="Hello world")
    app = create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 512)}, services,
                     GatewayLimits(**limits),
                     BatchSettings(concurrency=concurrency, lease_seconds=0.3, poll_seconds=0.05,
                                   clock=clock or Clock()))
    try:
        async with app.router.lifespan_context(app):
            yield app, services
    finally:
        services.close()


def client(app, key: str = "unused") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def jsonl(lines) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def chat_line(custom_id: str, body: dict | None = None) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": body if body is not None else {"model": MODEL, "max_tokens": 5,
                                                    "messages": [{"role": "user", "content": custom_id}]}}


async def until(predicate, what: str, tries: int = 400):
    """Polls `predicate` (async) every 25 ms until it returns something truthy."""
    for _ in range(tries):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


async def batch_in(oai, batch_id: str, *statuses: str):
    async def check():
        b = await oai.batches.retrieve(batch_id)
        return b if b.status in statuses else None

    return await until(check, f"batch {batch_id} in {statuses}")


async def start_batch(oai, lines, endpoint="/v1/chat/completions"):
    f = await oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await oai.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                                    metadata={"job": "test"})


async def read_lines(oai, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await oai.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


# ------------------------------------------------------------------ tests


async def test_a_malformed_body_gives_an_error_line_and_the_batch_completes(tmp_path):
    async with gateway(tmp_path) as (app, services):
        oai = client(app)
        bad = chat_line("bad", {"model": MODEL, "max_tokens": 5})  # no messages
        batch = await start_batch(oai, [chat_line("a"), bad, chat_line("c")])
        assert batch.status == "validating" and batch.metadata == {"job": "test"}
        assert batch.expires_at == batch.created_at + 24 * 3600
        done = await batch_in(oai, batch.id, "completed", "failed")
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        out = await read_lines(oai, done.output_file_id)
        errors = await read_lines(oai, done.error_file_id)
        assert [x["custom_id"] for x in out] == ["a", "c"]
        for x in out:
            assert x["error"] is None and x["response"]["status_code"] == 200
            assert x["response"]["body"]["choices"][0]["message"]["content"] == "Hello"
            assert x["response"]["request_id"] == x["id"]
        assert [x["custom_id"] for x in errors] == ["bad"]
        assert errors[0]["response"]["status_code"] == 400
        assert errors[0]["response"]["body"]["error"]["param"] == "messages"
        assert (await oai.files.retrieve(done.output_file_id)).purpose == "batch_output"
        # Each line is metered at batch priority, with the price table's batch discount.
        rows = [r for r in services.ledger.rows() if r["status"] == "ok"]
        assert sorted(r["x_request_id"] for r in rows) == sorted(x["id"] for x in out)
        prices = services.metering.prices
        assert prices.batch_discount == 0.5
        for r in rows:
            assert r["priority"] == "batch" and r["completion_tokens"] == 5
            full = prices.cost(MODEL, r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"])
            assert r["cost_usd"] == pytest.approx(full * 0.5) and r["cost_usd"] > 0
        trace = await oai.get(f"/requests/{out[0]['id']}", cast_to=httpx.Response)
        assert trace.json()["priority"] == "batch"


async def test_malformed_lines_fail_validation_with_their_line_numbers(tmp_path):
    async with gateway(tmp_path) as (app, _):
        oai = client(app)
        content = (jsonl([chat_line("a")]) + b"{not json\n"
                   + jsonl([chat_line("a"), {**chat_line("d"), "url": "/v1/completions"}]))
        f = await oai.files.create(file=("in.jsonl", content), purpose="batch")
        batch = await oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        failed = await batch_in(oai, batch.id, "failed", "completed")
        assert failed.status == "failed" and failed.failed_at
        assert [(e.line, e.code) for e in failed.errors.data] == [
            (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url")]
        with pytest.raises(openai.BadRequestError) as e:
            await oai.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")
        assert e.value.body["param"] == "endpoint"
        with pytest.raises(openai.NotFoundError):
            await oai.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                                     completion_window="24h")
        with pytest.raises(openai.ConflictError):
            await oai.batches.cancel(batch.id)


async def test_cancel_passes_through_cancelling_to_cancelled(tmp_path):
    engine = GatedEngine(free=1, text="Hello world")
    async with gateway(tmp_path, engine, concurrency=2) as (app, services):
        oai = client(app)
        batch = await start_batch(oai, [chat_line(f"r{i}") for i in range(5)])

        async def one_done_one_held():
            b = await oai.batches.retrieve(batch.id)
            return b.request_counts.completed == 1 and len(engine.submitted) >= 2

        await until(one_done_one_held, "one line finished and another held in the engine")
        cancelling = await oai.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await batch_in(oai, batch.id, "cancelled")
        assert done.cancelled_at and done.cancelling_at
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 0)
        out = await read_lines(oai, done.output_file_id)
        assert len(out) == 1 and out[0]["response"]["status_code"] == 200
        assert done.error_file_id is None
        statuses = sorted(r["status"] for r in services.ledger.rows())
        assert statuses.count("ok") == 1 and "running" not in statuses
        assert statuses.count("cancelled") == len(engine.submitted) - 1 >= 1
        assert len(engine.submitted) < 5  # the pending lines never ran
        assert (await oai.batches.cancel(batch.id)).status == "cancelled"  # idempotent


async def test_past_the_24h_window_unfinished_lines_expire(tmp_path):
    clock = Clock()
    engine = GatedEngine(free=1)
    async with gateway(tmp_path, engine, concurrency=1, clock=clock) as (app, services):
        oai = client(app)
        batch = await start_batch(oai, [chat_line(f"r{i}") for i in range(3)])

        async def second_held():
            return len(engine.submitted) == 2

        await until(second_held, "the second line held in the engine")
        clock.t += 24 * 3600 + 1
        app.state.batch_runner.wake()
        done = await batch_in(oai, batch.id, "expired")
        assert done.expired_at == int(clock.t)
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 2)
        assert [x["custom_id"] for x in await read_lines(oai, done.output_file_id)] == ["r0"]
        errors = await read_lines(oai, done.error_file_id)
        assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in errors] == [
            ("r1", "batch_expired", None), ("r2", "batch_expired", None)]
        assert sorted(r["status"] for r in services.ledger.rows()) == ["cancelled", "ok"]


async def test_files_and_batches_are_scoped_to_the_tenant(tmp_path):
    clock = Clock()
    async with gateway(tmp_path, GatedEngine(), clock=clock) as (app, services):
        store = services.authenticator.key_store
        key_a, _ = store.create_key("acme")
        key_b, _ = store.create_key("globex")
        a, b = client(app, key_a), client(app, key_b)
        f = await a.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch")
        batch = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
        for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                     lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                     lambda: b.batches.cancel(batch.id),
                     lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                await call()
        assert [x.id async for x in b.files.list()] == []
        assert [x.id async for x in b.batches.list()] == []
        assert [x.id async for x in a.batches.list()] == [batch.id]
        with pytest.raises(openai.AuthenticationError):
            await client(app, "xls-wrong").files.list()
        # Pagination: newest first, `after` the last id of the page.
        more = []
        for i in range(3):
            clock.t += 1
            more.append(await a.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch"))
        page = await a.files.list(limit=2)
        assert [x.id for x in page.data] == [more[2].id, more[1].id] and page.has_more
        page2 = await a.files.list(limit=2, after=page.data[-1].id)
        assert [x.id for x in page2.data] == [more[0].id, f.id] and not page2.has_more
        deleted = await a.files.delete(more[0].id)
        assert deleted.deleted and deleted.id == more[0].id
        with pytest.raises(openai.NotFoundError):
            await a.files.retrieve(more[0].id)
        assert (await a.batches.cancel(batch.id)).status == "cancelling"
        await batch_in(a, batch.id, "cancelled")


async def test_file_uploads_have_their_own_size_limit(tmp_path):
    async with gateway(tmp_path, max_request_bytes=2000, max_file_bytes=10_000) as (app, _):
        oai = client(app)
        ok = await oai.files.create(file=("in.jsonl", b"x" * 5000), purpose="batch")  # > max_request_bytes
        assert ok.bytes == 5000 and (await oai.files.content(ok.id)).content == b"x" * 5000
        with pytest.raises(openai.APIStatusError) as e:  # under the form allowance, over the file limit
            await oai.files.create(file=("in.jsonl", b"x" * 10_001), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
        assert "max_file_bytes" in e.value.body["message"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw:
            files = {"file": ("big.jsonl", b"x" * 200_000)}
            r = await raw.post("/v1/files", data={"purpose": "batch"}, files=files)  # Content-Length
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: counted as it streams in
                yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
                for _ in range(100):
                    yield b"x" * 4096
                yield b"\r\n--b--\r\n"

            r = await raw.post("/v1/files", content=chunks(),
                               headers={"content-type": "multipart/form-data; boundary=b"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await raw.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "x" * 3000}]})
            assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]
            r = await raw.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("a", b"{}")})
            assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
            r = await raw.post("/v1/files", json={"purpose": "batch"})
            assert r.status_code == 415
