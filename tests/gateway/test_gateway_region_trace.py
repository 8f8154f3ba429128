"""A request's region, its hops away from failing replicas and its cost, in its ledger trace
(``GET /v1/requests/{id}``) and its span: the gateway in-process over the router and stand-in
replicas of two regions (no gRPC, no engine), a SQLite ledger."""

from __future__ import annotations

import httpx
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.tracing import RequestTracer
from serving.routing.router import Router
from tests.support.gateway_fakes import FakeTokenizer
from tests.support.router_fakes import FakeReplica

pytestmark = pytest.mark.anyio
MODEL = "tiny-random"  # priced in configs/prices.yaml: its rows have a cost


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_a_failover_across_regions_is_in_the_trace_and_the_span(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    services.metering.tracer = RequestTracer(True, provider)
    east, west = FakeReplica("east1", region="east"), FakeReplica("west1", region="west")
    router = Router([east, west], policy="round-robin", region="east")
    app = create_app({MODEL: ServedModel(MODEL, router, FakeTokenizer(), 512, created=1)}, services)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
            async def complete(rid):
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                 headers={"X-Request-ID": rid})
                assert r.status_code == 200, r.text
                t = await c.get(f"/v1/requests/{rid}")
                return t.json()

            home = await complete("home-1")
            east.fail_before_first = True  # it dies: the stream fails before any event
            away = await complete("away-1")
    finally:
        services.close()
    assert (home["replica"], home["region"], home["replica_retries"]) == (east.url, "east", [])
    assert (away["replica"], away["region"]) == (west.url, "west")
    [hop] = away["replica_retries"]
    assert (hop["replica"], hop["region"], hop["reason"]) == (east.url, "east", "unavailable")
    assert away["retries"] == 0  # client retries (same X-Request-ID) are another thing
    assert away["cost_usd"] > 0 and away["usage"]["completion_tokens"] == 2
    span = next(s for s in exporter.get_finished_spans()
                if s.name == "gateway" and s.attributes["xlaserve.x_request_id"] == "away-1")
    assert span.attributes["xlaserve.region"] == "west"
    assert span.attributes["xlaserve.replica_retries"] == 1
    assert tuple(span.attributes["xlaserve.replica_retries.replicas"]) == (east.url,)
    assert tuple(span.attributes["xlaserve.replica_retries.reasons"]) == ("unavailable",)
    assert span.attributes["xlaserve.cost_usd"] == pytest.approx(away["cost_usd"])
    assert router.decisions[(west.url, "cross_region_down")] == 1
