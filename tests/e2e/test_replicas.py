"""Replicas behind one gateway, as real processes on loopback: two ``xlaserve engine``
tiny-random replicas and ``xlaserve serve --engines`` over them, driven with the official
``openai`` client. Prefix affinity, the hot-prefix spill, ``kill -9`` of a replica
mid-stream (it leaves one replica), then regions: the replicas are labelled apart
(``--labels region=...``, which the first gateway ignores), a second gateway with ``--region``
keeps requests on its region's replica and, that one killed while a request is on its way to it,
serves the request in the other region with the hop in its trace."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import openai
import pytest

from serving.rpc.remote_engine import fetch_model_info
from tests.support.replica_processes import ENGINE_ARGS, metric, start_engine, trace, wait_for, wait_healthy
from tests.support.server_process import serve_process

PREFIX = [2] + [(13 * i) % 400 + 100 for i in range(1023)]  # a 1024-token shared prefix
REGIONS = ("eu-west", "us-east")  # replica i's region label; zone "a" or "b"


def labelled(i: int) -> list[str]:
    return [*ENGINE_ARGS, "--labels", f"region={REGIONS[i]},zone={'ab'[i]}"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    started = []
    try:
        for i in range(2):  # one after the other: the second loads what the first compiled
            started.append(start_engine(tmp / f"engine{i}.log", labelled(i)))
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
    # the client gets a code and its request id; the replica's URL and its failure stay in the
    # gateway's log and trace (no internal detail reaches a client)
    with pytest.raises(openai.APIError, match="engine failed while serving this request"):
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


def test_regions_stay_home_and_fail_over_when_home_is_killed(replicas):
    """A gateway with ``--region eu-west``: requests stay on the eu-west replica; frozen, then killed
    while a request is on its way to it, the request is served in us-east with the hop in its
    trace, and the next one crosses as ``cross_region_down``. Runs last: it starts a replica in
    place of the one the kill -9 test killed (labels over the wire: ``GetModelInfo``)."""
    procs, tmp = replicas
    alive = {u: p for u, p in procs.items() if p.poll() is None}
    region = {u: fetch_model_info(u).labels["region"] for u in alive}
    restarted = None
    try:
        if len(alive) < 2:
            i = next(i for i, r in enumerate(REGIONS) if r not in region.values())
            proc, url = restarted = start_engine(tmp / "engine-restarted.log", labelled(i))
            wait_healthy(proc, url, tmp / "engine-restarted.log")
            alive[url], region[url] = proc, REGIONS[i]
        home = next(u for u, r in region.items() if r == "eu-west")
        away = next(u for u, r in region.items() if r == "us-east")
        # The replica elsewhere listed first: the order of --engines is no preference.
        args = ["--engines", f"{away},{home}", "--router", "kv-aware", "--region", "eu-west"]
        with serve_process(args, tmp / "gateway-eu-west.log") as (_, gateway, _), \
                openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=120, max_retries=0) as client:
            wait_for(lambda: set(metric(gateway, "xlaserve:replica_up").values()) == {1.0}, "both replicas up")
            for k in range(4):
                r = client.completions.create(model="tiny-random", prompt=f"Hello {k}", max_tokens=3,
                                              temperature=0)
                t = trace(gateway, r.id)
                assert (t["replica"], t["region"], t["replica_retries"]) == (home, "eu-west", [])
                assert t["cost_usd"] > 0

            # Freeze home so that a request's Generate call waits there (it is still up: a probe
            # takes 5 s to time out), then kill it: the call fails before any event and the
            # router takes the request to the other region.
            os.kill(alive[home].pid, signal.SIGSTOP)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.completions.create, model="tiny-random", prompt="On its way",
                                      max_tokens=3, temperature=0)

                def on_its_way():
                    inflight = metric(gateway, "xlaserve:replica_gateway_in_flight")
                    return {dict(k)["replica"]: v for k, v in inflight.items()}.get(home) == 1.0

                wait_for(on_its_way, "the request in flight on the frozen replica", timeout_s=4)
                alive[home].kill()  # SIGKILL: its connections reset
                alive[home].wait()
                r = pending.result(timeout=60)
            assert r.choices[0].finish_reason == "length"
            t = trace(gateway, r.id)
            assert (t["status"], t["replica"], t["region"]) == ("ok", away, "us-east")
            [hop] = t["replica_retries"]
            assert (hop["replica"], hop["region"], hop["reason"]) == (home, "eu-west", "unavailable")
            assert t["retries"] == 0 and t["cost_usd"] > 0

            # Home is down: the next request crosses with no hop.
            r = client.completions.create(model="tiny-random", prompt="Still here?", max_tokens=3, temperature=0)
            t = trace(gateway, r.id)
            assert (t["replica"], t["region"], t["replica_retries"]) == (away, "us-east", [])
            assert httpx.get(f"{gateway}/health").status_code == 200
            decisions = {(dict(k)["replica"], dict(k)["reason"]): v
                         for k, v in metric(gateway, "xlaserve:router_decisions_total").items()}
            assert decisions[(away, "cross_region_down")] == 2  # the retry and the next request
            assert sum(v for (url, _), v in decisions.items() if url == home) == 5  # 4 served + the one killed
    finally:
        if restarted is not None and restarted[0].poll() is None:
            restarted[0].kill()
            restarted[0].wait()
