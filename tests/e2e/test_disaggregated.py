"""Disaggregated serving with real processes on loopback: ``xlaserve engine --role prefill`` and
``--role decode`` replicas, the gateway's router over them (``serving.routing.disaggregation``),
the KV pages moving between the two processes.

Gemma 3 270M (float32, test_server_e2e's engine settings: its compiled programs) through a
prefill and a decode replica whose ports are secured (TLS, client certificates signed by the
test CA, a shared token; the gateway calls them over ``grpcs://``, and with TLS the decode
replica pulls the pages through the prefill replica's secured port, ``--kv-transport auto``
picking grpc) gives the golden greedy continuations; a call to that port without the token ends
UNAUTHENTICATED, one with a stranger's certificate fails its TLS handshake (UNAVAILABLE), and a
gateway given the wrong token refuses to start. tiny-random (bfloat16, seeded sampling, plain
text, ``jax.experimental.transfer``) through the two hops equals one co-located replica; an offer
nobody pulls is freed at ``--kv-transfer-timeout``; a prefill replica killed mid-transfer fails
that request on the decode side, which frees its pages and keeps serving (last: it kills the
replica). Certificates: ``tests/support/engine_port_certs.py`` (trustme)."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import grpc
import openai
import pytest

from serving.cli import main as cli
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import PLAIN, ClientSecurity, open_channel
from serving.rpc.remote_engine import CHANNEL_OPTIONS
from tests.support.engine_helpers import agree_until_near_tie
from tests.support.engine_port_certs import make_port_files
from tests.support.gemma_engine import SERVER_ARGS as GEMMA_SERVER_ARGS
from tests.support.replica_processes import ENGINE_ARGS, start_engine, trace, wait_for, wait_healthy
from tests.support.server_process import serve_process

GEMMA_ARGS = [*GEMMA_SERVER_ARGS, "--dtype", "float32"]  # the Gemma tests' shape family
PAGE_SIZE = 16  # the default
CHUNK_PAGES = 16  # --kv-chunk-pages' default


def start_pair(tmp, args: list[str], prefill_extra: list[str] = (), scheme: str = "grpc",
               security: ClientSecurity = PLAIN) -> dict[str, tuple]:
    """A prefill and a decode replica (one after the other: the second loads what the first
    compiled); ``scheme`` grpcs and ``security`` the client's side when ``args`` secure the port."""
    out = {}
    try:
        for role, extra in (("prefill", list(prefill_extra)), ("decode", [])):
            log = tmp / f"{role}.log"
            proc, url = start_engine(log, [*args, "--role", role, *extra], scheme=scheme)
            out[role] = (proc, url)
            wait_healthy(proc, url, log, security)
    except BaseException:  # a replica that never became healthy: no process outlives the test
        stop(out)
        raise
    return out


def stop(procs: dict[str, tuple]) -> None:
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- Gemma: golden continuations through the router, over secured ports ----------------------


@pytest.fixture(scope="module")
def gemma_pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma_pd")
    certs = make_port_files(tmp)
    port_flags = ["--grpc-tls-cert", certs.server_cert, "--grpc-tls-key", certs.server_key,
                  "--grpc-client-ca", certs.ca, "--grpc-token-file", certs.token]
    security = ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key, certs.token)
    procs = {}
    try:
        procs.update(start_pair(tmp, [*GEMMA_ARGS, *map(str, port_flags)], scheme="grpcs", security=security))
        engines = ",".join(url for _, url in procs.values())
        gateway_flags = ["--engines", engines, "--grpc-ca-file", certs.ca, "--grpc-client-cert", certs.client_cert,
                         "--grpc-client-key", certs.client_key, "--grpc-token-file", certs.token]
        with serve_process(list(map(str, gateway_flags)), tmp / "gateway.log") as (_, gateway, _):
            yield gateway, {role: url for role, (_, url) in procs.items()}, certs, tmp
    finally:
        stop(procs)


