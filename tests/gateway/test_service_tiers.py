"""``service_tier`` through the gateway: the tier served echoed (bodies, every stream chunk,
the Responses API), the engine class it runs in, 400 for an unknown tier, the key and tenant
allow-lists (403), flex shed under load (429 ``resource_unavailable``, a "shed" ledger row
that costs nothing), the ledger's ``service_tier`` and the tier's price multiplier, and an
older database file gaining the new columns.

Uses the scripted fake engine (no JAX) and a SQLite file per test.
"""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa

from serving.contract.engine_client import EngineStats
from serving.gateway.accounts import database
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.service_tiers import FlexAdmission
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error, parse_sse

pytestmark = pytest.mark.anyio
MODEL = "tiny"
PRICES = """
batch_discount: 0.5
service_tiers: {default: 1.0, flex: 0.5, priority: 2.0}
models:
  tiny: {input: 1000000.0, cached_input: 0.0, output: 1000000.0}
"""  # $1 a token: a request's cost is its token count times the multiplier


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def gateway(tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                           prices_path=str(prices))
    services.flex_admission = FlexAdmission(max_waiting=2, max_kv_usage=0.8)
    engine = FakeEngine(text="Hello")
    app = create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 512)}, services)
    yield services, engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                              base_url="http://testserver")
    services.close()


def rows(services: GatewayServices) -> list[dict]:
    services.ledger.flush()
    with services.ledger.engine.connect() as conn:
        return [dict(r) for r in conn.execute(
            sa.select(database.requests).order_by(database.requests.c.created_at)).mappings()]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}


@pytest.mark.parametrize("asked, served, engine_class", [
    (None, "default", "interactive"), ("auto", "default", "interactive"), ("default", "default", "interactive"),
    ("flex", "flex", "batch"), ("priority", "priority", "priority")])
async def test_the_tier_served_is_echoed_and_picks_the_engine_class(gateway, asked, served, engine_class):
    services, engine, client = gateway
    extra = {} if asked is None else {"service_tier": asked}
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(**extra))
        assert r.status_code == 200, r.text
        assert r.json()["service_tier"] == served
        r = await client.post("/v1/chat/completions", json=chat(**extra, stream=True,
                                                                stream_options={"include_usage": True}))
        chunks = [c for c in parse_sse(r.text) if c != "[DONE]"]
        assert len(chunks) > 2 and all(c["service_tier"] == served for c in chunks)
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **extra})
        assert r.json()["service_tier"] == served
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True, **extra})
        assert all(c["service_tier"] == served for c in parse_sse(r.text) if c != "[DONE]")
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
        assert r.status_code == 200, r.text
        assert r.json()["service_tier"] == served
    assert {e.priority for e in engine.submitted} == {engine_class}
    ledger = rows(services)
    assert len(ledger) == 5 and {row["service_tier"] for row in ledger} == {served}


async def test_priority_batch_is_flex_work_never_shed(gateway):
    services, engine, client = gateway
    engine.load = EngineStats(num_waiting=50, kv_cache_usage=1.0)  # flex would be shed
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(priority="batch"))
        assert r.status_code == 200 and r.json()["service_tier"] == "flex"
        err = assert_openai_error(await client.post("/v1/chat/completions",
                                                    json=chat(priority="batch", service_tier="priority")),
                                  400, param="service_tier")
        assert "batch" in err["message"]
    assert engine.submitted[0].priority == "batch"
    row = rows(services)[0]
    assert (row["priority"], row["service_tier"]) == ("batch", "flex")
    tokens = row["prompt_tokens"] + row["completion_tokens"]
    assert row["cost_usd"] == pytest.approx(tokens * 0.5)  # the batch discount, not also flex's


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(service_tier="scale")),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "service_tier": "fast"}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "service_tier": 1})])
async def test_an_unknown_tier_is_a_400(gateway, path, body):
    _, engine, client = gateway
    async with client:
        assert_openai_error(await client.post(path, json=body), 400, param="service_tier")
    assert engine.submitted == []


