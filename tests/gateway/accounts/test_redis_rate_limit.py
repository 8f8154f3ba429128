"""Rate limits shared through Redis (serving/gateway/accounts/redis_rate_limit.py), against a real Redis.

The fixtures start Debian's ``redis-server`` themselves on a free loopback
port, without persistence, in a temporary directory (``.ci/run`` installs the
package when it is missing; without it these tests fail, they are not
skipped). Waits are bounded loops on Redis state (its own clock, a lease's
score), never fixed sleeps; nothing asserts wall time.
"""

from __future__ import annotations

import gc
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from serving.gateway.accounts.api_keys import Limits, Principal
from serving.gateway.accounts.rate_limit import RateLimited, RateLimiter
from serving.gateway.accounts.redis_rate_limit import FALLBACK_NOTE, REDIS_URL_ENV, RedisRateLimiter
from serving.gateway.app import ServedModel, create_app
from serving.gateway.services.gateway_services import GatewayServices
from tests.support.gateway_fakes import FakeEngine, FakeTokenizer
from tests.support.gateway_harness import MODEL, assert_openai_error, client_for
from tests.support.server_process import free_port

pytestmark = pytest.mark.anyio

WAIT_S = 30.0
"""The most any wait on Redis state may take before the test fails."""


class RedisServer:
    """Debian's ``redis-server`` on a loopback port of its own, started and stopped by a test."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH: the Redis rate-limit tests need Debian's "
                        "redis-server package (apt-get install redis-server; .ci/run installs it)")
        self.exe, self.workdir, self.port = exe, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not answer PING:\n"
                            f"{(self.workdir / f'redis-{self.port}.log').read_text()[-2000:]}")
            time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server, monkeypatch):
    """The shared server's URL, emptied for this test."""
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def store(redis_url):
    """A client for looking at the limiter's state in Redis."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def gateway(redis_url):
    """``gateway(**kw)``: a RedisRateLimiter on the test's Redis (one per gateway), closed at the end."""
    made = []

    def make(**kw) -> RedisRateLimiter:
        made.append(RedisRateLimiter(redis_url, **kw))
        return made[-1]

    yield make
    for limiter in made:
        limiter.close()


def principal(**limits) -> Principal:
    return Principal(tenant="t", key_id="k", key_limits=Limits(**limits))


KEY = "xlaserve:rl:{t}:key:k"  # the Redis keys of principal()'s key scope, + ":requests" etc.


def redis_now(client: redis.Redis) -> float:
    sec, usec = client.time()
    return sec + usec / 1e6


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {WAIT_S} s: {what}")
        time.sleep(0.02)


def bucket(client: redis.Redis, key: str) -> tuple[float, float]:
    """(level, updated) of a bucket hash."""
    h = client.hgetall(key)
    return float(h["level"]), float(h["updated"])


# ------------------------------------------------------- two gateways, one key


def served_app(services: GatewayServices):
    return create_app({MODEL: ServedModel(MODEL, FakeEngine(text="hi"), FakeTokenizer(), 4096, created=1)},
                      services)


async def five_requests_across_two_gateways(tmp_path: Path, redis_url: str | None) -> list:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"  # one database: the same key on both gateways
    gateways = [GatewayServices.open_server(database_url=db, redis_url=redis_url) for _ in range(2)]
    try:
        key, _ = gateways[0].authenticator.key_store.create_key("acme", limits=Limits(rpm=4))
        auth = {"Authorization": f"Bearer {key}"}
        async with client_for(served_app(gateways[0])) as a, client_for(served_app(gateways[1])) as b:
            return [await (a, b)[i % 2].post("/v1/completions", headers=auth,
                                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                    for i in range(5)]
    finally:
        for g in gateways:
            g.close()


async def test_two_gateways_sharing_redis_refuse_the_fifth_request_of_a_key_with_rpm_4(tmp_path, redis_url):
    responses = await five_requests_across_two_gateways(tmp_path, redis_url)
    assert [r.status_code for r in responses[:4]] == [200] * 4, [r.text for r in responses]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in responses[:4]] == ["3", "2", "1", "0"]
    err = assert_openai_error(responses[4], 429, code="rate_limit_exceeded")
    assert err["type"] == "requests" and "key's limit of 4 requests per minute" in err["message"]
    assert int(responses[4].headers["retry-after"]) >= 1
    assert responses[4].headers["x-ratelimit-limit-requests"] == "4"


async def test_without_redis_each_gateway_keeps_its_own_limits(tmp_path, monkeypatch):
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    responses = await five_requests_across_two_gateways(tmp_path, None)
    assert [r.status_code for r in responses] == [200] * 5  # 3 and 2 of each gateway's own 4


# ------------------------------------------------------- same semantics as in process


