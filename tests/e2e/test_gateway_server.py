"""The gateway against a real server process and a real database.

One `xlaserve serve --model tiny-random` process per database backend: SQLite
(a WAL file in a temp dir) always, PostgreSQL too when
``XLASERVE_TEST_DATABASE_URL`` is set (``.ci/run`` starts one). Keys and
tenants are created in the database before the server starts, as
``xlaserve keys create`` would. The tests share the server and its ledger, so
they run in file order; the last ones check that the ledger, ``/v1/usage``,
``xlaserve usage`` and ``/metrics`` agree on everything the earlier ones sent.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.accounts.api_keys import KeyStore, Limits
from serving.gateway.accounts.auth import KEY_CACHE_S
from serving.gateway.accounts.database import metadata, open_database
from serving.gateway.accounts.ledger import Ledger
from serving.gateway.accounts.pricing import load_price_table
from tests.support.server_process import TINY_SERVER_ARGS, serve_process

POSTGRES_URL = os.environ.get("XLASERVE_TEST_DATABASE_URL")
MODEL = "tiny-random"
# A KV pool of 23 usable pages (368 tokens) under a 512-token context window:
# a request for more passes the gateway and is rejected by the engine (a failure).
# Tenants "lambda" and "mu" share prefix-cache pages; the others only their own.
# The pool's size makes every program of this server its own (the KV cache is an input), so
# it compiles only the shapes these tests reach (--skip-warmup): ~80 s less on a cold cache.
SERVER_ARGS = [*TINY_SERVER_ARGS, "--num-pages", "24", "--prefix-cache-group", "team=lambda,mu",
               "--skip-warmup"]


def _database_url(kind: str, tmp_path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    engine = open_database(POSTGRES_URL)  # a fresh schema in the test database
    metadata.drop_all(engine)
    engine.dispose()
    return POSTGRES_URL


class Gateway:
    """The running server, its database and the keys made for the tests."""

    def __init__(self, url: str, db_url: str, proc, keys: dict[str, str]):
        self.url, self.db_url, self.proc, self.keys = url, db_url, proc, keys
        self.engine = open_database(db_url)
        self.store = KeyStore(self.engine)
        self.ledger = Ledger(self.engine)
        # X-Request-ID -> the statuses the test expects its rows to have (one per request sent).
        self.sent: dict[str, list[str]] = {}

    def expect(self, rid: str, status: str) -> None:
        self.sent.setdefault(rid, []).append(status)

    def post(self, key: str | None, body: dict, rid: str | None = None, expect: str | None = "ok",
             **kwargs) -> httpx.Response:
        """POST /v1/completions with `key`; records the X-Request-ID when a row is expected."""
        rid = rid or uuid.uuid4().hex
        headers = {"X-Request-ID": rid}
        if key is not None:
            headers["Authorization"] = f"Bearer {self.keys.get(key, key)}"
        r = httpx.post(f"{self.url}/v1/completions", json={"model": MODEL, **body}, headers=headers,
                       timeout=60, **kwargs)
        assert r.headers["x-request-id"] == rid
        if expect is not None:
            self.expect(rid, expect if r.status_code != 429 else "rate_limited")
        return r

    def get(self, path: str, key: str = "admin", **params) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", params=params, timeout=30,
                         headers={"Authorization": f"Bearer {self.keys[key]}"})

    def rows_by_rid(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for row in self.ledger.rows():
            out.setdefault(row["x_request_id"], []).append(row)
        return out

    def wait_complete(self, rid: str, timeout: float = 30) -> dict:
        """The row of `rid` once it is no longer "running"."""
        deadline = time.time() + timeout
        while True:
            rows = self.rows_by_rid().get(rid, [])
            if rows and rows[0]["status"] != "running":
                return rows[0]
            assert time.time() < deadline, f"row of {rid} not complete: {rows}"
            time.sleep(0.1)


@pytest.fixture(scope="module", params=["sqlite"] + (["postgres"] if POSTGRES_URL else []))
def gw(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"gateway_{request.param}")
    db_url = _database_url(request.param, tmp)
    store = KeyStore(open_database(db_url))
    keys = {}
    keys["rpm"], _ = store.create_key("alpha", limits=Limits(rpm=3))
    keys["free"], _ = store.create_key("beta")
    keys["tpm"], _ = store.create_key("gamma", limits=Limits(tpm=300))
    keys["conc"], _ = store.create_key("delta", limits=Limits(max_concurrent=4))
    keys["doomed"], _ = store.create_key("epsilon")
    keys["admin"], _ = store.create_key("ops", is_admin=True)
    store.set_tenant("zeta", models=["some-other-model"])
    keys["restricted"], _ = store.create_key("zeta")
    keys["cache-a"], _ = store.create_key("kappa")
    keys["cache-b"], _ = store.create_key("lambda")
    keys["cache-c"], _ = store.create_key("mu")
    store.engine.dispose()
    with serve_process(SERVER_ARGS + ["--database-url", db_url], tmp / "server.log") as (proc, url, log):
        g = Gateway(url, db_url, proc, keys)
        yield g
        g.ledger.close()
        g.engine.dispose()
        log.seek(0)
        assert "Traceback" not in log.read()


def _completion(max_tokens: int = 8, **extra) -> dict:
    return {"prompt": "hello there", "max_tokens": max_tokens, "temperature": 0, **extra}


# ------------------------------------------------------------- auth


def test_auth_errors(gw):
    r = gw.post(None, _completion(), expect=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = gw.post("xls-not-a-real-key", _completion(), expect=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{gw.url}/v1/models", timeout=10)
    assert r.status_code == 401
    r = gw.post("restricted", _completion(), expect=None)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert gw.get("/v1/models", key="restricted").json()["data"] == []
    r = gw.get(f"/v1/models/{MODEL}", key="restricted")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert gw.get(f"/v1/models/{MODEL}", key="free").json()["id"] == MODEL
    assert httpx.get(f"{gw.url}/v1/models/{MODEL}", timeout=10).status_code == 401


def test_revoked_key_fails(gw):
    assert gw.post("doomed", _completion()).status_code == 200
    key_id = gw.store.list_keys("epsilon")[0].key_id
    out = subprocess.run([sys.executable, "-m", "serving.cli.main", "keys", "revoke", key_id,
                          "--database-url", gw.db_url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Revoked by another process: the gateway's look-up of an active key answers for KEY_CACHE_S.
    time.sleep(KEY_CACHE_S)
    r = gw.post("doomed", _completion(), expect=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked"
    assert gw.post("free", _completion()).status_code == 200  # others unaffected


# ------------------------------------------------------------- rate limits


def test_rpm_limit_gives_429_with_headers_and_spares_other_keys(gw):
    remaining = []
    for _ in range(3):
        r = gw.post("rpm", _completion())
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == [2, 1, 0]
    r = gw.post("rpm", _completion())
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "key's limit of 3 requests per minute" in err["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 21  # one request refills in 20 s
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # Another key (another tenant) is unaffected, and unlimited keys get no rate-limit headers.
    r = gw.post("free", _completion())
    assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


def test_tpm_reserves_then_settles_to_real_counts(gw):
    # A stream cut after a few tokens: max_tokens (60) was reserved, few were used.
    rid = uuid.uuid4().hex
    body = {"model": MODEL, **_completion(60, ignore_eos=True, stream=True)}
    t0 = time.time()
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {gw.keys['tpm']}", "X-Request-ID": rid}) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-tokens"] == "300"
        first_remaining = int(r.headers["x-ratelimit-remaining-tokens"])
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break
    gw.expect(rid, "cancelled")
    row = gw.wait_complete(rid)
    assert row["status"] == "cancelled"
    used = row["prompt_tokens"] + row["completion_tokens"]
    trace = gw.get(f"/v1/requests/{rid}").json()
    assert trace["reserved_tokens"] == row["prompt_tokens"] + 60
    assert trace["settled_tokens"] == used
    assert first_remaining == 300 - trace["reserved_tokens"]
    assert used < trace["reserved_tokens"]
    # The next request sees the unused reservation given back (plus refill at 5 tokens/s).
    r = gw.post("tpm", _completion(10, ignore_eos=True))
    elapsed = time.time() - t0
    reserve = r.json()["usage"]["prompt_tokens"] + 10
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    expected = 300 - used - reserve  # with no refill at all
    assert expected <= remaining <= min(300 - reserve, expected + 5 * elapsed + 1), (remaining, expected)
    # A request larger than the whole limit can never pass: 429 without Retry-After.
    r = gw.post("tpm", _completion(400))
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
    assert "Request too large" in r.json()["error"]["message"] and "retry-after" not in r.headers


def test_concurrency_limit_holds_under_20_parallel_streams(gw):
    body = _completion(24, ignore_eos=True, stream=True)

    def one(i):
        rid = f"conc-{i}-{uuid.uuid4().hex[:8]}"
        r = gw.post("conc", body, rid=rid)
        return rid, r.status_code, r.text

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    codes = Counter(code for _, code, _ in results)
    assert set(codes) <= {200, 429}, results
    assert codes[200] >= 4, codes
    for rid, code, text in results:
        if code == 429:
            assert json.loads(text)["error"]["type"] == "concurrent"
        else:
            assert text.rstrip().endswith("data: [DONE]")
    # Each admitted request held its slot from its "admitted" event to its end;
    # those intervals never overlap more than 4 deep.
    spans = []
    for rid, code, _ in results:
        if code == 200:
            trace = gw.get(f"/v1/requests/{rid}").json()
            admitted = next(e["t"] for e in trace["events"] if e["event"] == "admitted")
            spans.append((admitted, trace["finished_at"]))
    edges = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    depth = peak = 0
    for _, d in edges:
        depth += d
        peak = max(peak, depth)
    assert 1 <= peak <= 4, spans


# ------------------------------------------------------------- failures and cancels


def test_failed_request_is_metered(gw):
    # 16 + 400 tokens fit the 512-token window but not the 23-page KV pool: the engine rejects it.
    r = gw.post("free", _completion(400), expect="error")
    assert r.status_code == 400, r.text
    assert "KV-cache pages" in r.json()["error"]["message"]


def test_a_body_over_max_request_bytes_gets_413_and_no_row(gw):
    # 5 MiB against the default limit of 4 MiB: refused from its Content-Length, nothing admitted.
    rid = uuid.uuid4().hex
    r = gw.post("free", {"prompt": "x" * (5 * 1024 * 1024)}, rid=rid, expect=None)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large" and "4194304 bytes" in r.json()["error"]["message"]
    assert rid not in gw.rows_by_rid()
    assert gw.post("free", _completion(2)).status_code == 200


def test_cancelled_stream_is_metered(gw):
    rid = uuid.uuid4().hex
    body = {"model": MODEL, **_completion(200, ignore_eos=True, stream=True)}
    with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {gw.keys['free']}", "X-Request-ID": rid}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    gw.expect(rid, "cancelled")
    row = gw.wait_complete(rid)
    assert row["status"] == "cancelled" and row["finish_reason"] is None
    assert 0 < row["completion_tokens"] < 200
    assert row["prompt_tokens"] > 0


def test_request_trace(gw):
    rid = "trace-" + uuid.uuid4().hex
    body = _completion(6, prompt="a prompt long enough to fill a few KV-cache pages of sixteen tokens")
    assert gw.post("free", body, rid=rid).status_code == 200
    assert gw.post("free", body, rid=rid).status_code == 200  # a retry with the same X-Request-ID
    t = gw.get(f"/v1/requests/{rid}", key="free").json()
    assert t["x_request_id"] == rid and t["id"].startswith("cmpl-") and t["tenant"] == "beta"
    assert t["status"] == "ok" and t["retries"] == 1
    assert t["prefix_cache"] == "hit"  # the same prompt again
    assert t["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert t["host_cached_tokens"] == 0  # (no host KV tier: the device prefix cache served them)
    cached = t["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert t["cached_tokens_by_tier"] == {"device": cached, "host": 0, "disk": 0} and t["disk_cached_tokens"] == 0
    timings = t["timings"]
    assert 0 <= timings["queue_time_s"] <= timings["ttft_s"] <= timings["e2e_s"]
    assert timings["itl_max_s"] >= timings["itl_mean_s"] > 0
    assert [e["event"] for e in t["events"]][:1] == ["admitted"] and t["events"][-1]["event"] == "finished"
    assert gw.get(f"/v1/requests/{t['id']}", key="free").json()["x_request_id"] == rid
    # Another tenant cannot see it; an unknown id is 404.
    assert gw.get(f"/v1/requests/{rid}", key="rpm").status_code == 404
    assert gw.get("/v1/requests/nope").json()["error"]["code"] == "request_not_found"


# ------------------------------------------------------------- prefix cache, KV pool


def test_prefix_cache_pages_are_shared_within_a_tenant_or_a_group_only(gw):
    prompt = [2] + [(7 * i + 3) % 400 + 100 for i in range(159)]  # 160 tokens: 10 pages of 16

    def cached_tokens(key: str) -> int:
        r = gw.post(key, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens("cache-a") == 0
    assert cached_tokens("cache-b") == 0  # another tenant does not see tenant a's pages
    assert cached_tokens("cache-a") == 144  # tenant a does (9 full pages; the last token is recomputed)
    assert cached_tokens("cache-c") == 144  # mu shares lambda's pages (group "team")


def test_chat_without_max_tokens_gets_what_the_kv_pool_leaves(gw):
    rid = uuid.uuid4().hex
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "temperature": 0}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {gw.keys['free']}", "X-Request-ID": rid})
    gw.expect(rid, "ok")
    assert r.status_code == 200, r.text  # before: max_tokens = 512 - prompt, refused by the 368-token pool
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 368
    assert gw.get(f"/v1/requests/{rid}").json()["reserved_tokens"] == 368  # prompt + default max_tokens


# ------------------------------------------------------------- ledger, usage, metrics


def _quiesce(gw) -> list[dict]:
    for rid in gw.sent:
        gw.wait_complete(rid)
    return gw.ledger.rows()


def test_ledger_has_one_complete_row_per_request_with_priced_cost(gw):
    rows = _quiesce(gw)
    by_rid = gw.rows_by_rid()
    assert set(by_rid) == set(gw.sent), set(by_rid) ^ set(gw.sent)
    prices = load_price_table()
    for rid, statuses in gw.sent.items():
        assert sorted(r["status"] for r in by_rid[rid]) == sorted(statuses), (rid, by_rid[rid])
    for row in rows:
        expected = row["status"]
        assert row["finished_at"] is not None and row["e2e_s"] is not None
        assert row["cost_usd"] == pytest.approx(prices.cost(
            MODEL, row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["priority"]))
        if expected == "ok":
            assert row["finish_reason"] in ("stop", "length")
            assert row["ttft_s"] is not None and row["queue_time_s"] is not None
            assert row["prompt_tokens"] > 0 and row["completion_tokens"] > 0
        if expected in ("rate_limited", "error"):
            assert row["prompt_tokens"] == row["completion_tokens"] == 0 and row["cost_usd"] == 0
    assert {r["status"] for r in rows} == {"ok", "error", "cancelled", "rate_limited"}


def test_usage_api_and_cli_sum_to_the_ledger(gw):
    rows = _quiesce(gw)
    for group_by in ("model", "key", "day"):
        body = gw.get("/v1/usage", group_by=group_by).json()
        assert body["totals"]["requests"] == len(rows)
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert body["totals"][field] == sum(r[field] for r in rows)
        assert body["totals"]["cost_usd"] == pytest.approx(sum(r["cost_usd"] for r in rows))
    by_key = {d["group"]: d for d in gw.get("/v1/usage", group_by="key").json()["data"]}
    for key_id, n in Counter(r["key_id"] for r in rows).items():
        assert by_key[key_id]["requests"] == n
    # A tenant sees only its own usage; only admins may ask for another's.
    mine = gw.get("/v1/usage", key="rpm").json()
    assert mine["tenant"] == "alpha"
    assert mine["totals"]["requests"] == sum(1 for r in rows if r["tenant"] == "alpha") == 4
    assert gw.get("/v1/usage", key="rpm", tenant="beta").status_code == 403
    assert gw.get("/v1/usage", group_by="colour").status_code == 400
    # Time window: nothing starts in the future.
    assert gw.get("/v1/usage", start=str(time.time() + 3600)).json()["totals"]["requests"] == 0
    # The CLI prints the same totals.
    out = subprocess.run([sys.executable, "-m", "serving.cli.main", "usage", "--database-url", gw.db_url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    total = next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL"))
    assert int(total[1]) == len(rows)
    assert int(total[4]) == sum(r["prompt_tokens"] for r in rows)
    assert int(total[6]) == sum(r["completion_tokens"] for r in rows)


def test_metrics_parse_and_agree_with_the_ledger(gw):
    rows = _quiesce(gw)
    text = httpx.get(f"{gw.url}/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name, **labels):
        return samples.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)

    for status, n in Counter(r["status"] for r in rows).items():
        assert value("xlaserve:requests_total", status=status) == n, status
    for reason, n in Counter(r["finish_reason"] for r in rows if r["status"] == "ok").items():
        assert value("xlaserve:request_success_total", finish_reason=reason) == n
    assert value("xlaserve:prompt_tokens_total") == sum(r["prompt_tokens"] for r in rows)
    assert value("xlaserve:generation_tokens_total") == sum(r["completion_tokens"] for r in rows)
    assert value("xlaserve:cached_prompt_tokens_total") == sum(r["cached_tokens"] for r in rows)
    assert value("xlaserve:request_cost_usd_total") == pytest.approx(sum(r["cost_usd"] for r in rows))
    limited = Counter(r["status"] for r in rows)["rate_limited"]
    assert sum(v for (n, _), v in samples.items() if n == "xlaserve:rate_limit_rejections_total") == limited
    assert value("xlaserve:rate_limit_rejections_total", scope="key", limit="requests") >= 1
    assert value("xlaserve:e2e_request_latency_seconds_count") == sum(
        1 for r in rows if r["status"] != "rate_limited")
    assert value("xlaserve:time_to_first_token_seconds_count") == sum(1 for r in rows if r["ttft_s"])
    assert value("xlaserve:num_requests_running") == 0
    assert 0.0 <= value("xlaserve:kv_cache_usage_perc") <= 1.0
    assert value("xlaserve:prefix_cache_queries_total") >= value("xlaserve:prefix_cache_hits_total") > 0


# ------------------------------------------------------------- crash safety


def test_ledger_survives_a_killed_server(tmp_path):
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    rids = []
    with serve_process(SERVER_ARGS + ["--database-url", db], tmp_path / "a.log") as (proc, url, _):
        for i in range(6):
            rid = f"kill-{i}"
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **_completion(4, stream=i % 2 == 1)},
                           headers={"X-Request-ID": rid}, timeout=60)
            assert r.status_code == 200
            rids.append(rid)
        proc.send_signal(signal.SIGKILL)  # no shutdown, no flush
        proc.wait()
    # Restarted under another served name: the old rows stay, keyed by the name they had.
    with serve_process(SERVER_ARGS + ["--database-url", db, "--served-model-name", "renamed"],
                       tmp_path / "b.log") as (_, url, _):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == ["renamed"]
        usage = httpx.get(f"{url}/v1/usage", timeout=30).json()
        assert usage["totals"]["requests"] == 6 and usage["totals"]["incomplete"] == 0
        for rid in rids:
            t = httpx.get(f"{url}/v1/requests/{rid}", timeout=30).json()
            assert t["status"] == "ok" and t["usage"]["completion_tokens"] > 0, t
