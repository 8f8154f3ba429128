"""The console's routes in process (gateway over a fake engine, a SQLite ledger): who may open
them, the overview's numbers against the ledger's, the request list's pages, keys and tenants
through KeyStore with their audit trail. The browser drives the same routes in
tests/e2e/test_console_browser.py."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import sqlalchemy as sa

from serving.gateway.accounts.database import metadata
from serving.gateway.app import ServedModel, create_app
from serving.gateway.console.console_auth import COOKIE
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.console_ledger import fill_ledger, sums
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import assert_openai_error

MODEL = "tiny-random"
pytestmark = pytest.mark.anyio


POSTGRES_URL = os.environ.get("XLASERVE_TEST_DATABASE_URL")


@pytest.fixture(params=["sqlite"] + (["postgresql"] if POSTGRES_URL else []))
def services(request, tmp_path):
    """The services over a SQLite file, and over ``XLASERVE_TEST_DATABASE_URL``'s PostgreSQL
    (its tables dropped first) when that is set (``.ci/run`` sets it)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    if request.param == "postgresql":
        url = POSTGRES_URL
        engine = sa.create_engine(url)
        metadata.drop_all(engine)
        engine.dispose()
    s = GatewayServices.open_server(database_url=url, ledger_spool_dir=str(tmp_path / "spool"))
    yield s
    s.close()


@pytest.fixture
def keys(services):
    store = services.authenticator.key_store
    admin, admin_info = store.create_key("ops", is_admin=True)
    user, _ = store.create_key("acme")
    return {"admin": admin, "admin_id": admin_info.key_id, "user": user}


