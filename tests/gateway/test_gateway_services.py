"""Gateway services in-process: rate limiter, prices, policies, auth modes, spans, log context.

Uses the scripted fake engine (no JAX) and a SQLite file per test.
"""

from __future__ import annotations

import logging
import math

import httpx
import pytest

from serving.gateway.accounts.api_keys import Limits, Principal
from serving.gateway.accounts.pricing import PriceTable, load_price_table
from serving.gateway.accounts.rate_limit import RateLimited, RateLimiter, format_duration
from serving.gateway.app import ServedModel, create_app
from serving.gateway.http.log_context import LOG_FORMAT, RequestIdLogFilter
from serving.gateway.services.gateway_services import GatewayServices
from serving.gateway.services.policy import BlocklistPolicy, Policies, PolicyViolation
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import parse_sse

pytestmark = pytest.mark.anyio
MODEL = "tiny"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def principal(**limits) -> Principal:
    return Principal(tenant="t", key_id="k", key_limits=Limits(**limits))


# ------------------------------------------------------------- rate limiter


def test_rpm_bucket_bursts_then_refills_at_the_steady_rate():
    clock = Clock()
    rl = RateLimiter(clock)
    p = principal(rpm=2)
    rl.admit(p, 0).settle(0)
    rl.admit(p, 0).settle(0)
    with pytest.raises(RateLimited) as e:
        rl.admit(p, 0)
    assert (e.value.scope, e.value.limit, e.value.value) == ("key", "requests", 2)
    assert e.value.retry_after == pytest.approx(30.0)  # 2/min: one request every 30 s
    clock.t += 29.9
    with pytest.raises(RateLimited):
        rl.admit(p, 0)
    clock.t += 0.2
    adm = rl.admit(p, 0)
    assert adm.headers["x-ratelimit-remaining-requests"] == "0"
    assert adm.headers["x-ratelimit-reset-requests"] == "59.9s"


def test_tokens_are_reserved_then_settled():
    clock = Clock()
    rl = RateLimiter(clock)
    p = principal(tpm=1000)
    a = rl.admit(p, 700)  # prompt + max_tokens
    with pytest.raises(RateLimited) as e:
        rl.admit(p, 400)
    assert e.value.limit == "tokens" and e.value.retry_after == pytest.approx(6.0)  # 100 short at 1000/60 per s
    a.settle(120)  # really used 120: 580 come back
    a.settle(0)  # idempotent
    assert rl.headers(p)["x-ratelimit-remaining-tokens"] == "880"
    with pytest.raises(RateLimited) as e:
        rl.admit(p, 1001)
    assert math.isinf(e.value.retry_after) and "Request too large" in str(e.value)


def test_concurrency_and_tenant_limits_are_all_or_nothing():
    rl = RateLimiter(Clock())
    p = Principal(tenant="acme", key_id="k1", key_limits=Limits(max_concurrent=2),
                  tenant_limits=Limits(rpm=3))
    q = Principal(tenant="acme", key_id="k2", tenant_limits=Limits(rpm=3))
    a1, a2 = rl.admit(p, 1), rl.admit(p, 1)
    with pytest.raises(RateLimited) as e:
        rl.admit(p, 1)
    assert (e.value.scope, e.value.limit) == ("key", "concurrent")
    rl.admit(q, 1)  # the tenant's third request (the rejected one took nothing)
    with pytest.raises(RateLimited) as e:
        rl.admit(q, 1)
    assert (e.value.scope, e.value.limit) == ("tenant", "requests")
    a1.settle(1)
    a2.settle(1)
    assert rl.headers(p)["x-ratelimit-limit-requests"] == "3"


def test_duration_format():
    assert [format_duration(x) for x in (0.02, 1.5, 59.9, 360)] == ["20ms", "1.5s", "59.9s", "6m0s"]


def test_limits_validate():
    with pytest.raises(ValueError, match="rpm must be >= 1"):
        Limits(rpm=0)


# ------------------------------------------------------------- prices


