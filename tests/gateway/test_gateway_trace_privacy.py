"""What a request's trace and error tell whom: a trace's ``retries`` counts only the same
tenant's earlier requests with its X-Request-ID (another tenant's ids are neither its retries
nor its business), and an engine failure's detail goes to the trace, not to the client."""

from __future__ import annotations

import httpx
import pytest

from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

pytestmark = pytest.mark.anyio
MODEL = "fake"


async def test_retries_count_the_same_tenant_and_engine_detail_stays_in_the_trace(tmp_path):
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                           ledger_spool_dir=str(tmp_path / "spool"))
    engine = FakeEngine(text="ok")
    app = create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 512, created=1)}, services)
    store = services.authenticator.key_store
    keys = {t: {"Authorization": f"Bearer {store.create_key(t)[0]}"} for t in ("acme", "globex")}
    body = {"model": MODEL, "prompt": "hi"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for _ in range(2):  # acme's request and its retry
                r = await client.post("/v1/completions", json=body, headers={**keys["acme"], "X-Request-ID": "same"})
                assert r.status_code == 200
            engine.fail_after = 1
            r = await client.post("/v1/completions", json=body, headers={**keys["globex"], "X-Request-ID": "same"})
            err = assert_openai_error(r, 500, code="engine_error")
            assert "device fell over" not in err["message"] and "same" in err["message"]
            services.ledger.flush()
            globex = (await client.get("/v1/requests/same", headers=keys["globex"])).json()
            acme = (await client.get("/v1/requests/same", headers=keys["acme"])).json()
    finally:
        services.close()
    assert (globex["tenant"], globex["retries"], globex["status"]) == ("globex", 0, "error")
    assert "device fell over" in globex["error"]
    assert (acme["tenant"], acme["retries"]) == ("acme", 1)