async def test_key_and_tenant_allow_lists(gateway):
    services, engine, client = gateway
    store = services.authenticator.key_store
    store.set_tenant("acme", service_tiers=["default", "flex"])
    both, _ = store.create_key("acme")
    flex_only, _ = store.create_key("acme", service_tiers=["flex", "priority"])
    store.set_tenant("other", service_tiers=["priority"])
    prio, _ = store.create_key("other")

    async def ask(key: str, tier: str | None) -> httpx.Response:
        extra = {} if tier is None else {"service_tier": tier}
        return await client.post("/v1/chat/completions", json=chat(**extra),
                                 headers={"Authorization": f"Bearer {key}"})

    async with client:
        assert (await ask(both, "flex")).json()["service_tier"] == "flex"
        err = assert_openai_error(await ask(both, "priority"), 403, param="service_tier",
                                  code="service_tier_not_allowed")
        assert "default, flex" in err["message"]
        assert (await ask(flex_only, None)).json()["service_tier"] == "flex"  # auto: the first allowed
        assert_openai_error(await ask(flex_only, "priority"), 403, code="service_tier_not_allowed")  # tenant's
        assert_openai_error(await ask(flex_only, "default"), 403, code="service_tier_not_allowed")  # key's
        assert (await ask(prio, "auto")).json()["service_tier"] == "priority"
    assert len(engine.submitted) == 3
    with pytest.raises(ValueError, match="service tiers"):
        store.create_key("acme", service_tiers=["scale"])


async def test_flex_is_shed_under_load_and_not_billed(gateway):
    services, engine, client = gateway
    async with client:
        for load, shed in [(EngineStats(num_waiting=3), True), (EngineStats(kv_cache_usage=0.85), True),
                           (EngineStats(num_waiting=2, kv_cache_usage=0.8), False)]:
            engine.load = load
            r = await client.post("/v1/chat/completions", json=chat(service_tier="flex", stream=True))
            if shed:
                err = assert_openai_error(r, 429, param="service_tier", code="resource_unavailable")
                assert err["type"] == "resource_unavailable" and r.headers["Retry-After"] == "1"
            else:
                assert r.status_code == 200
        engine.load = EngineStats(num_waiting=50)  # default and priority are not shed
        for tier in ("default", "priority"):
            assert (await client.post("/v1/chat/completions", json=chat(service_tier=tier))).status_code == 200
        metrics = (await client.get("/metrics")).text
        usage = (await client.get("/v1/usage", params={"group_by": "service_tier"})).json()
    assert 'xlaserve:requests_total{model_name="tiny",status="shed"} 2.0' in metrics
    by_tier = {g["group"]: g for g in usage["data"]}
    assert {t: g["requests"] for t, g in by_tier.items()} == {"default": 1, "flex": 3, "priority": 1}
    assert len(engine.submitted) == 3
    ledger = rows(services)
    assert [r["status"] for r in ledger] == ["shed", "shed", "ok", "ok", "ok"]
    for row in ledger[:2]:
        assert (row["service_tier"], row["cost_usd"], row["prompt_tokens"], row["completion_tokens"]) == (
            "flex", 0.0, 0, 0)
        assert "requests wait" in row["error"] or "KV cache" in row["error"]
    for row, multiplier in zip(ledger[2:], (0.5, 1.0, 2.0)):  # flex, default, priority
        tokens = row["prompt_tokens"] + row["completion_tokens"]
        assert tokens > 0 and row["cost_usd"] == pytest.approx(tokens * multiplier)


async def test_the_trace_records_the_tier(gateway):
    _, _, client = gateway
    async with client:
        r = await client.post("/v1/chat/completions", json=chat(service_tier="priority"),
                              headers={"X-Request-ID": "tier-trace"})
        trace = (await client.get(f"/v1/requests/{r.json()['id']}")).json()
    assert trace["service_tier"] == "priority"


def test_an_older_database_gains_the_new_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = sa.MetaData()
    for table in (database.tenants, database.api_keys, database.requests, database.files,
                  database.batches):  # as shipped before
        sa.Table(table.name, old, *(sa.Column(c.name, c.type, primary_key=c.primary_key, nullable=c.nullable)
                                    for c in table.columns if (table.name, c.name) not in database.ADDED_COLUMNS))
    engine = sa.create_engine(url)
    old.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenants (name, created_at) VALUES ('acme', 1.0)"))
    engine.dispose()
    db = database.open_database(url)
    columns = {t: {c["name"] for c in sa.inspect(db).get_columns(t)}
               for t in ("tenants", "api_keys", "requests", "files", "batches")}
    assert all(c in columns[t] for t, c in database.ADDED_COLUMNS)
    assert database.add_missing_columns(db) == []  # idempotent
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT service_tiers FROM tenants")).scalar() is None  # old rows: NULL


def test_the_admin_cli_sets_tier_allow_lists(tmp_path, capsys):
    from serving.cli.main import main
    from serving.gateway.accounts.api_keys import KeyStore

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["tenants", "set", "acme", "--service-tiers", "default,flex", "--database-url", url]) == 0
    assert main(["keys", "create", "--tenant", "acme", "--service-tiers", "flex", "--database-url", url]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["tenants", "list", "--database-url", url]) == 0
    assert '["default", "flex"]' in capsys.readouterr().out
    status, principal = KeyStore(database.open_database(url)).lookup(key)
    assert status == "ok" and principal.service_tiers == {"flex"}
