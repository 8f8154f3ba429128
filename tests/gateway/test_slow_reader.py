"""A client that stops reading its stream, on the real engine loop (tiny-random model).

Its events wait in a bounded buffer (the engine loop's ``max_queued_events``);
past the bound, or when a write to the client does not complete within the
stream write timeout, the engine request is cancelled, its KV pages freed and
its ledger row completed. Other requests keep running meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from serving.gateway.app import GatewayLimits, ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.engine_helpers import collect, request
from tests.support.tiny_engine import all_pages_free, make_loop, prompt

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def loop(jax_cache):
    loop = make_loop()  # the usual tiny shapes (tests/support/tiny_engine.py): compiled programs are cached
    loop.start(warmup=False)
    yield loop
    loop.stop()


@pytest.fixture
def delivered(loop):
    """Per request id, the engine events handed to its consumer's buffer and the
    buffer's largest size (the loop's ``_deliver`` wrapped)."""
    seen: dict[str, dict] = {}
    deliver = loop._deliver

    def probe(seq, ev):
        deliver(seq, ev)
        rec = seen.setdefault(seq.req.request_id, {"events": [], "peak": 0})
        rec["events"].append(ev)
        rec["peak"] = max(rec["peak"], seq.events.qsize())

    loop._deliver = probe
    yield seen
    del loop._deliver


async def wait_until(condition, poll_s: float = 0.01) -> None:
    while not condition():
        await asyncio.sleep(poll_s)


def test_a_consumer_that_stops_reading_is_cancelled_at_the_buffer_bound(loop):
    # The bound is above the other request's whole stream (20 tokens: at most 21 events), so
    # only the stalled consumer can reach it: with a bound of 8 the reading consumer was itself
    # cancelled once in a full suite run, its event loop 7 tiny-model steps behind the engine.
    loop.max_queued_events = 24
    stalled = request(prompt(8), max_tokens=200, ignore_eos=True)

    async def main():
        events = loop.submit(stalled)
        first = await anext(events)  # ... and then it stops reading
        # Meanwhile another request runs to its end.
        other, _ = await collect(loop, request(prompt(6, 1), max_tokens=20, ignore_eos=True))
        await asyncio.wait_for(wait_until(lambda: all_pages_free(loop)), 60)
        return first, [ev async for ev in events], other

    try:
        first, rest, other = asyncio.run(main())
    finally:
        loop.max_queued_events = 1024
    assert len(other) == 20
    # Nothing was read from the buffer after `first` and nothing reaches it after the final
    # event, so what is read now is the most it ever held: the bound, final event included.
    assert len(rest) <= 24
    assert rest[-1].finish_reason == "cancelled" and "stopped reading" in rest[-1].error
    assert rest[-1].completion_tokens < 200  # cancelled, not run to its end
    assert sum(len(ev.token_ids) for ev in [first, *rest]) < 200


async def _asgi_chat(app, body: dict, send, rid: str) -> None:
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver"),
                    (b"x-request-id", rid.encode())],
        "client": ("127.0.0.1", 1234), "server": ("testserver", 80),
    }
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected

    await asyncio.wait_for(app(scope, receive, send), 60)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stalled_stream_is_cancelled_after_the_write_timeout_and_metered(
        loop, delivered, tiny_tokenizer, tmp_path, anyio_backend):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'ledger.db'}")
    app = create_app({MODEL: ServedModel(MODEL, loop, tiny_tokenizer, loop.max_model_len)}, services,
                     GatewayLimits(stream_write_timeout=0.2))
    # The client takes the headers and the first text chunk, then reads nothing more. While its
    # next write hangs, the engine is held (on_step), so only the write timeout can end the request.
    frozen, thaw = threading.Event(), threading.Event()
    loop.on_step = lambda plan: thaw.wait(60) if frozen.is_set() else None
    bodies: list[bytes] = []

    async def send(message):
        if message["type"] != "http.response.body":
            return
        if any(b'"content":"' in b and b'"content":""' not in b for b in bodies):
            frozen.set()
            await asyncio.Event().wait()  # never accepted
        bodies.append(message["body"])

    try:
        await _asgi_chat(app, {"model": MODEL, "stream": True, "max_tokens": 200, "ignore_eos": True,
                               "seed": 0, "messages": [{"role": "user", "content": "hello"}]},
                         send, "stalled-1")
    finally:
        thaw.set()
        loop.on_step = None
    await wait_until(lambda: all_pages_free(loop))
    try:
        row = services.ledger.get("stalled-1")
    finally:
        services.close()
    assert row["status"] == "cancelled"
    assert row["error"] == "client not reading: stream write timed out after 0.2 s"
    assert row["finished_at"] is not None and row["e2e_s"] is not None
    assert row["prompt_tokens"] > 0 and 1 <= row["completion_tokens"] < 200
    (rec,) = [r for rid, r in delivered.items() if rid.startswith("chatcmpl-")]
    assert rec["events"][-1].finish_reason == "cancelled"  # the engine stopped it early
    assert rec["events"][-1].error is None  # by the gateway's cancel, not the buffer bound
    assert rec["peak"] <= loop.max_queued_events
    assert not any(b"[DONE]" in b for b in bodies)