@pytest.mark.slow(40)
def test_gemma_golden_through_a_prefill_and_a_decode_replica(gemma_pd, golden):
    """The 8 golden prompts, concurrently, through a gateway, a prefill replica and a decode
    replica over secured ports: the golden continuations, each hop's replica in the trace, the
    full pages moved.

    Slow: two Gemma 3 270M replica processes start (their module fixture) and compile the prompt
    and decode shapes of 8 prompts (the 712-token one in three chunks) at first use: ~40 s cold
    (72 s with the prompts one after another)."""
    gateway, urls, _, _ = gemma_pd
    assert all(url.startswith("grpcs://") for url in urls.values())
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    page_bytes = 2 * 18 * 1 * PAGE_SIZE * 256 * 4  # K and V of 18 layers, 1 KV head, head_dim 256, float32
    moved = 0

    def complete(p):
        return client.completions.create(model=model, prompt=p["ids"], max_tokens=24, temperature=0, logprobs=0,
                                         extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})

    # all 8 at once: they prefill and move their pages side by side and decode in shared steps
    with concurrent.futures.ThreadPoolExecutor(len(golden["prompts"])) as pool:
        responses = list(pool.map(complete, golden["prompts"]))
    for p, r in zip(golden["prompts"], responses):
        ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        agree_until_near_tie(ids, p)
        t = trace(gateway, r.id)
        assert (t["prefill_replica"], t["decode_replica"]) == (urls["prefill"], urls["decode"]), p["name"]
        full_pages = (p["num_tokens"] - 1) // PAGE_SIZE  # the partial last page is computed on the decode side
        chunks = -(-full_pages // CHUNK_PAGES)
        assert t["kv_transfer_bytes"] == chunks * CHUNK_PAGES * page_bytes, p["name"]
        assert t["usage"]["prompt_tokens"] == p["num_tokens"] and t["status"] == "ok"
        moved += t["kv_transfer_bytes"]
    assert moved > 0, "the long prompt's 44 full pages moved"
    client.close()


def health(url: str, security: ClientSecurity) -> grpc.RpcError | pb.HealthResponse:
    with open_channel(url, security) as ch:
        try:
            return pb_grpc.EngineServiceStub(ch).Health(pb.HealthRequest(), timeout=10)
        except grpc.RpcError as e:
            return e


def test_a_secured_replica_refuses_a_missing_token_and_a_strangers_certificate(gemma_pd):
    _, urls, c, _ = gemma_pd
    url = urls["prefill"]
    assert health(url, ClientSecurity.from_files(c.ca, c.client_cert, c.client_key, c.token)).ready
    for token in (None, c.wrong_token):
        e = health(url, ClientSecurity.from_files(c.ca, c.client_cert, c.client_key, token))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in e.details(), token
    for cert, key in ((None, None), (c.stranger_cert, c.stranger_key)):
        e = health(url, ClientSecurity.from_files(c.ca, cert, key, c.token))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, cert  # the TLS handshake fails: no call is made


def test_a_gateway_with_the_wrong_token_refuses_to_start(gemma_pd, capsys):
    _, urls, c, tmp = gemma_pd
    argv = ["serve", "--engines", urls["prefill"], "--grpc-ca-file", c.ca, "--grpc-client-cert", c.client_cert,
            "--grpc-client-key", c.client_key, "--grpc-token-file", c.wrong_token,
            "--database-url", f"sqlite:///{tmp / 'refused.db'}"]
    assert cli.main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert f"engine replica {urls['prefill']} refused this gateway" in err and "--grpc-token-file" in err, err


# -- tiny-random: equality, the timeout, a prefill replica killed mid-transfer ------------------


@pytest.fixture(scope="module")
def tiny_pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_pd")
    procs = start_pair(tmp, ENGINE_ARGS, prefill_extra=["--kv-transfer-timeout", "3"])
    try:
        yield procs
    finally:
        stop(procs)


def stub(url: str):
    ch = grpc.insecure_channel(url.removeprefix("grpc://"), options=CHANNEL_OPTIONS)
    return ch, pb_grpc.EngineServiceStub(ch)


def generate(s, rid: str, ids, **fields) -> list[pb.GenerateResponse]:
    sampling = pb.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.0)
    return list(s.Generate(pb.GenerateRequest(request_id=rid, prompt_ids=ids, sampling=sampling, **fields),
                           timeout=120))


