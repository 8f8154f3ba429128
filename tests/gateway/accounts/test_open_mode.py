"""An open gateway (no API keys) is not an admin gateway: its anonymous callers load no LoRA
adapters and read no other tenant's usage or traces, and a gateway that must not run open
(``require_keys``: a non-loopback address without ``--allow-unauthenticated``) refuses callers
with 503 when its keys are all deleted while it runs, instead of turning open."""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa

from serving.gateway.accounts.database import api_keys
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

pytestmark = pytest.mark.anyio
MODEL = "fake"


@pytest.fixture
def services(tmp_path):
    s = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                    ledger_spool_dir=str(tmp_path / "spool"))
    yield s
    s.close()


def _client(services, **kw) -> httpx.AsyncClient:
    app = create_app({MODEL: ServedModel(MODEL, FakeEngine(text="ok"), FakeTokenizer(), 512, created=1)},
                     services, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def test_anonymous_callers_of_an_open_gateway_are_not_admins(services, tmp_path):
    (tmp_path / "adapters" / "a").mkdir(parents=True)
    async with _client(services, lora_root=tmp_path / "adapters") as client:
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})).status_code == 200
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert_openai_error(await client.post(path, json={"lora_name": "a", "lora_path": "a"}), 403,
                                code="forbidden")
        assert_openai_error(await client.get("/v1/usage?tenant=acme"), 403, code="forbidden")
        r = await client.get("/v1/usage?group_by=tenant")
        assert r.status_code == 200 and r.json()["tenant"] == "anonymous"


async def test_a_gateway_that_needs_keys_refuses_callers_once_they_are_all_deleted(services):
    store = services.authenticator.key_store
    key, _ = store.create_key("acme")
    services.authenticator.require_keys = True
    async with _client(services) as client:
        body = {"model": MODEL, "prompt": "hi"}
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        with store.engine.begin() as conn:
            conn.execute(sa.delete(api_keys))
        services.authenticator._has_keys = (-1e9, None)  # past the look-up's 1 s cache, without a wait
        for headers in ({}, {"Authorization": f"Bearer {key}"}):
            assert_openai_error(await client.post("/v1/completions", json=body, headers=headers), 503,
                                code="no_api_keys")