def test_price_table_cost_and_batch_discount():
    t = PriceTable.from_dict({"models": {"m": {"input": 2.0, "cached_input": 0.5, "output": 8.0}},
                              "batch_discount": 0.5})
    assert t.cost("m", 1000, 400, 100) == pytest.approx((600 * 2 + 400 * 0.5 + 100 * 8) / 1e6)
    assert t.cost("m", 1000, 400, 100, "batch") == pytest.approx(t.cost("m", 1000, 400, 100) / 2)
    assert t.cost("unknown", 10**6, 0, 10**6) == 0.0
    assert load_price_table().price("gemma-3-270m").output > 0
    with pytest.raises(ValueError, match="unknown keys"):
        PriceTable.from_dict({"model": {}})


# ------------------------------------------------------------- policies


def test_blocklist_input_matches_whole_words_case_insensitively():
    b = BlocklistPolicy(["bad word", "zap"])
    b.check_input(["a zapper is fine", "so is badword"])
    with pytest.raises(PolicyViolation):
        b.check_input(["hello", "this has a BAD WORD in it"])


@pytest.mark.parametrize("pieces", [["say zap now"], ["say z", "ap", " now"], ["say ", "za", "p"]])
def test_blocklist_output_never_leaks_a_split_phrase(pieces):
    f = BlocklistPolicy(["zap"]).output_filter()
    sent = ""
    stopped = False
    for p in pieces:
        out, stopped = f.feed(p)
        sent += out
        if stopped:
            break
    if not stopped:
        out, stopped = f.flush()
        sent += out
    assert stopped and sent == "say "


def test_blocklist_output_passes_clean_text_through():
    f = BlocklistPolicy(["zap"]).output_filter()
    sent = "".join(f.feed(p)[0] for p in ["zapp", "er and z", "a"]) + f.flush()[0]
    assert sent == "zapper and za"


def make_app(engine, services):
    return create_app({MODEL: ServedModel(MODEL, engine, FakeTokenizer(), 512, created=1)}, services)


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.fixture
def services(tmp_path):
    s = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                    blocklist=["zap"])
    yield s
    s.close()


async def test_input_policy_rejects_with_400_and_is_metered(services):
    engine = FakeEngine(text="fine")
    async with client_for(make_app(engine, services)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "please zap it"},
                         headers={"X-Request-ID": "pol-in"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_policy_violation"
    assert engine.submitted == []
    row = services.ledger.get("pol-in")
    assert row["status"] == "error" and "content_policy_violation" in row["error"]
    assert row["trace"]["events"][1]["event"] == "input_policy"


@pytest.mark.parametrize("stream", [False, True])
async def test_output_policy_stops_with_content_filter(services, stream):
    engine = FakeEngine(text="one two zap three four")
    async with client_for(make_app(engine, services)) as c:
        r = await c.post("/v1/completions", headers={"X-Request-ID": f"pol-out-{stream}"},
                         json={"model": MODEL, "prompt": "go", "max_tokens": 50, "stream": stream})
    assert r.status_code == 200
    if stream:
        events = parse_sse(r.text)
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
    else:
        text = r.json()["choices"][0]["text"]
        finish = r.json()["choices"][0]["finish_reason"]
    assert finish == "content_filter" and "zap" not in text and text.startswith("one two")
    assert engine.cancelled  # generation stopped
    row = services.ledger.get(f"pol-out-{stream}")
    assert row["status"] == "ok" and row["finish_reason"] == "content_filter"


def test_policy_plugins_load_by_name():
    p = Policies.from_config(plugins=["tests.gateway.test_gateway_services:_shouty_policy"])
    with pytest.raises(PolicyViolation):
        p.check_input(["NO SHOUTING"])
    with pytest.raises(ValueError, match="cannot load policy plugin"):
        Policies.from_config(plugins=["tests.nowhere:nothing"])


class _Shouty:
    name = "shouty"

    def check_input(self, texts):
        if any(t.isupper() for t in texts):
            raise PolicyViolation(self.name, "no shouting")


def _shouty_policy():
    return _Shouty()


# ------------------------------------------------------------- auth modes


async def test_open_mode_ignores_authorization_until_a_key_exists(services):
    async with client_for(make_app(FakeEngine(), services)) as c:
        body = {"model": MODEL, "prompt": "hi"}
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer unused"})
        assert r.status_code == 200  # open: the openai client always sends some key
        key, _ = services.authenticator.key_store.create_key("acme")
        services.authenticator._has_keys = (-1e9, False)  # skip the 1 s cache
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer unused"})
        assert r.status_code == 401
        r = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        r = await c.post("/v1/completions", json=body, headers={"Authorization": f"Basic {key}"})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]


