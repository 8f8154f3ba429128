"""Who may call an engine port, in process on loopback (``serving.replica.port_security`` on the
server, ``serving.rpc.channel_security`` on the clients): a call without the token or with a wrong
one ends UNAUTHENTICATED, streaming methods included; mutual TLS refuses a client with no
certificate or one another CA signed, in the handshake; the gateway's client (``RemoteEngine``)
runs a request through TLS, client certificates and the token as it does in plain text; a
decode replica's KV pulls (``kv_transport``) use the same credentials; ``xlaserve engine``
refuses a port beyond loopback that authenticates no caller."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import grpc
import numpy as np
import pytest

from serving.cli import main as cli
from serving.cli.engine_port import check_exposure
from serving.contract.engine_client import EngineRequest, EngineStats, KvTransferParams, SamplingParams
from serving.replica.engine_service import EngineService, model_info, start_server
from serving.replica.kv_transport import KvTransferError, Transport
from serving.replica.port_security import REFUSED, PortSecurity
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import ClientSecurity, open_channel, parse_engine_url
from serving.rpc.remote_engine import RemoteEngine, fetch_model_info
from tests.support.engine_helpers import collect
from tests.support.engine_port_certs import make_port_files
from tests.support.tiny_engine import make_loop, prompt

INFO = pb.ModelInfo(model="stand-in", page_size=16)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_port_files(tmp_path_factory.mktemp("engine_port_certs"))


class StandIn:
    """An engine stand-in: healthy, idle, and holding KV offers for ``PullKv`` (no JAX)."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.connector = types.SimpleNamespace(transport=Transport("grpc"), release=self._release)

    def _release(self, transfer_id: str) -> bool:
        self.released.append(transfer_id)
        return True

    def is_ready(self) -> bool:
        return True

    async def ping(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats()


def on_port(security: PortSecurity, body, engine=None, info: pb.ModelInfo = INFO):
    """Runs ``body(port)`` (blocking client code, in a worker thread) against an engine service
    on a free loopback port served with ``security``; returns what it returns."""

    async def main():
        server, port = await start_server(EngineService(engine or StandIn(), info), "127.0.0.1", 0, security)
        try:
            return await asyncio.to_thread(body, port)
        finally:
            await server.stop(grace=None)

    return asyncio.run(main())


def refusal(url: str, security: ClientSecurity, streaming: bool = False) -> grpc.RpcError:
    """The error a call on ``url`` with ``security`` ends with (fails if it succeeds)."""
    with open_channel(url, security) as ch:
        stub = pb_grpc.EngineServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            if streaming:
                list(stub.SubscribeKvEvents(pb.KvEventsRequest(), timeout=5))
            else:
                stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
    return e.value


def test_the_token_is_checked_on_every_call(certs):
    port = PortSecurity.from_files(certs.server_cert, certs.server_key, token_file=certs.token)
    good = ClientSecurity.from_files(certs.ca, token_file=certs.token)

    def body(p):
        url = f"grpcs://127.0.0.1:{p}"
        assert fetch_model_info(url, timeout=5, security=good).model == "stand-in"
        out = {}
        for name, sec, streaming in (("none", ClientSecurity.from_files(certs.ca), False),
                                     ("wrong", ClientSecurity.from_files(certs.ca, token_file=certs.wrong_token),
                                      False),
                                     ("none, streaming", ClientSecurity.from_files(certs.ca), True)):
            e = refusal(url, sec, streaming)
            out[name] = (e.code(), e.details())
        return out

    refused = on_port(port, body)
    assert refused == {k: (grpc.StatusCode.UNAUTHENTICATED, REFUSED) for k in refused}, refused


def test_mutual_tls_refuses_a_client_without_a_certificate_or_with_a_strangers(certs):
    port = PortSecurity.from_files(certs.server_cert, certs.server_key, certs.ca, certs.token)

    def body(p):
        url = f"grpcs://127.0.0.1:{p}"
        good = ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key, certs.token)
        assert fetch_model_info(url, timeout=5, security=good).model == "stand-in"
        out = {}
        for name, cert, key in (("no certificate", None, None),
                                ("a stranger's", certs.stranger_cert, certs.stranger_key)):
            e = refusal(url, ClientSecurity.from_files(certs.ca, cert, key, certs.token))
            out[name] = e.code()
        # A client that does not trust the replica's CA refuses it in turn.
        out["untrusted server"] = refusal(url, ClientSecurity.from_files(None, certs.client_cert, certs.client_key,
                                                                          certs.token)).code()
        return out

    refused = on_port(port, body)
    # The handshake fails before any call: gRPC reports UNAVAILABLE, not UNAUTHENTICATED.
    assert refused == dict.fromkeys(refused, grpc.StatusCode.UNAVAILABLE), refused


def test_a_plain_text_port_with_a_token(certs):
    port = PortSecurity.from_files(token_file=certs.token)

    def body(p):
        url = f"grpc://127.0.0.1:{p}"
        assert fetch_model_info(url, timeout=5, security=ClientSecurity.from_files(token_file=certs.token)).model
        return refusal(url, ClientSecurity()).code()

    assert on_port(port, body) == grpc.StatusCode.UNAUTHENTICATED


