"""Image inputs are decoded after admission, off the event loop, within a pixel budget: a key over
its rate limit gets its 429 before any image is decoded, and while large single-colour PNGs (a few
tens of kilobytes of base64, 20 megapixels each) are decoded, a ``/health`` poller's longest gap
stays under the larger of 100 ms and half the shortest decode (25-30 ms measured on a quiet
machine). A fake engine with a vision spec and a byte tokenizer whose template places Gemma's
start-of-image id: no JAX, no model."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
import time

import httpx
import pytest
from PIL import Image

from serving.contract.engine_client import VisionSpec
from serving.gateway.accounts.api_keys import Limits
from serving.gateway.app import ServedModel, create_app
from serving.gateway.media import image_input
from serving.gateway.media.pixel_budget import PixelBudget
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import BOS_ID, FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

pytestmark = pytest.mark.anyio
MODEL = "fake-vision"
SPEC = VisionSpec(image_size=8, tokens_per_image=4, image_token_id=5, boi_token_id=6, eoi_token_id=7)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class VisionTokenizer(FakeTokenizer):
    """The byte tokenizer with a template that writes each image part as the start-of-image id."""

    def apply_chat_template(self, messages, tools=None):
        ids = [BOS_ID]
        for m in messages:
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            for p in parts:
                ids += [SPEC.boi_token_id] if p["type"] == "image" else self.encode(p["text"])
        return ids


@dataclasses.dataclass(eq=False)
class VisionEngine(FakeEngine):
    vision: VisionSpec = SPEC


GATE_TIMEOUT_S = 30


def _flat_png_url(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, "PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _chat(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture
def setup(tmp_path, monkeypatch):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                           ledger_spool_dir=str(tmp_path / "spool"))
    app = create_app({MODEL: ServedModel(MODEL, VisionEngine(text="ok"), VisionTokenizer(), 4096, created=1)},
                     services)
    decodes = []
    real = image_input.decode_image

    def counting(*args, **kwargs):  # records each decode's duration (seconds)
        t0 = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            decodes.append(time.monotonic() - t0)

    monkeypatch.setattr(image_input, "decode_image", counting)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60)
    yield services, client, decodes
    services.close()


async def test_a_rate_limited_key_gets_429_before_any_decode(setup):
    services, client, decodes = setup
    key, _ = services.authenticator.key_store.create_key("acme", limits=Limits(rpm=1))
    headers = {"Authorization": f"Bearer {key}"}
    async with client:
        r = await client.post("/v1/chat/completions", json=_chat(_flat_png_url(64, 64)), headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > SPEC.tokens_per_image
        assert len(decodes) == 1
        r = await client.post("/v1/chat/completions", json=_chat(_flat_png_url(4000, 3000)), headers=headers)
        assert_openai_error(r, 429)
        assert len(decodes) == 1  # refused before its image was decoded


async def test_health_answers_while_large_images_decode(setup, monkeypatch):
    """Four requests' image decodes are held in flight (each waits on a gate) while ``/health`` is
    asked: it answers, so no decode holds the event loop; released, every request is answered
    and metered. On the event loop, a held decode would stall the loop until its gate timed out
    (then the test fails on that timeout)."""
    services, client, decodes = setup
    counting = image_input.decode_image  # the fixture's recording wrapper
    gate, started, timed_out, threads = threading.Event(), threading.Semaphore(0), [], set()

    def held(*args, **kwargs):
        threads.add(threading.get_ident())
        started.release()
        if not gate.wait(GATE_TIMEOUT_S):
            timed_out.append(True)
        return counting(*args, **kwargs)

    monkeypatch.setattr(image_input, "decode_image", held)
    url = _flat_png_url(640, 480)
    async with client:
        requests = asyncio.gather(*(client.post("/v1/chat/completions", json=_chat(url)) for _ in range(4)))
        assert await asyncio.to_thread(started.acquire, True, GATE_TIMEOUT_S), "no decode started"
        health = await client.get("/health")
        gate.set()
        results = await requests
    assert health.status_code == 200 and not timed_out
    assert threading.main_thread().ident not in threads
    assert [r.status_code for r in results] == [200] * 4
    assert len(decodes) == 4
    rows = services.ledger.rows()
    assert [r["status"] for r in rows] == ["ok"] * 4


async def test_the_pixel_budget_holds_decodes_beyond_it_until_pixels_come_back():
    budget = PixelBudget(100)
    order = []

    async def take(name, n, hold: asyncio.Event):
        async with budget.hold(n):
            order.append((name, budget.in_use))
            await hold.wait()

    first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
    a = asyncio.create_task(take("a", 60, first))
    await asyncio.sleep(0)
    b = asyncio.create_task(take("b", 60, second))  # waits: 120 > 100
    c = asyncio.create_task(take("c", 1000, third))  # larger than the budget: waits to be alone
    await asyncio.sleep(0)
    assert order == [("a", 60)]
    first.set()
    await a
    await asyncio.sleep(0)
    assert order == [("a", 60), ("b", 60)]
    second.set()
    await b
    await asyncio.sleep(0)
    assert order[-1] == ("c", 100)
    third.set()
    await c
    assert budget.in_use == 0


async def test_images_decode_in_threads_of_their_own_at_a_lower_priority():
    """Image work runs in the decode pool's threads (not the prompt workers'), each reniced by
    `nice` (a bomb's decodes wait behind each other and yield the cores to the engine)."""
    import os
    import threading

    from serving.gateway.media.decode_workers import DecodeWorkers

    workers = DecodeWorkers(threads=1, nice=3)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def where():
        tid = threading.get_native_id()
        return os.getpriority(os.PRIO_PROCESS, tid), threading.current_thread().name, tid

    try:
        (prio, name, tid), (_, _, tid2) = [await workers.run(where) for _ in range(2)]
    finally:
        workers.close()
    assert prio == min(base + 3, 19) and name.startswith("xlaserve-image") and tid == tid2
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's is as it was


async def test_a_tenants_decodes_wait_behind_its_own_not_another_tenants(tmp_path, monkeypatch):
    """Tenant A's first image decode is held (a gate); its second request waits in A's lane, its
    third would pass A's pixels in flight and gets 429 at once; tenant B's image decodes
    meanwhile (on the other decode thread, which A's second may not take); released, all the
    rest are answered."""
    from serving.gateway.http.limits import GatewayLimits, MediaLimits

    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                           ledger_spool_dir=str(tmp_path / "spool"))
    limits = GatewayLimits(media=MediaLimits(max_tenant_image_pixels=2 * 64 * 64))
    app = create_app({MODEL: ServedModel(MODEL, VisionEngine(text="ok"), VisionTokenizer(), 4096, created=1)},
                     services, limits)
    lanes = app.state.serving.decode_lanes
    real, gate, started = image_input.decode_image, threading.Event(), []

    def held(data, *args, **kwargs):
        started.append(Image.open(io.BytesIO(data)).size)
        gate.wait(GATE_TIMEOUT_S)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(image_input, "decode_image", held)
    keys = services.authenticator.key_store
    a = {"Authorization": f"Bearer {keys.create_key('acme')[0]}"}
    b = {"Authorization": f"Bearer {keys.create_key('other')[0]}"}

    async def until(cond):
        for _ in range(GATE_TIMEOUT_S * 100):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60)
    try:
        async with client:
            post = lambda url, h: asyncio.create_task(  # noqa: E731
                client.post("/v1/chat/completions", json=_chat(url), headers=h))
            a1 = post(_flat_png_url(64, 64), a)
            await until(lambda: started == [(64, 64)])
            a2 = post(_flat_png_url(64, 64), a)
            await until(lambda: lanes.pixels("acme") == 2 * 64 * 64)
            a3 = await client.post("/v1/chat/completions", json=_chat(_flat_png_url(64, 64)), headers=a)
            b1 = post(_flat_png_url(48, 48), b)
            await until(lambda: len(started) == 2)
            assert started == [(64, 64), (48, 48)]  # B's decode started; A's second still waits
            gate.set()
            results = await asyncio.gather(a1, a2, b1)
    finally:
        gate.set()
        services.close()
    assert_openai_error(a3, 429)
    assert a3.json()["error"]["code"] == "image_decodes_queued" and a3.headers["Retry-After"] == "1"
    assert [r.status_code for r in results] == [200, 200, 200]
    assert started == [(64, 64), (48, 48), (64, 64)] and lanes.pixels("acme") == lanes.pixels("other") == 0


