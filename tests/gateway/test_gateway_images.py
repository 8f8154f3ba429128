"""Image inputs through the gateway, in process, over a real engine loop on the tiny Gemma 3 vision
checkpoint (tests/data/hf_tiny/gemma3_vision, a character tokenizer with Gemma's image tokens
and Gemma 3's chat template: tests/support/hf_dir_fixtures.py): data-URL images answered, their
soft tokens in ``prompt_tokens``, the images counted and priced in the ledger; every bad image
refused with a 400 naming its content part while a good request next to it is served as alone;
remote URLs refused unless their host is allowed, then fetched with a size cap; the Messages
API's image blocks (a base64 source, a URL source fetched) give the chat request's prompt and answer."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from model.factory import build_model
from model.safetensors_loader import load_hf_checkpoint
from model.vision_loader import load_vision_tower
from serving.config.engine_config import EngineConfig
from serving.engine.engine import Engine
from serving.gateway.app import GatewayLimits, ServedModel, create_app
from serving.gateway.http.errors import OpenAIError
from serving.gateway.http.limits import MediaLimits
from serving.gateway.media.image_input import load_image
from serving.gateway.services.gateway_services import GatewayServices
from serving.loading.model_registry import hf_tokenizer, serve_chat_template
from serving.runtime.engine_loop import EngineLoop
from model.chat_template_source import load_checkpoint_chat_template
from tests.support import hf_dir_fixtures as hfx
from tests.support.gateway_harness import assert_openai_error
from tests.support.hf_tiny_parity import DATA

MODEL = "tiny-gemma3-vision"
IMAGES = DATA / "gemma3_vision"


def data_url(path_or_bytes, mime="image/png") -> str:
    raw = path_or_bytes if isinstance(path_or_bytes, bytes) else path_or_bytes.read_bytes()
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def png_bytes(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(w * h)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def chat(*parts, max_tokens=3) -> dict:
    content = [p if isinstance(p, dict) else {"type": "image_url", "image_url": {"url": p}} for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


pytestmark = pytest.mark.anyio

TEXT = {"type": "text", "text": "What is this?"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = hfx.gemma3_vision_dir(tmp_path_factory.mktemp("vision") / MODEL)
    cfg, params = load_hf_checkpoint(d, progress=False)
    engine = Engine(build_model(cfg, params=params, dtype=jnp.float32),
                    EngineConfig(max_slots=4, num_pages=64, max_model_len=128, page_size=8, prefill_chunk=32,
                                 min_decode_batch=4, kv_dtype="float32"),
                    vision=load_vision_tower(d))
    loop = EngineLoop(engine)
    loop.start(warmup=False)
    tok = serve_chat_template(hf_tokenizer(d, 256), None, load_checkpoint_chat_template(d))
    yield loop, tok
    loop.stop()


@pytest.fixture
def app_services(served, tmp_path):
    loop, tok = served
    prices = tmp_path / "prices.yaml"
    prices.write_text(json.dumps({"models": {MODEL: {"input": 1.0, "output": 2.0, "per_image": 0.01}}}))
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
                                           prices_path=str(prices))
    limits = GatewayLimits(media=MediaLimits(max_image_bytes=20_000, max_image_pixels=200 * 200, max_images=2))
    app = create_app({MODEL: ServedModel(MODEL, loop, tok, loop.max_model_len,
                                         kv_capacity_tokens=loop.kv_capacity_tokens)}, services, limits)
    yield app, services
    services.close()


async def test_a_data_url_image_is_answered_counted_and_priced(app_services, served):
    app, services = app_services
    loop, tok = served
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=chat(TEXT, data_url(IMAGES / "image_a.png")))
        assert r.status_code == 200, r.text
        text_only = await c.post("/v1/chat/completions", json=chat(TEXT))
    usage = r.json()["usage"]
    # the template's ids, "<start_of_image>" expanded to "\n\n" boi + 16 soft tokens + eoi "\n\n"
    template_ids = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image"}]}])
    assert usage["prompt_tokens"] == len(template_ids) - 1 + 2 + 1 + 16 + 1 + 2
    assert text_only.json()["usage"]["prompt_tokens"] == len(tok.apply_chat_template(
        [{"role": "user", "content": "What is this?"}]))
    rows = {row["request_id"]: row for row in services.ledger.rows()}
    row = rows[r.json()["id"]]
    trace = json.loads(row["trace"])
    assert trace["images"] == 1
    assert any(e["event"] == "images" and e["count"] == 1 and e["soft_tokens"] == 16 for e in trace["events"])
    want = (usage["prompt_tokens"] * 1.0 + usage["completion_tokens"] * 2.0) / 1e6 + 0.01
    assert row["cost_usd"] == pytest.approx(want)
    assert json.loads(rows[text_only.json()["id"]]["trace"])["images"] == 0


async def test_bad_images_get_400_naming_the_part_and_disturb_nothing_else(app_services):
    app, _ = app_services
    good = chat(TEXT, data_url(IMAGES / "image_b.png"), max_tokens=6)
    bad = {
        "broken": (chat(TEXT, data_url(b"\x89PNG\r\n\x1a\nnot really a png")), "invalid_image"),
        "mime": (chat(TEXT, data_url(IMAGES / "image_a.png", "text/plain")), "invalid_image_type"),
        "declared": (chat(TEXT, data_url(IMAGES / "image_a.png", "image/jpeg")), "invalid_image"),
        "bytes": (chat(TEXT, data_url(png_bytes(150, 150))), "image_too_large"),
        "pixels": (chat(TEXT, data_url(_big_flat_png())), "image_too_large"),
        "url": (chat(TEXT, "https://example.com/cat.png"), "image_url_not_allowed"),
        "scheme": (chat(TEXT, "file:///etc/passwd"), "invalid_image_url"),
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
        alone = (await c.post("/v1/chat/completions", json=good)).json()["choices"][0]["message"]["content"]
        results = await asyncio.gather(c.post("/v1/chat/completions", json=good),
                                       *(c.post("/v1/chat/completions", json=b) for b, _ in bad.values()))
        three = await c.post("/v1/chat/completions", json=chat(TEXT, data_url(IMAGES / "image_a.png"),
                                                               data_url(IMAGES / "image_a.png"),
                                                               data_url(IMAGES / "image_b.png")))
        no_url = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": [TEXT, {"type": "image_url", "image_url": {}}]}]})
    assert results[0].status_code == 200
    assert results[0].json()["choices"][0]["message"]["content"] == alone
    for (name, (_, code)), r in zip(bad.items(), results[1:]):
        err = assert_openai_error(r, 400, param="messages[0].content[1]", code=code)
        assert err["type"] == "invalid_request_error", name
    assert_openai_error(three, 400, param="messages", code="too_many_images")
    assert_openai_error(no_url, 400)


async def test_responses_api_input_image(app_services):
    app, _ = app_services

    def body(url):
        return {"model": MODEL, "max_output_tokens": 3, "temperature": 0, "store": False, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": url}]}]}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
        ok = await c.post("/v1/responses", json=body(data_url(IMAGES / "image_a.png")))
        chat_ok = await c.post("/v1/chat/completions", json=chat(TEXT, data_url(IMAGES / "image_a.png")))
        bad = await c.post("/v1/responses", json={**body(data_url(b"nope")), "instructions": "Be brief."})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["input_tokens"] == chat_ok.json()["usage"]["prompt_tokens"]
    err = assert_openai_error(bad, 400, param="input[0].content[1]", code="invalid_image")
    assert err["message"].startswith("input[0].content[1]: ")


async def test_anthropic_image_blocks_base64_and_a_fetched_url(served, tmp_path, monkeypatch):
    """Messages API image blocks reach the model as chat's parts do: a base64 source and a URL
    source (fetched from an allowed host; here a loopback server, the public-address check
    lifted for it) give the chat request's prompt, its prefix-cache pages and its answer."""
    import http.server
    import threading

    from serving.gateway.media import image_input

    loop, tok = served
    png = (IMAGES / "image_a.png").read_bytes()
    hosts = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hosts.append((self.headers["Host"], self.path))
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def resolve(host, port):
        return ["127.0.0.1"]

    monkeypatch.setattr(image_input, "resolve_host", resolve)
    monkeypatch.setattr(image_input, "is_public_address", lambda address: True)
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    app = create_app({MODEL: ServedModel(MODEL, loop, tok, loop.max_model_len,
                                         kv_capacity_tokens=loop.kv_capacity_tokens)}, services,
                     GatewayLimits(media=MediaLimits(allowed_media_domains=("img.test",))))
    url = f"http://img.test:{httpd.server_address[1]}/a.png"
    sources = [{"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()},
               {"type": "url", "url": url}]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            want = (await c.post("/v1/chat/completions", json=chat(TEXT, data_url(png), max_tokens=4))).json()
            got = []
            for source in sources:
                r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                       "messages": [{"role": "user", "content": [
                                                           TEXT, {"type": "image", "source": source}]}]})
                assert r.status_code == 200, r.text
                got.append(r.json())
    finally:
        httpd.shutdown()
        services.close()
    assert hosts == [(url.removeprefix("http://").removesuffix("/a.png"), "/a.png")]  # fetched once, by name
    prompt, answer = want["usage"]["prompt_tokens"], want["choices"][0]["message"]["content"]
    for m in got:
        u = m["usage"]
        # the chat's token ids and image digest: every full page read from the prefix cache
        assert (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]) == (
            prompt, (prompt - 1) // 8 * 8)
        assert u["output_tokens"] == want["usage"]["completion_tokens"] == 4 and m["stop_reason"] == "max_tokens"
        assert "".join(b["text"] for b in m["content"]) == (answer if answer.strip() else "")


def _big_flat_png() -> bytes:
    """A 500 x 500 single-colour PNG: few bytes (under max_image_bytes), too many pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (500, 500), (10, 20, 30)).save(buf, "PNG")
    return buf.getvalue()


async def test_a_text_only_model_refuses_images():
    from tests.support.gateway_fakes import FakeEngine
    from tests.support.gateway_harness import MODEL as TEXT_MODEL, client_for, make_app

    async with client_for(make_app(FakeEngine())) as c:
        body = chat(TEXT, data_url(IMAGES / "image_a.png"))
        body["model"] = TEXT_MODEL
        r = await c.post("/v1/chat/completions", json=body)
    assert_openai_error(r, 400, param="messages[0].content[1]", code="images_not_supported")


async def test_remote_urls_are_fetched_only_from_allowed_hosts_with_a_size_cap():
    png = (IMAGES / "image_a.png").read_bytes()
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:  # sees the checked address, the name as Host
        assert request.url.host == "93.184.215.14"
        seen.append(f"{request.url.scheme}://{request.headers['host']}{request.url.path}")
        if request.url.path == "/big.png":
            return httpx.Response(200, content=b"x" * 50_000, headers={"content-type": "image/png"})
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"location": "https://elsewhere.test/a.png"})
        return httpx.Response(200, content=png, headers={"content-type": "image/png"})

    limits = MediaLimits(max_image_bytes=20_000, allowed_media_domains=("img.test", "*.cdn.test"))
    async def resolve(host, port):  # every test host is a public address
        return ["93.184.215.14"]

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        im = await load_image("https://img.test/a.png", limits, "p", client, resolve=resolve)
        assert im.size == (70, 40)
        im = await load_image("https://eu.cdn.test/a.png", limits, "p", client, resolve=resolve)
        for url, code in (("https://other.test/a.png", "image_url_not_allowed"),
                          ("https://cdn.test.evil/a.png", "image_url_not_allowed"),
                          ("https://img.test/big.png", "image_too_large"),
                          ("https://img.test/moved.png", "image_fetch_failed")):
            with pytest.raises(OpenAIError) as e:
                await load_image(url, limits, "messages[0].content[1]", client, resolve=resolve)
            assert e.value.code == code and e.value.param == "messages[0].content[1]", url
    assert seen == ["https://img.test/a.png", "https://eu.cdn.test/a.png", "https://img.test/big.png",
                    "https://img.test/moved.png"]  # refused hosts were never asked