def test_the_gateways_client_runs_a_request_through_tls_client_certificates_and_the_token(certs, jax_cache,
                                                                                          tiny_tokenizer):
    loop = make_loop()
    loop.tokenizer = tiny_tokenizer
    loop.start(warmup=False)
    info = model_info(loop, "tiny-random", tiny_tokenizer)
    port = PortSecurity.from_files(certs.server_cert, certs.server_key, certs.ca, certs.token)
    sampling = SamplingParams(max_tokens=8, temperature=0.0)

    async def main():
        local, _ = await collect(loop, EngineRequest("local", prompt(20), sampling, cache_salt="a"))
        server, p = await start_server(EngineService(loop, info), "127.0.0.1", 0, port)
        remote = RemoteEngine(f"grpcs://127.0.0.1:{p}", info, probe_interval=0.05,
                              security=ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key,
                                                                 certs.token))
        await remote.open()
        try:
            while not (remote.up and remote.kv_index.seq is not None):  # probe and KV events pass too
                await asyncio.sleep(0.01)
            far = [t async for ev in remote.generate(EngineRequest("far", prompt(20), sampling, cache_salt="b"))
                   for t in ev.token_ids]
            return local, far
        finally:
            await remote.close()
            await server.stop(grace=None)

    try:
        local, far = asyncio.run(main())
    finally:
        loop.stop()
    assert far == local and len(far) == 8


def test_kv_pulls_call_the_prefill_replica_with_the_transports_credentials(certs):
    """The decode side's ``PullKv``, ``Health`` and ``ReleaseKv`` (``kv_connector``) go through
    ``Transport.source_stub``: TLS, its client certificate and the token."""
    port = PortSecurity.from_files(certs.server_cert, certs.server_key, certs.ca, certs.token)
    prefill = StandIn()
    k = np.arange(2 * 1 * 2 * 4 * 8, dtype=np.float32).reshape(2, 1, 2, 4, 8)  # [L, H, chunk_pages, ps, D]
    prefill.connector.transport.offer("0123456789ab", [{"k": k, "v": -k}], time.time() + 60)
    params = KvTransferParams(transfer_id="0123456789ab", transport="grpc", num_tokens=8, chunk_pages=2,
                              page_shape=(2, 1, 4, 8), dtype="float32")
    good = Transport("grpc", security=ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key,
                                                                certs.token))
    tokenless = Transport("grpc", security=ClientSecurity.from_files(certs.ca, certs.client_cert, certs.client_key))

    def body(p):
        src = dataclasses.replace(params, source_url=f"grpcs://127.0.0.1:{p}")
        (chunk,) = good.pull(src, [0], time.time() + 30, alive=lambda: True)
        assert good.source_stub(src.source_url).Health(pb.HealthRequest(), timeout=5).ready
        assert good.source_stub(src.source_url).ReleaseKv(pb.ReleaseKvRequest(transfer_id=src.transfer_id),
                                                          timeout=5).released
        with pytest.raises(KvTransferError, match="UNAUTHENTICATED"):
            tokenless.pull(src, [0], time.time() + 30, alive=lambda: True)
        return chunk["k"], chunk["v"]

    gk, gv = on_port(port, body, engine=prefill)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, -k)
    assert prefill.released == ["0123456789ab"]


def test_engine_urls():
    assert parse_engine_url("grpcs://engine-0.xlaserve-engine:50051") == "engine-0.xlaserve-engine:50051"
    assert parse_engine_url("grpc://127.0.0.1:1") == "127.0.0.1:1" == parse_engine_url("127.0.0.1:1")
    for bad in ("https://h:1", "grpcs://h", "grpc://:1"):
        with pytest.raises(ValueError):
            parse_engine_url(bad)


def test_a_port_beyond_loopback_that_authenticates_no_caller_refuses_to_start(certs, capsys):
    assert cli.main(["engine", "--host", "0.0.0.0", "--grpc-port", "0", "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert "refusing to serve the engine port on 0.0.0.0" in err
    assert "--grpc-token-file" in err and "--grpc-client-ca" in err and "--insecure-engine-port" in err
    tls_only = PortSecurity.from_files(certs.server_cert, certs.server_key)
    with pytest.raises(ValueError, match="refusing"):
        check_exposure("10.0.0.5", tls_only, insecure=False)  # TLS alone lets anyone in
    for host, security, insecure in (("127.0.0.1", PortSecurity(), False), ("0.0.0.0", PortSecurity(), True),
                                     ("0.0.0.0", PortSecurity(token="t"), False),
                                     ("0.0.0.0", PortSecurity.from_files(certs.server_cert, certs.server_key,
                                                                         certs.ca), False)):
        check_exposure(host, security, insecure)
    assert cli.main(["engine", "--grpc-port", "0", "--grpc-client-ca", str(certs.ca)]) == 2
    assert "--grpc-client-ca (mutual TLS) needs TLS" in capsys.readouterr().err
    assert cli.main(["engine", "--grpc-port", "0", "--grpc-token-file", str(certs.ca.parent / "missing")]) == 2
    assert "cannot read the engine token file" in capsys.readouterr().err


def test_a_replica_calls_its_peers_with_its_own_certificate_and_ca_by_default(certs):
    """``xlaserve engine``'s KV pulls: ``--grpc-ca-file`` defaults to ``--grpc-client-ca``, the client
    certificate to the port's own, and the token is the port's."""
    from serving.cli.engine_port import client_security

    args = types.SimpleNamespace(grpc_ca_file=None, grpc_client_cert=None, grpc_client_key=None,
                                 grpc_client_ca=str(certs.ca), grpc_tls_cert=str(certs.server_cert),
                                 grpc_tls_key=str(certs.server_key), grpc_token_file=str(certs.token))
    peer = client_security(args, peer=True)
    assert peer.root_certificates == certs.ca.read_bytes()
    assert peer.certificate_chain == certs.server_cert.read_bytes()
    assert peer.private_key == certs.server_key.read_bytes() and peer.token == "s3cret-engine-token"
    gateway = client_security(args)  # serve's: nothing borrowed from a port it does not have
    assert gateway.root_certificates is None and gateway.certificate_chain is None