@pytest.fixture
async def client(services, keys):
    app = create_app({MODEL: ServedModel(MODEL, FakeEngine(text="Hello world"), FakeTokenizer(), 512, created=1)},
                     services)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        c.app = app
        yield c


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def console_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every console route but login and logout, path parameters filled."""
    out = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if not path.startswith("/console") or path in ("/console/login", "/console/logout"):
            continue
        path = path.replace("{request_id}", "x").replace("{key_id}", "key_x").replace("{name}", "t")
        for method in route.methods - {"HEAD"}:
            out.append((method, path.replace("/static/t", "/static/console.css")))
    return sorted(out)


async def test_every_console_route_needs_an_admin_key(client, keys):
    routes = console_routes(client.app)
    assert len(routes) >= 15 and ("GET", "/console") in routes and ("POST", "/console/api/keys") in routes
    for method, path in routes:
        r = await client.request(method, path)
        assert r.status_code == 401, (method, path)
        r = await client.request(method, path, headers=bearer(keys["user"]))
        assert r.status_code == 403, (method, path)
        if path.startswith("/console/api") or path.startswith("/console/static"):
            assert_openai_error(r, 403, code="admin_key_required")
        else:  # a page: the login form, saying why
            assert "admin API key" in r.text and 'id="login"' in r.text
    r = await client.get("/console/api/overview", headers=bearer("xls-not-a-key"))
    assert_openai_error(r, 401, code="invalid_api_key")


async def test_login_sets_a_cookie_that_opens_the_pages(client, keys):
    r = await client.post("/console/login", json={"key": keys["user"]})
    assert_openai_error(r, 403, code="admin_key_required")
    assert COOKIE not in r.cookies
    r = await client.post("/console/login", json={"key": keys["admin"]})
    assert r.status_code == 200 and r.json()["key_id"] == keys["admin_id"]
    set_cookie = r.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie and "Path=/console" in set_cookie
    for path in ("/console", "/console/requests", "/console/keys", "/console/playground", "/console/requests/x"):
        r = await client.get(path)  # the client keeps the cookie
        assert r.status_code == 200 and "<nav>" in r.text, path
    r = await client.get("/console/static/console.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert (await client.get("/console/static/nothing.js")).status_code == 404
    await client.post("/console/logout")
    assert (await client.get("/console")).status_code == 401


async def test_overview_sums_equal_the_ledgers(client, keys, services):
    now = time.time()
    rows = fill_ledger(services.ledger, now)
    expected = sums(rows)
    for by in ("model", "tenant", "key", "service_tier"):
        r = await client.get("/console/api/overview", params={"by": by, "end": now}, headers=bearer(keys["admin"]))
        body = r.json()
        assert r.status_code == 200 and len(body["buckets"]) == 60 and body["step"] == 60
        assert body["totals"]["requests"] == expected["requests"]
        assert body["totals"]["prompt_tokens"] == expected["prompt_tokens"]
        assert body["totals"]["completion_tokens"] == expected["completion_tokens"]
        assert body["totals"]["errors"] == expected["errors"]
        assert body["totals"]["cost_usd"] == pytest.approx(expected["cost_usd"])
        column = {"model": "model", "tenant": "tenant", "key": "key_id", "service_tier": "service_tier"}[by]
        per_group = {g: sum(v) for g, v in body["series"]["requests"].items()}
        assert per_group == {g: sum(r[column] == g for r in rows) for g in {r[column] for r in rows}}
    # Each row lands in the bucket holding its created_at; the percentiles are of those rows.
    starts = body["buckets"]
    i = max(j for j, s in enumerate(starts) if s <= rows[0]["created_at"])
    assert sum(v[i] for v in body["series"]["requests"].values()) == sum(
        starts[i] <= r["created_at"] < starts[i] + 60 for r in rows)
    in_bucket = sorted(r["ttft_s"] for r in rows if starts[i] <= r["created_at"] < starts[i] + 60)
    assert body["latency"]["ttft_p99"][i] == pytest.approx(in_bucket[-1])
    assert body["latency"]["samples"] == len(rows)
    assert set(body["engines"]) == {MODEL}
    r = await client.get("/console/api/overview", params={"step": "hour", "buckets": 2, "end": now},
                         headers=bearer(keys["admin"]))
    assert r.json()["totals"]["requests"] == len(rows) and len(r.json()["buckets"]) == 2


async def test_the_current_windows_overview_is_reused_for_a_few_seconds(client, keys, services):
    fill_ledger(services.ledger, time.time(), n=3)
    first = (await client.get("/console/api/overview", headers=bearer(keys["admin"]))).json()
    assert first["totals"]["requests"] == 3
    fill_ledger(services.ledger, time.time(), n=4)  # 4 more (their ids overlap: 1 new row)
    again = (await client.get("/console/api/overview", headers=bearer(keys["admin"]))).json()
    assert again["computed_at"] == first["computed_at"] and again["totals"] == first["totals"]
    fresh = (await client.get("/console/api/overview", params={"end": time.time()}, headers=bearer(keys["admin"]))).json()
    assert fresh["totals"]["requests"] == 4
    other = (await client.get("/console/api/overview", params={"by": "tenant"}, headers=bearer(keys["admin"]))).json()
    assert other["totals"]["requests"] == 4 and other["computed_at"] > first["computed_at"]


@pytest.mark.parametrize("params, param", [({"step": "week"}, "step"), ({"by": "colour"}, "by"),
                                           ({"buckets": 501}, "buckets"), ({"buckets": 0}, "buckets"),
                                           ({"end": "nan"}, "end"), ({"end": "inf"}, "end")])
async def test_overview_refuses_bad_parameters(client, keys, params, param):
    r = await client.get("/console/api/overview", params=params, headers=bearer(keys["admin"]))
    err = assert_openai_error(r, 400)
    assert param in (err["param"] or "") + err["message"]


async def test_request_list_pages_through_every_row_once_newest_first(client, keys, services):
    rows = fill_ledger(services.ledger, time.time(), n=7)
    seen, after = [], None
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        body = (await client.get("/console/api/requests", params=params, headers=bearer(keys["admin"]))).json()
        seen += [r["request_id"] for r in body["data"]]
        assert len(body["data"]) <= 3 and "trace" not in (body["data"] or [{}])[0]
        if not body["has_more"]:
            break
        after = body["last_id"]
    assert seen == [r["request_id"] for r in rows]  # filled newest first
    body = (await client.get("/console/api/requests", params={"q": "fill-0003"}, headers=bearer(keys["admin"]))).json()
    assert [r["request_id"] for r in body["data"]] == ["chatcmpl-fill0003"]
    assert body["data"][0]["replica"] == "http://replica-1:9000" and body["data"][0]["region"] == "eu-west"
    body = (await client.get("/console/api/requests", params={"status": "error"}, headers=bearer(keys["admin"]))).json()
    assert [r["request_id"] for r in body["data"]] == [r["request_id"] for r in rows if r["status"] == "error"]
    r = await client.get("/console/api/requests", params={"limit": 201}, headers=bearer(keys["admin"]))
    assert_openai_error(r, 400, param="query.limit")
    r = await client.get("/console/api/requests/chatcmpl-fill0002", headers=bearer(keys["admin"]))
    assert r.json()["object"] == "request.trace" and [e["event"] for e in r.json()["events"]][0] == "admitted"
    r = await client.get("/console/api/requests/nope", headers=bearer(keys["admin"]))
    assert_openai_error(r, 404, code="request_not_found")


async def test_keys_are_created_and_revoked_through_the_key_store_and_audited(client, keys):
    admin = bearer(keys["admin"])
    r = await client.post("/console/api/keys", json={"tenant": "acme", "rpm": 5, "service_tiers": ["default"]},
                          headers=admin)
    assert r.status_code == 201, r.text
    new = r.json()
    assert new["key"].startswith("xls-") and new["rpm"] == 5 and new["service_tiers"] == ["default"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions", json=chat, headers=bearer(new["key"]))).status_code == 200
    r = await client.post("/console/api/keys", json={"tenant": "acme", "service_tiers": ["gold"]}, headers=admin)
    assert_openai_error(r, 400)
    assert "service tiers must be among" in r.json()["error"]["message"]
    r = await client.post("/console/api/keys", json={"tenant": "", "rpm": 0}, headers=admin)
    assert_openai_error(r, 400)
    # Only a JSON body is taken (what a cross-site form cannot send).
    r = await client.post("/console/api/keys", content='{"tenant": "acme"}',
                          headers={**admin, "Content-Type": "text/plain"})
    assert_openai_error(r, 400)
    r = await client.post(f"/console/api/keys/{new['key_id']}/revoke", headers=admin)
    assert r.status_code == 200
    r = await client.post("/v1/chat/completions", json=chat, headers=bearer(new["key"]))
    assert_openai_error(r, 401, code="api_key_revoked")
    r = await client.post(f"/console/api/keys/{new['key_id']}/revoke", headers=admin)
    assert_openai_error(r, 404, code="key_not_found")
    r = await client.put("/console/api/tenants/acme", json={"rpm": 7, "models": [MODEL]}, headers=admin)
    assert r.status_code == 200
    tenants = (await client.get("/console/api/tenants", headers=admin)).json()["data"]
    assert [(t["name"], t["rpm"]) for t in tenants] == [("acme", 7)]
    listed = (await client.get("/console/api/keys", params={"limit": 2}, headers=admin)).json()
    assert [k["key_id"] for k in listed["data"]][0] == new["key_id"] and listed["has_more"]
    assert "key" not in listed["data"][0]
    audit = (await client.get("/console/api/audit", headers=admin)).json()["data"]
    mine = [(a["actor"], a["action"], a["target"]) for a in audit if a["actor"] == keys["admin_id"]]
    assert mine == [(keys["admin_id"], "tenant.set", "acme"), (keys["admin_id"], "key.revoke", new["key_id"]),
                    (keys["admin_id"], "key.create", new["key_id"])]
    created = next(a for a in audit if a["action"] == "key.create" and a["target"] == new["key_id"])
    assert created["details"]["rpm"] == 5 and new["key"] not in str(audit)
    assert {a["actor"] for a in audit} == {keys["admin_id"], "cli"}  # the fixture's keys: KeyStore's default


async def test_a_tenants_storage_quotas_are_set_in_the_console_and_kept_when_unnamed(client, keys):
    admin = bearer(keys["admin"])
    r = await client.put("/console/api/tenants/acme", json={"rpm": 7, "max_files": 3, "max_file_bytes": 1000},
                         headers=admin)
    assert r.status_code == 200, r.text
    assert (await client.put("/console/api/tenants/acme", json={"rpm": 8}, headers=admin)).status_code == 200
    (t,) = [t for t in (await client.get("/console/api/tenants", headers=admin)).json()["data"] if t["name"] == "acme"]
    assert (t["rpm"], t["max_files"], t["max_file_bytes"], t["max_batches"]) == (8, 3, 1000, None)
    r = await client.put("/console/api/tenants/acme", json={"max_files": 0}, headers=admin)
    assert_openai_error(r, 400)
