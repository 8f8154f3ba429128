"""Regions with real processes on loopback: two ``xlaserve engine`` tiny-random replicas labelled
apart (``--labels region=eu-west`` and ``region=us-east``) and ``xlaserve serve --engines ...
--region eu-west`` over them, driven with the official ``openai`` client. Requests stay in the
gateway's region; its replica killed while a request is on its way there, the request is served
in the other region with the hop in its trace, and the next ones cross as ``cross_region_down``."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import openai
import pytest

from tests.support.replica_processes import ENGINE_ARGS, metric, start_engine, trace, wait_for, wait_healthy
from tests.support.server_process import serve_process

REGIONS = {"eu-west": "a", "us-east": "b"}  # region: zone


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """{region: (process, url)}, the gateway's region first."""
    tmp = tmp_path_factory.mktemp("regions")
    started = {}
    try:
        for region, zone in REGIONS.items():  # one after the other: the second loads what the first compiled
            log = tmp / f"engine-{region}.log"
            started[region] = start_engine(log, [*ENGINE_ARGS, "--labels", f"region={region},zone={zone}"])
            wait_healthy(*started[region], log)
        yield started, tmp
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_requests_stay_in_the_region_and_fail_over_when_its_replica_is_killed(replicas):
    started, tmp = replicas
    (home_proc, home), (_, away) = started["eu-west"], started["us-east"]
    # The replica elsewhere listed first: the order of --engines is no preference.
    args = ["--engines", f"{away},{home}", "--router", "kv-aware", "--region", "eu-west"]
    with serve_process(args, tmp / "gateway.log") as (_, gateway, _), \
            openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=120, max_retries=0) as client:
        wait_for(lambda: set(metric(gateway, "xlaserve:replica_up").values()) == {1.0}, "both replicas up")
        for k in range(4):
            r = client.completions.create(model="tiny-random", prompt=f"Hello {k}", max_tokens=3, temperature=0)
            t = trace(gateway, r.id)
            assert (t["replica"], t["region"], t["replica_retries"]) == (home, "eu-west", [])
            assert t["cost_usd"] > 0

        # Freeze the home replica so a request's Generate call hangs there (it is still up: a probe
        # takes 5 s to time out), then kill it: the call fails before any event and the router
        # takes the request to the other region.
        os.kill(home_proc.pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.completions.create, model="tiny-random", prompt="On its way",
                                  max_tokens=3, temperature=0)

            def on_its_way():
                inflight = {dict(k)["replica"]: v for k, v in metric(gateway, "xlaserve:replica_gateway_in_flight").items()}
                return inflight.get(home) == 1.0

            wait_for(on_its_way, "the request in flight on the frozen replica", timeout_s=4)
            home_proc.kill()  # SIGKILL: its connections reset
            home_proc.wait()
            r = pending.result(timeout=60)
        assert r.choices[0].finish_reason == "length"
        t = trace(gateway, r.id)
        assert (t["status"], t["replica"], t["region"]) == ("ok", away, "us-east")
        [hop] = t["replica_retries"]
        assert (hop["replica"], hop["region"], hop["reason"]) == (home, "eu-west", "unavailable")
        assert t["retries"] == 0 and t["cost_usd"] > 0

        # The home region is down: the next request crosses with no hop.
        r = client.completions.create(model="tiny-random", prompt="Still here?", max_tokens=3, temperature=0)
        t = trace(gateway, r.id)
        assert (t["replica"], t["region"], t["replica_retries"]) == (away, "us-east", [])
        assert httpx.get(f"{gateway}/health").status_code == 200
        decisions = {(dict(k)["replica"], dict(k)["reason"]): v
                     for k, v in metric(gateway, "xlaserve:router_decisions_total").items()}
        assert decisions[(away, "cross_region_down")] == 2  # the retry and the next request
        assert sum(v for (url, _), v in decisions.items() if url == home) == 5  # 4 served + the one killed
