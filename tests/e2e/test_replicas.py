"""Replicas behind one gateway, as real processes on loopback: two ``xlaserve engine``
tiny-random replicas and ``xlaserve serve --engines`` over them, driven with the official
``openai`` client. Prefix affinity, the hot-prefix spill, and ``kill -9`` of a replica
mid-stream (last: it leaves one replica)."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.support.replica_processes import metric, start_engine, trace, wait_for, wait_healthy
from tests.support.server_process import serve_process

PREFIX = [2] + [(13 * i) % 400 + 100 for i in range(1023)]  # a 1024-token shared prefix


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    started = []
    try:
        for i in range(2):  # one after the other: the second loads what the first compiled
            started.append(start_engine(tmp / f"engine{i}.log"))
            wait_healthy(*started[-1], tmp / f"engine{i}.log")
        yield {url: proc for proc, url in started}, tmp
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def gateway(replicas):
    procs, tmp = replicas
    # Cache weighted far above load, and a low imbalance bound: only the guard spills a hot prefix.
    args = ["--engines", ",".join(procs), "--router", "kv-aware", "--router-prefill-weight", "100",
            "--router-balance-abs", "2"]
    with serve_process(args, tmp / "gateway.log") as (_, url, log):
        yield url


@pytest.fixture(scope="module")
def client(gateway):
    c = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=120, max_retries=0)
    yield c
    c.close()


def cached_pages(gateway: str) -> dict[str, float]:
    return {dict(k)["replica"]: v for k, v in metric(gateway, "xlaserve:replica_cached_pages").items()}


def test_gateway_serves_the_replicas_model(client, gateway):
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    assert httpx.get(f"{gateway}/health").json() == {"status": "ok"}
    r = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    t = trace(gateway, r.id)
    assert t["replica"].startswith("grpc://127.0.0.1:") and t["status"] == "ok"


def test_follow_ups_sharing_a_prefix_go_where_it_is_cached(client, gateway):
    first = client.completions.create(model="tiny-random", prompt=PREFIX + [7, 8, 9], max_tokens=2,
                                      temperature=0)
    home = trace(gateway, first.id)["replica"]
    # Wait for the replica's KV events to reach the router: its 64 prefix pages.
    wait_for(lambda: cached_pages(gateway).get(home, 0) >= 64, "the prefix pages in the router's index")
    for k in range(4):
        r = client.completions.create(model="tiny-random", prompt=PREFIX + [11 + k] * 5, max_tokens=2,
                                      temperature=0)
        assert trace(gateway, r.id)["replica"] == home
        assert r.usage.prompt_tokens_details.cached_tokens >= 1024
    decisions = metric(gateway, "xlaserve:router_decisions_total")
    assert decisions[(("model_name", "tiny-random"), ("reason", "cache_hit"), ("replica", home))] >= 4


def test_a_hot_prefix_flood_spills_once_the_guard_trips(client, gateway):
    hot = PREFIX[:512] + [3] * 16
    before = cached_pages(gateway)
    warm = client.completions.create(model="tiny-random", prompt=hot, max_tokens=1, temperature=0)
    home = trace(gateway, warm.id)["replica"]
    wait_for(lambda: cached_pages(gateway).get(home, 0) > before.get(home, 0), "the hot prompt's pages")

    def one(k):
        r = client.completions.create(model="tiny-random", prompt=hot + [k + 20], max_tokens=300,
                                      temperature=0, extra_body={"ignore_eos": True})
        return trace(gateway, r.id)["replica"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = list(pool.map(one, range(12)))
    assert served.count(home) >= 3 and len(set(served)) == 2, served
    decisions = metric(gateway, "xlaserve:router_decisions_total")
    assert sum(v for k, v in decisions.items() if ("reason", "imbalance") in k) >= 1


def test_kill_9_of_a_replica_mid_stream(client, gateway, replicas):
    """The stream on the killed replica ends with finish_reason "error" and an error event
    (metered as an error), /health stays 200, the next requests succeed on the other one."""
    procs, _ = replicas
    stream = client.completions.create(model="tiny-random", prompt=PREFIX[:64], max_tokens=1900,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].finish_reason is None
    inflight = metric(gateway, "xlaserve:replica_gateway_in_flight")
    victim = next(dict(k)["replica"] for k, v in inflight.items() if v == 1)
    procs[victim].kill()  # SIGKILL: no goodbye on the connection
    procs[victim].wait()
    reasons = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for c in chunks:
            reasons.append(c.choices[0].finish_reason)
        pytest.fail(f"the stream ended without an error event: {reasons[-3:]}")
    assert reasons[-1] == "error" and set(reasons[:-1]) <= {None}
    t = trace(gateway, first.id)
    assert t["status"] == "error" and t["replica"] == victim and t["usage"]["completion_tokens"] > 0
    assert httpx.get(f"{gateway}/health").status_code == 200
    survivor = next(u for u in procs if u != victim)
    for _ in range(3):
        r = client.completions.create(model="tiny-random", prompt="Hello again", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert trace(gateway, r.id)["replica"] == survivor
    up = {dict(k)["replica"]: v for k, v in metric(gateway, "xlaserve:replica_up").items()}
    assert up == {victim: 0.0, survivor: 1.0}
