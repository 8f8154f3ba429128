"""The engine port secured, with real processes on loopback: one Gemma 3 270M ``xlaserve engine``
replica serving TLS, requiring client certificates signed by its CA and a shared token on every
call, and ``xlaserve serve --engines grpcs://...`` with the CA, its client certificate and the
token. Through them the golden greedy continuations come out as they do in plain text; a call
without the token ends UNAUTHENTICATED, one with a stranger's certificate fails its TLS handshake
(UNAVAILABLE); a gateway given the wrong token refuses to start.

The replica runs test_disaggregated's Gemma settings (float32; the compiled programs test_server_e2e
leaves in the cache). Certificates: ``tests/support/engine_port_certs.py`` (trustme)."""

from __future__ import annotations

import grpc
import openai
import pytest

from serving.cli import main as cli
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import ClientSecurity, open_channel
from tests.support.engine_helpers import agree_until_near_tie
from tests.support.engine_port_certs import make_port_files
from tests.support.replica_processes import start_engine, trace, wait_healthy
from tests.support.server_process import serve_process

GEMMA_ARGS = ["--max-slots", "8", "--num-pages", "1024", "--max-model-len", "2048", "--dtype", "float32"]
COLD_START_S = 1500  # a cold cache dequantizes the GGUF and compiles (over 15 minutes on 2 busy cores)


@pytest.fixture(scope="module")
def tls_replica(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_port_tls")
    certs = make_port_files(tmp)
    port_flags = ["--grpc-tls-cert", certs.server_cert, "--grpc-tls-key", certs.server_key,
                  "--grpc-client-ca", certs.ca, "--grpc-token-file", certs.token]
    proc, url = start_engine(tmp / "engine.log", [*GEMMA_ARGS, *map(str, port_flags)], scheme="grpcs")
    try:
        wait_healthy(proc, url, tmp / "engine.log", ClientSecurity.from_files(
            certs.ca, certs.client_cert, certs.client_key, certs.token), timeout_s=COLD_START_S)
        yield url, certs, tmp
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def gateway(tls_replica):
    url, certs, tmp = tls_replica
    args = ["--engines", url, "--grpc-ca-file", certs.ca, "--grpc-client-cert", certs.client_cert,
            "--grpc-client-key", certs.client_key, "--grpc-token-file", certs.token]
    with serve_process(list(map(str, args)), tmp / "gateway.log") as (_, gateway, _):
        yield gateway


def test_gemma_golden_through_tls_client_certificates_and_the_token(gateway, tls_replica, golden):
    url = tls_replica[0]
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    for p in golden["prompts"]:
        r = client.completions.create(model=model, prompt=p["ids"], max_tokens=24, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        agree_until_near_tie(ids, p)
        t = trace(gateway, r.id)
        assert t["replica"] == url and t["status"] == "ok", p["name"]
    client.close()


def call(url: str, security: ClientSecurity) -> grpc.RpcError | pb.HealthResponse:
    with open_channel(url, security) as ch:
        try:
            return pb_grpc.EngineServiceStub(ch).Health(pb.HealthRequest(), timeout=10)
        except grpc.RpcError as e:
            return e


def test_the_replica_refuses_a_missing_token_and_a_strangers_certificate(tls_replica):
    url, c, _ = tls_replica
    assert call(url, ClientSecurity.from_files(c.ca, c.client_cert, c.client_key, c.token)).ready
    for token in (None, c.wrong_token):
        e = call(url, ClientSecurity.from_files(c.ca, c.client_cert, c.client_key, token))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in e.details(), token
    for cert, key in ((None, None), (c.stranger_cert, c.stranger_key)):
        e = call(url, ClientSecurity.from_files(c.ca, cert, key, c.token))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, cert  # the TLS handshake fails: no call is made


def test_a_gateway_with_the_wrong_token_refuses_to_start(tls_replica, capsys):
    url, c, tmp = tls_replica
    argv = ["serve", "--engines", url, "--grpc-ca-file", c.ca, "--grpc-client-cert", c.client_cert,
            "--grpc-client-key", c.client_key, "--grpc-token-file", c.wrong_token,
            "--database-url", f"sqlite:///{tmp / 'refused.db'}"]
    assert cli.main(list(map(str, argv))) == 2
    err = capsys.readouterr().err
    assert f"engine replica {url} refused this gateway" in err and "--grpc-token-file" in err, err