def test_serve_refuses_a_public_address_without_keys(tmp_path):
    from serving.cli.serve import open_gateway_services
    from serving.config.server_config import load_server_config

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    with pytest.raises(ValueError, match="refusing to serve 0.0.0.0 without API keys"):
        open_gateway_services(load_server_config(host="0.0.0.0", database_url=db))
    open_gateway_services(load_server_config(host="0.0.0.0", database_url=db,
                                             allow_unauthenticated=True)).close()
    open_gateway_services(load_server_config(host="127.0.0.1", database_url=db)).close()
    open_gateway_services(load_server_config(host="::1", database_url=db)).close()


def test_prefix_cache_salt_is_scoped_by_tenant_unless_grouped():
    from serving.gateway.services.cache_scope import PrefixCacheScopes

    scopes = PrefixCacheScopes({"team": ["b", "c"]})
    salt = scopes.salt
    assert salt("a", None) == salt("a", None) != salt("d", None)
    assert salt("b", None) == salt("c", None) != salt("a", None)  # one group, one scope
    assert salt("b", "x") == salt("c", "x") != salt("b", None)  # the client's salt splits further
    assert salt("team", None) != salt("b", None)  # a tenant named like a group is not in it
    with pytest.raises(ValueError, match="'b' is in two groups"):
        PrefixCacheScopes({"team": ["b"], "other": ["b"]})


def test_prefix_cache_groups_setting_and_flag_are_validated():
    from serving.cli.serve import _prefix_cache_groups
    from serving.config.server_config import load_server_config

    assert _prefix_cache_groups(["team=b, c", "team=d"]) == {"team": ["b", "c", "d"]}
    with pytest.raises(ValueError, match="GROUP=TENANT"):
        _prefix_cache_groups(["team"])
    cfg = load_server_config(prefix_cache_groups={"team": ["b", "c"]})
    assert cfg.prefix_cache_groups == (("team", ("b", "c")),)
    with pytest.raises(ValueError, match="must name a non-empty list of tenants"):
        load_server_config(prefix_cache_groups={"team": "b"})


# ------------------------------------------------------------- spans and logs


async def test_otel_spans_per_request(tmp_path):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                                           otel_traces=True)
    try:
        engine = FakeEngine(text="abc", delay=0.01)
        async with client_for(make_app(engine, services)) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                             headers={"X-Request-ID": "otel-1"})
        assert r.status_code == 200
    finally:
        services.close()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"gateway", "queue", "decode"} <= set(spans)
    root = spans["gateway"]
    assert root.attributes["xlaserve.x_request_id"] == "otel-1"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert spans["decode"].parent.span_id == root.context.span_id
    assert root.start_time <= spans["decode"].start_time <= spans["decode"].end_time <= root.end_time


async def test_request_id_is_in_every_gateway_log_line(caplog, services):
    handler = caplog.handler
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    async with client_for(make_app(FakeEngine(), services)) as c:
        with caplog.at_level(logging.INFO, logger="xlaserve.gateway"):
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "secret prompt"},
                         headers={"X-Request-ID": "log-rid-1"})
    lines = [handler.format(r) for r in caplog.records if r.name == "xlaserve.gateway"]
    assert lines and all("[log-rid-1]" in line for line in lines), lines
    assert not any("secret prompt" in line for line in lines)  # no text unless log_text is on


def test_chained_output_filters_each_see_the_previous_ones_text():
    chain = Policies(output_policies=[BlocklistPolicy(["zap"]), BlocklistPolicy(["bam"])]).output_filter()
    sent = ""
    for piece in ["a b", "a", "m c"]:  # "bam" only clears both hold-backs at the end
        out, stopped = chain.feed(piece)
        sent += out
        assert not stopped
    out, stopped = chain.flush()
    assert stopped and sent + out == "a "
    chain = Policies(output_policies=[BlocklistPolicy(["zap"]), BlocklistPolicy(["bam"])]).output_filter()
    out, stopped = chain.feed("clean text ba")
    rest, stopped2 = chain.flush()
    assert not stopped and not stopped2 and out + rest == "clean text ba"