def offer(s, rid: str, ids, source_url: str) -> pb.KvTransfer:
    last = generate(s, rid, ids, kv_produce=True)[-1]
    assert last.WhichOneof("event") == "complete", last
    o = pb.KvTransfer()
    o.CopyFrom(last.complete.kv_transfer)
    o.source_url = source_url
    return o


def tokens(responses) -> list[int]:
    out = []
    for m in responses:
        ev = getattr(m, m.WhichOneof("event"))
        out.extend((ev if m.WhichOneof("event") == "tokens" else ev.last).token_ids)
    return out


def pages_used(s) -> int:
    """KV pages held on a replica as of its loop's last turn (a turn lags an event by < 0.5 s)."""
    return s.GetLoad(pb.LoadRequest(), timeout=5).kv_pages_used


def settles_at(s, pages: int, what: str, timeout_s: float = 60.0) -> None:
    wait_for(lambda: pages_used(s) == pages, what, timeout_s)


def prompt(n: int, offset: int) -> list[int]:
    return [2] + [(11 * i + offset) % 400 + 100 for i in range(n - 1)]


def test_tiny_seeded_bf16_through_two_hops_equals_a_colocated_replica(tiny_pd):
    (_, purl), (_, durl) = tiny_pd["prefill"], tiny_pd["decode"]
    (pch, ps), (dch, ds) = stub(purl), stub(durl)
    ids = prompt(300, 1)  # 18 full pages: 2 chunks
    colocated = tokens(generate(ps, "whole", ids))  # the prefill replica is a whole engine too
    o = offer(ps, "hop1", ids, purl)
    assert o.num_tokens == 18 * PAGE_SIZE and o.transport == "jax"
    responses = generate(ds, "hop2", ids, kv_transfer=o)
    assert tokens(responses) == colocated and len(colocated) == 16
    last = responses[-1].complete.last
    assert last.kv_transfer_bytes > 0 and last.kv_transfer_seconds > 0
    settles_at(ps, 0, "the prefill replica to free the pulled pages")
    settles_at(ds, 0, "the decode replica to free the request's pages")
    pch.close()
    dch.close()


def test_an_offer_never_pulled_is_freed_after_the_kv_transfer_timeout(tiny_pd):
    _, purl = tiny_pd["prefill"]
    ch, s = stub(purl)
    o = offer(s, "unpulled", prompt(100, 2), purl)
    settles_at(s, o.num_tokens // PAGE_SIZE, "the offer to hold its pages alone")
    settles_at(s, 0, "the --kv-transfer-timeout to free them")
    ch.close()


def test_a_prefill_replica_killed_mid_transfer_fails_the_request_and_the_decode_side_keeps_serving(tiny_pd):
    pproc, purl = tiny_pd["prefill"]
    _, durl = tiny_pd["decode"]
    (pch, ps), (dch, ds) = stub(purl), stub(durl)
    ids = prompt(400, 3)
    o = offer(ps, "doomed", ids, purl)
    settles_at(ds, 0, "a quiet decode replica")
    os.kill(pproc.pid, signal.SIGSTOP)  # it stops answering: the decode side's pull is under way ...
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, ds, "orphan", ids, kv_transfer=o)
        wait_for(lambda: pages_used(ds) > 0, "the decode side to reserve the request's pages")
        pproc.kill()  # ... when the prefill replica dies
        pproc.wait()
        responses = pending.result(timeout=120)
    last = responses[-1]
    assert last.WhichOneof("event") == "error" and last.error.code == pb.Error.ENGINE_ERROR, last
    assert "KV pages" in last.error.message or "prefill replica" in last.error.message, last.error.message
    assert "step failed" not in last.error.message, "the pull failed, not an engine step"
    settles_at(ds, 0, "the decode side to free the request's pages")
    after = generate(ds, "survivor", prompt(50, 4))
    assert after[-1].WhichOneof("event") == "complete" and len(tokens(after)) == 16
    pch.close()
    dch.close()