async def test_a_tenants_decoded_pixels_per_second_are_bounded():
    """Each tenant's bucket: a burst, then the rate; another tenant's bucket is its own; a
    request gone while it waits gets its pixels back (a fake clock: no waiting)."""
    from serving.gateway.media.tenant_decodes import TenantDecodeLanes

    now, slept, cancel = [0.0], [], []

    async def sleep(seconds):
        if cancel:
            raise asyncio.CancelledError
        slept.append(seconds)
        now[0] += seconds

    lanes = TenantDecodeLanes(max_tenant_pixels=10**9, pixel_rate=100, pixel_burst=300, clock=lambda: now[0],
                              sleep=sleep)

    async def decode(tenant, pixels):
        async with lanes.hold(tenant, pixels):
            pass

    await decode("a", 200)  # within the burst
    await decode("a", 200)  # 100 left: waits a second for the other 100
    await decode("b", 300)  # b's own burst
    assert slept == [1.0]
    cancel.append(True)
    with pytest.raises(asyncio.CancelledError):
        await decode("a", 100)  # gone while it waited: its 100 go back
    cancel.clear()
    await decode("a", 100)  # the bucket is empty (not 100 in debt): one second
    now[0] += 60  # a minute later: the burst again, and no more
    await decode("a", 300)
    await decode("a", 50)
    assert slept == [1.0, 1.0, 0.5]
    assert lanes.pixels("a") == 0