def test_decisions_and_headers_are_those_of_the_in_process_limiter(gateway):
    p = Principal(tenant="t", key_id="k", key_limits=Limits(rpm=10, tpm=1000, max_concurrent=3),
                  tenant_limits=Limits(rpm=100, tpm=5000, max_concurrent=1))
    local, shared = RateLimiter(), gateway()
    a, b = local.admit(p, 100), shared.admit(p, 100)  # fresh buckets: no refill on either side
    assert b.decisions == a.decisions and b.headers == a.headers and b.reserved_tokens == 100
    with pytest.raises(RateLimited) as e_local:
        local.admit(p, 100)
    with pytest.raises(RateLimited) as e_shared:
        shared.admit(p, 100)
    assert [(e.scope, e.limit, e.value, e.retry_after) for e in (e_local.value, e_shared.value)] == \
        [("tenant", "concurrent", 1, 1.0)] * 2
    assert shared.headers(p)["x-ratelimit-limit-tokens"] == "1000"
    assert shared.headers(Principal(tenant="t", key_id=None)) == {}  # unlimited: Redis not asked


def test_a_changed_limit_keeps_what_was_taken_as_in_process(gateway):
    shared = gateway()
    shared.admit(principal(rpm=1), 0)
    with pytest.raises(RateLimited):
        shared.admit(principal(rpm=1), 0)
    raised = principal(rpm=3)  # e.g. `xlaserve keys` changed it; both gateways read it from the database
    assert [shared.admit(raised, 0).decisions[0]["requests_remaining"] for _ in range(2)] == [1, 0]
    with pytest.raises(RateLimited):  # 1 of 3 was taken before the change: not refilled by it
        shared.admit(raised, 0)


# ------------------------------------------------------- tokens, all or nothing


def test_a_request_over_the_tenants_tokens_takes_nothing_from_the_key_either(gateway, store):
    a, b = gateway(), gateway()  # two gateways
    p = Principal(tenant="t", key_id="k", key_limits=Limits(rpm=100, tpm=1000),
                  tenant_limits=Limits(rpm=100, tpm=500))
    a.admit(p, 300)  # the key has 700 left, the tenant 200
    def state():
        return {k: store.hgetall(k) if store.type(k) == "hash" else store.zrange(k, 0, -1, withscores=True)
                for k in sorted(store.scan_iter("xlaserve:rl:*"))}

    before = state()
    assert len(before) == 6  # key and tenant: requests, tokens, leases
    with pytest.raises(RateLimited) as e:
        b.admit(p, 400)  # fits the key's 700, not the tenant's 200
    assert (e.value.scope, e.value.limit, e.value.value, e.value.needed) == ("tenant", "tokens", 500, 400)
    assert 0 < e.value.retry_after < float("inf")
    assert state() == before  # not a bucket nor a lease written
    # What the refused request did not take is there for the next one, on either scope.
    adm = b.admit(p, 150)
    assert adm.decisions[0]["tokens_remaining"] >= 550 and adm.decisions[0]["requests_remaining"] >= 97
    other_key = Principal(tenant="t", key_id="k2", tenant_limits=Limits(rpm=100, tpm=500))
    a.admit(other_key, 40)  # the tenant's last ~50


# ------------------------------------------------------- concurrency leases


def test_a_dead_gateways_lease_blocks_until_its_ttl_then_frees(gateway, store):
    p = principal(max_concurrent=1)
    dead, live = gateway(lease_ttl_s=1.0), gateway(lease_ttl_s=1.0)
    orphan = dead.admit(p, 1)  # never settled
    dead.close()  # the gateway is gone: nobody renews its lease
    with pytest.raises(RateLimited) as e:
        live.admit(p, 1)
    assert (e.value.scope, e.value.limit, e.value.value) == ("key", "concurrent", 1)
    ((lease_id, expiry),) = store.zrange(f"{KEY}:leases", 0, -1, withscores=True)
    assert lease_id == orphan._scopes[0].lease_id
    wait_until(lambda: redis_now(store) > expiry, "Redis's clock passes the lease's expiry")
    adm = live.admit(p, 1)  # the lapsed lease was dropped, its slot is free
    assert store.zrange(f"{KEY}:leases", 0, -1) == [adm._scopes[0].lease_id]
    assert adm.decisions[0]["concurrent_active"] == 1
    adm.settle(1)
    assert store.zcard(f"{KEY}:leases") == 0


