"""LoRA adapters behind the router, as real processes on loopback: two ``xlaserve engine``
replicas of hf_tiny's Llama (with a character tokenizer), one serving adapter ``a4``, the other
``a4`` and ``a8`` (tests/data/lora_tiny), ``xlaserve serve --engines`` over them, and a single
``xlaserve serve`` with both adapters as the reference, driven with the official ``openai``
client: ``/v1/models`` lists the replicas' adapters with their parent, an adapter request through
the router gets the single server's greedy tokens (and not the base model's), ``a8`` only ever
goes to the replica serving it, follow-ups of an adapter's prompt go where its pages are, and a
load / unload through the gateway reaches every replica."""

from __future__ import annotations

import concurrent.futures
import shutil

import httpx
import openai
import pytest

from serving.gateway.services.gateway_services import GatewayServices
from tests.support import hf_dir_fixtures as hfx
from tests.support.hf_tiny_parity import golden
from tests.support.paths import TEST_DATA
from tests.support.replica_processes import metric, start_engine, wait_for, wait_healthy
from tests.support.replica_processes import trace as replica_trace
from tests.support.server_process import serve_process

BASE = "tiny-llama-lora"
LORA = TEST_DATA / "lora_tiny"
ARGS = ["--dtype", "float32", "--max-model-len", "64", "--max-slots", "2", "--num-pages", "32",
        "--page-size", "8", "--prefill-chunk", "32", "--min-decode-batch", "2", "--max-loras", "2",
        "--max-lora-rank", "8"]
PROMPT = golden("llama")["prompt"]  # 16 token ids
ADMIN: dict[str, str] = {}  # the admin key's Authorization header (set by the fixture)


def modules(*names: str) -> list[str]:
    return ["--lora-modules", *(f"{n}={LORA / ('llama_r4' if n == 'a4' else 'llama_r8')}" for n in names)]


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """(gateway URL, single server URL, replica URLs)."""
    tmp = tmp_path_factory.mktemp("replicas-lora")
    model = tmp / BASE
    model.mkdir()
    for f in (TEST_DATA / "hf_tiny" / "llama").iterdir():
        if f.name == "config.json" or f.name.startswith("model"):
            shutil.copy(f, model / f.name)
    hfx.write_char_tokenizer(model)
    engine_args = ["--model", str(model), *ARGS]
    # Both servers share tmp/ledger.db (serve_process's default): one admin key loads adapters on
    # either (the anonymous caller of an open server is no admin), from under --lora-root.
    global ADMIN
    services = GatewayServices.open_server(database_url=f"sqlite:///{tmp / 'ledger.db'}",
                                           ledger_spool_dir=str(tmp / "spool"))
    ADMIN = {"Authorization": f"Bearer {services.authenticator.key_store.create_key('ops', is_admin=True)[0]}"}
    services.close()
    lora_root = ["--lora-root", str(LORA)]
    started = []
    try:
        started.append(start_engine(tmp / "engine0.log", [*engine_args, *modules("a4")]))
        wait_healthy(*started[-1], tmp / "engine0.log")  # the second one loads what this one compiled
        started.append(start_engine(tmp / "engine1.log", [*engine_args, *modules("a4", "a8")]))
        wait_healthy(*started[-1], tmp / "engine1.log")
        urls = [u for _, u in started]
        with serve_process([*engine_args, *modules("a4", "a8"), *lora_root], tmp / "single.log") as \
                (_, single, _), \
                serve_process(["--engines", ",".join(urls), "--router", "kv-aware", *lora_root],
                              tmp / "gateway.log") as (_, gateway, _):
            yield gateway, single, urls
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=ADMIN["Authorization"].split()[1], timeout=120,
                         max_retries=0)


def trace(gateway: str, response_id: str) -> dict:
    return replica_trace(gateway, response_id, ADMIN)


def greedy(url: str, model: str) -> tuple[list[str], str, str]:
    """(the completion's tokens as ids, its text, its id) of 8 greedy tokens after PROMPT."""
    with client(url) as c:
        r = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return r.choices[0].logprobs.tokens, r.choices[0].text, r.id


def models(url: str) -> dict[str, str | None]:
    with client(url) as c:
        return {m.id: getattr(m, "parent", None) for m in c.models.list().data}


def test_models_through_the_router_list_the_replicas_adapters(processes):
    gateway, single, _ = processes
    assert models(gateway) == models(single) == {BASE: None, "a4": BASE, "a8": BASE}


def test_adapter_requests_through_the_router_match_a_single_server(processes):
    gateway, single, urls = processes
    base = greedy(single, BASE)[0]
    for name in ("a4", "a8"):
        ours, text, rid = greedy(gateway, name)
        ref, ref_text, _ = greedy(single, name)
        assert ours == ref and text == ref_text and len(ours) == 8
        assert ours != base  # the adapter changes the greedy tokens: it was applied
        if name == "a8":  # only the second replica serves it
            assert trace(gateway, rid)["replica"] == urls[1]
    assert greedy(gateway, BASE)[0] == base


def test_concurrent_a8_requests_all_go_to_its_replica(processes):
    gateway, _, urls = processes
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rids = [r[2] for r in pool.map(lambda _: greedy(gateway, "a8"), range(4))]
    assert {trace(gateway, rid)["replica"] for rid in rids} == {urls[1]}


def cached_pages(gateway: str) -> dict[str, float]:
    return {dict(k)["replica"]: v for k, v in metric(gateway, "xlaserve:replica_cached_pages").items()}


def test_an_adapters_follow_ups_go_where_its_pages_are(processes):
    """Both replicas serve a4: follow-ups of an a4 prompt go to the replica that computed it (the
    router hashes them with a4's digest, as that replica's KV events report its pages) and hit
    its cache; hashed as base-model pages they would match nowhere and alternate replicas."""
    gateway, _, _ = processes
    p = [(11 * i) % 90 + 5 for i in range(24)]  # 3 pages of 8, new to both replicas
    before = cached_pages(gateway)
    with client(gateway) as c:
        first = c.completions.create(model="a4", prompt=p, max_tokens=2, temperature=0)
        home = trace(gateway, first.id)["replica"]
        wait_for(lambda: cached_pages(gateway)[home] > before[home], "the first prompt's KV events")
        for k in range(4):
            r = c.completions.create(model="a4", prompt=p + [k + 3], max_tokens=2, temperature=0)
            assert trace(gateway, r.id)["replica"] == home
            assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_load_and_unload_through_the_router_reach_every_replica(processes):
    gateway, single, urls = processes
    rs8 = str(LORA / "llama_rs8")
    r = httpx.post(f"{gateway}/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "rs8", "lora_path": rs8}, timeout=120)
    assert r.status_code == 200, r.text
    assert models(gateway)["rs8"] == BASE
    assert httpx.post(f"{single}/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "rs8", "lora_path": rs8},
                      timeout=120).status_code == 200
    assert greedy(gateway, "rs8")[0] == greedy(single, "rs8")[0]
    taken = httpx.post(f"{gateway}/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "rs8", "lora_path": rs8}, timeout=60)
    assert taken.status_code == 400 and taken.json()["error"]["code"] == "lora_name_taken"
    bad = httpx.post(f"{gateway}/v1/load_lora_adapter", headers=ADMIN,
                     json={"lora_name": "x", "lora_path": str(LORA / "nonexistent")}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter"
    assert "x" not in models(gateway)
    r = httpx.post(f"{gateway}/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "rs8"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "rs8" not in models(gateway)
    with client(gateway) as c, pytest.raises(openai.NotFoundError):
        c.completions.create(model="rs8", prompt=PROMPT, max_tokens=2)
