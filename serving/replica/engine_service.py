"""The engine service: one in-process engine loop served over gRPC (``xlaserve engine``).

Implements ``serving/rpc/engine.proto`` over an
:class:`~serving.runtime.engine_loop.EngineLoop` (any object with its ``submit``,
``cancel``, ``stats``, ``is_ready``, ``ping`` and ``kv_events``):

- ``Generate``: submits the request and streams its events; the stream ends
  with exactly one ``Complete`` (stop, length, cancelled) or ``Error`` (not
  admitted: OVERLOADED / REJECTED; failed: ENGINE_ERROR). A caller that goes
  away (cancels the call, or its connection breaks) cancels the request.
- ``Abort``: cancels by id; the request's pages are free before the loop plans
  its next step.
- ``Health``: ready only if the loop is ready *and* its thread answers a ping
  within ``health_timeout`` seconds (a wedged loop is not healthy, however
  well its socket answers).
- ``GetModelInfo``, ``GetLoad``: the model, its limits and tokenizer files;
  the loop's load from its last turn; both name the LoRA adapters served now with
  their digests (the router follows them through ``GetLoad``).
- ``LoadLora``, ``UnloadLora``: the loop's ``load_lora`` / ``unload_lora`` (the gateway
  sends them to every replica); refusals as gRPC status codes (INVALID_ARGUMENT, NOT_FOUND,
  FAILED_PRECONDITION while requests use the adapter).
- ``SubscribeKvEvents``: the prefix cache's page hashes (``serving.core.kv.kv_events``).
- ``PullKv``, ``ReleaseKv``: KV transfer (``serving.replica.kv_connector``): the chunks of
  an offer, as host bytes (the ``grpc`` transport), and the decode side's word
  that it has them (the pages are freed at the loop's next turn).

Who may call it: :class:`~serving.replica.port_security.PortSecurity` (TLS, client
certificates, the shared token checked on every call).

Server settings: keepalive pings from clients every 10 s are allowed (the
gateway sends them to notice a dead peer); messages up to 64 MiB (the
tokenizer files).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc

from serving.contract.engine_client import EngineOverloadedError, LoraInUseError, RequestRejectedError
from serving.replica.port_security import PortSecurity
from serving.rpc import convert
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc

log = logging.getLogger("xlaserve.engine_service")

SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class EngineService(pb_grpc.EngineServiceServicer):
    """The engine service's handlers.

    Args:
      engine: the engine loop.
      model_info: the ``GetModelInfo`` answer (:func:`model_info`).
      health_timeout: seconds the loop thread has to answer a health ping.
    """

    def __init__(self, engine: Any, model_info: pb.ModelInfo, health_timeout: float = 10.0) -> None:
        self.engine = engine
        self.model_info = model_info
        self.health_timeout = health_timeout

    async def Generate(self, request: pb.GenerateRequest, context):
        req = convert.request_from_proto(request)
        try:
            events = self.engine.submit(req)
        except EngineOverloadedError as e:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.OVERLOADED, message=str(e)))
            return
        except RequestRejectedError as e:
            yield pb.GenerateResponse(error=pb.Error(code=pb.Error.REJECTED, message=str(e)))
            return
        # Closing the engine's stream early (the call was cancelled) cancels the request.
        async with contextlib.aclosing(events) as stream:
            async for ev in stream:
                yield convert.event_to_proto(ev)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        await self.engine.cancel(request.request_id)
        return pb.AbortResponse()

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        if not self.engine.is_ready():
            return pb.HealthResponse(ready=False, message="the engine is starting or draining")
        try:
            await asyncio.wait_for(self.engine.ping(), self.health_timeout)
        except asyncio.TimeoutError:
            return pb.HealthResponse(ready=False, message=f"the engine loop did not answer within "
                                                          f"{self.health_timeout:g} s")
        return pb.HealthResponse(ready=True)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfo:
        info = pb.ModelInfo()
        info.CopyFrom(self.model_info)
        info.serves_lora = bool(getattr(self.engine, "serves_lora", False))
        info.loras.extend(convert.loras_to_proto(lora_digests(self.engine)))
        return info

    async def GetLoad(self, request: pb.LoadRequest, context) -> pb.Load:
        load = convert.load_to_proto(self.engine.stats())
        load.loras.extend(convert.loras_to_proto(lora_digests(self.engine)))
        return load

    async def LoadLora(self, request: pb.LoadLoraRequest, context) -> pb.LoraAdapter:
        try:
            await self.engine.load_lora(request.name, request.path)
        except ValueError as e:  # no LoRA here, the name is taken, LoraAdapterError (says why)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.LoraAdapter(name=request.name, digest=lora_digests(self.engine).get(request.name, ""))

    async def UnloadLora(self, request: pb.UnloadLoraRequest, context) -> pb.UnloadLoraResponse:
        try:
            await self.engine.unload_lora(request.name)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.name!r} is served")
        except LoraInUseError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:  # no LoRA on this engine
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.UnloadLoraResponse()

    async def PullKv(self, request: pb.PullKvRequest, context):
        from serving.replica.kv_transport import chunk_messages

        connector = self.engine.connector
        offered = connector.transport.offers.get(request.transfer_id) if connector is not None else None
        if offered is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV transfer {request.transfer_id!r} "
                                                           f"(expired, released, or never offered)")
        messages = chunk_messages(offered, list(request.chunks))
        while True:  # each chunk's host copy waits for its device copy: off the event loop
            m = await asyncio.to_thread(next, messages, None)
            if m is None:
                return
            yield m

    async def ReleaseKv(self, request: pb.ReleaseKvRequest, context) -> pb.ReleaseKvResponse:
        connector = self.engine.connector
        return pb.ReleaseKvResponse(released=connector is not None and connector.release(request.transfer_id))

    async def SubscribeKvEvents(self, request: pb.KvEventsRequest, context):
        sub = self.engine.kv_events.subscribe()
        try:
            s = sub.snapshot
            yield pb.KvEventBatch(seq=s.seq, snapshot=True, stored=s.stored, host_stored=s.host_stored)
            while True:
                b = await sub.next()
                yield pb.KvEventBatch(seq=b.seq, stored=b.stored, removed=b.removed,
                                      host_stored=b.host_stored, host_removed=b.host_removed)
        finally:
            sub.close()


def lora_digests(engine: Any) -> dict[str, str]:
    """{adapter name: digest} the engine loop serves now (``EngineLoop.lora_digests``; {} for
    an engine without that method)."""
    return getattr(engine, "lora_digests", dict)()


def model_info(engine: Any, model_name: str, tokenizer: Any, role: str = "both",
               kv_transport: str = "", labels: dict[str, str] | None = None) -> pb.ModelInfo:
    """The ``GetModelInfo`` answer of an engine loop serving ``model_name`` with ``tokenizer``
    (``labels``: the replica's ``--labels``, e.g. {"region": "eu-west", "zone": "b"})."""
    from model.tokenizer_files import tokenizer_files, tokenizer_id

    files = tokenizer_files(tokenizer)
    cfg = engine.cfg
    return pb.ModelInfo(
        model=model_name, max_model_len=engine.max_model_len, kv_capacity_tokens=engine.kv_capacity_tokens,
        page_size=cfg.page_size, num_pages=cfg.num_pages, role=role, tokenizer_id=tokenizer_id(files),
        tokenizer_files=files, max_slots=cfg.max_slots, prefix_caching=engine.kv.enable_prefix_caching,
        kv_transport=kv_transport, labels=labels or {}, kv_format=engine.kv.kv_format)


async def start_server(service: EngineService, host: str, port: int,
                       security: PortSecurity | None = None) -> tuple[grpc.aio.Server, int]:
    """Starts serving ``service`` on ``host:port`` (0: a free port) on the running event loop.

    Args:
      security: TLS, client certificates and token (default: plain text, anyone may call;
        ``xlaserve engine`` refuses that beyond loopback unless told otherwise).

    Returns:
      (the server, the port bound).

    Raises:
      RuntimeError: the port could not be bound.
    """
    security = security or PortSecurity()
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=security.interceptors())
    pb_grpc.add_EngineServiceServicer_to_server(service, server)
    if security.tls:
        bound = server.add_secure_port(f"{host}:{port}", security.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"could not bind the engine service to {host}:{port}")
    await server.start()
    return server, bound