def test_a_running_requests_lease_is_renewed_past_its_ttl(gateway, store):
    p = principal(max_concurrent=1)
    live, other = gateway(lease_ttl_s=2.0), gateway(lease_ttl_s=2.0)
    adm = live.admit(p, 1)
    lease_id = adm._scopes[0].lease_id
    first_expiry = store.zscore(f"{KEY}:leases", lease_id)
    wait_until(lambda: (store.zscore(f"{KEY}:leases", lease_id) or 0) > first_expiry,
               "the renewal thread moves the lease's expiry")
    wait_until(lambda: redis_now(store) > first_expiry, "Redis's clock passes the first expiry")
    with pytest.raises(RateLimited) as e:
        other.admit(p, 1)  # still held: renewed, not lapsed
    assert e.value.limit == "concurrent"
    assert store.zscore(f"{KEY}:leases", lease_id) > first_expiry
    adm.settle(1)
    assert live.renew_leases() == 0  # settled: nothing left to renew
    dropped = other.admit(p, 1)
    assert other.renew_leases() == 1
    del dropped  # dropped without settling (a bug elsewhere): no longer renewed, it lapses
    gc.collect()
    assert other.renew_leases() == 0


# ------------------------------------------------------- settlement


def test_settle_gives_back_unused_tokens_and_releases_the_lease(gateway, store):
    a, b = gateway(), gateway()
    p = principal(tpm=600)  # 10 tokens per second
    adm = a.admit(p, 500)  # prompt + max_tokens: 100 left
    level, updated = bucket(store, f"{KEY}:tokens")
    assert store.zcard(f"{KEY}:leases") == 1
    adm.settle(120)  # really used 120: 380 come back
    new_level, new_updated = bucket(store, f"{KEY}:tokens")
    refill = (new_updated - updated) * 600 / 60  # by Redis's clock, whatever time passed
    assert new_level == pytest.approx(min(600.0, level + refill + 380))
    assert store.zcard(f"{KEY}:leases") == 0
    adm.settle(0)  # idempotent
    assert bucket(store, f"{KEY}:tokens") == (new_level, new_updated)
    b.admit(p, 400)  # on the other gateway too: 100 + 380 are there
    with pytest.raises(RateLimited) as e:
        b.admit(p, 601)
    assert e.value.retry_after == float("inf") and "Request too large" in str(e.value)


# ------------------------------------------------------- Redis unreachable


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_unreachable_redis_fails_open_to_this_gateways_own_limits(tmp_path, caplog):
    server = RedisServer(tmp_path)
    server.start()
    clock = Clock()
    gw = RedisRateLimiter(server.url, clock=clock, redis_retry_s=1.0)
    store = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        p = principal(rpm=2)
        by_redis = gw.admit(p, 0)
        assert "note" not in by_redis.decisions[0]
        server.stop()
        with caplog.at_level(logging.WARNING, logger="xlaserve.gateway"):
            by_redis.settle(0)  # cannot reach Redis: logged, its lease lapses by its TTL
            here = [gw.admit(p, 0), gw.admit(p, 0)]  # admitted on this gateway's own limits
            with pytest.raises(RateLimited) as e:
                gw.admit(p, 0)  # whose rpm=2 still holds
            RedisRateLimiter(server.url).close()
        assert (e.value.scope, e.value.limit) == ("key", "requests")
        assert all(a.decisions[0]["note"] == FALLBACK_NOTE for a in here)
        assert gw.headers(p)["x-ratelimit-remaining-requests"] == "0"
        messages = [r.getMessage() for r in caplog.records]
        assert any("did not settle lease" in m for m in messages)
        assert any("rate limits are this gateway's own" in m for m in messages)
        assert any("is not answering" in m for m in messages)  # a limiter opened while it is down
        server.start()  # back, and empty (no persistence)
        with pytest.raises(RateLimited):
            gw.admit(p, 0)  # within redis_retry_s of the failure: still decided here
        assert store.dbsize() == 0  # Redis was not asked
        clock.t += 1.0
        back = gw.admit(p, 0)
        assert "note" not in back.decisions[0] and back.decisions[0]["requests_remaining"] == 1
        assert store.exists(f"{KEY}:requests", f"{KEY}:leases") == 2
        for a in here:
            a.settle(0)  # settled on this gateway's own limiter
        back.settle(0)
        assert store.zcard(f"{KEY}:leases") == 0
    finally:
        gw.close()
        store.close()
        server.stop()


# ------------------------------------------------------- wiring


def test_serve_settings_pick_the_redis_limiter(tmp_path, redis_url, monkeypatch):
    from serving.cli.serve import open_gateway_services
    from serving.config.server_config import load_server_config

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    services = open_gateway_services(load_server_config(database_url=db, redis_url=redis_url))
    assert isinstance(services.metering.limiter, RedisRateLimiter)
    services.close()
    services = GatewayServices.open_server(database_url=db)
    assert type(services.metering.limiter) is RateLimiter  # per process, as without Redis
    services.close()
    monkeypatch.setenv(REDIS_URL_ENV, redis_url)
    services = GatewayServices.open_server(database_url=db)
    assert isinstance(services.metering.limiter, RedisRateLimiter)
    services.close()
    with pytest.raises(ValueError, match="redis://"):
        GatewayServices.open_server(database_url=db, redis_url="http://127.0.0.1:1")
