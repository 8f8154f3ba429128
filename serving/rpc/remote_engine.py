"""One engine replica over gRPC, as the gateway's router sees it.

:class:`RemoteEngine` calls a replica's engine service (``serving/rpc/engine.proto``,
served by ``xlaserve engine``): ``Generate`` as an async stream of
``TokenEvent``, ``Abort``, and, in background tasks while it is open,

- a **probe** every ``probe_interval`` seconds: ``GetLoad`` while the replica
  is up (its load, for routing and metrics), ``Health`` while it is down (it
  is taken back in once its engine answers);
- a **KV-event follower** (``SubscribeKvEvents``): a snapshot of the
  replica's cached page hashes, then the pages stored and removed, applied to
  :attr:`kv_index`; a gap in the batch numbers (a batch lost) is noticed and
  answered by subscribing again, which brings a fresh snapshot.

The LoRA adapters a replica serves (:attr:`RemoteEngine.loras`: name -> digest of its
weights and config) come with its ``GetModelInfo`` and every ``GetLoad``, so the router
follows adapters loaded or unloaded there within a probe interval; :meth:`RemoteEngine.load_lora`
and :meth:`RemoteEngine.unload_lora` change them (and update :attr:`loras` at once).

A replica is taken out (:attr:`up` False) when a call fails with a transport
error or a stream breaks; a request it was running ends with an "error" event
saying so, never a hang: keepalive pings (every 10 s, 5 s to answer) notice a
peer that vanished without closing its connection, and the replica's own
connection reset ends its streams at once. A request whose stream fails before
any event raises :class:`ReplicaUnavailable` instead, so the router can send it
to another replica.

Its channel is plain text for ``grpc://``, TLS for ``grpcs://``, and every call carries the
shared engine token when one is given (``serving.rpc.channel_security``).

No JAX here: the gateway uses this module.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from serving.contract.engine_client import (
    EngineOverloadedError,
    EngineRequest,
    EngineStats,
    LoraInUseError,
    RequestRejectedError,
    TokenEvent,
)
from serving.rpc import convert
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import PLAIN, ClientSecurity, open_aio_channel, open_channel
from serving.rpc.channel_security import parse_engine_url as parse_engine_url  # re-exported

log = logging.getLogger("xlaserve.remote")

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),  # GetModelInfo carries the tokenizer
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
"""Client channel settings: keepalive pings, the tokenizer-sized message limit, reconnect backoff."""

RPC_TIMEOUT_S = 5.0
"""Deadline of the unary calls (Abort, Health, GetLoad)."""
LORA_TIMEOUT_S = 120.0
"""Deadline of LoadLora / UnloadLora (the replica reads and checks the adapter's folder)."""


class ReplicaUnavailable(RuntimeError):
    """The replica could not take a request (its stream failed before any event)."""


def fetch_model_info(url: str, timeout: float = 10.0, security: ClientSecurity = PLAIN) -> pb.ModelInfo:
    """``GetModelInfo`` of the replica at ``url``, over a short-lived blocking channel
    (``serving.rpc.channel_security``: TLS for ``grpcs://``, the token if ``security`` has one).

    Raises:
      ValueError: a malformed URL.
      grpc.RpcError: the replica did not answer within ``timeout`` seconds; UNAUTHENTICATED:
        it refused the token (or its absence).
    """
    with open_channel(url, security, CHANNEL_OPTIONS) as channel:
        return pb_grpc.EngineServiceStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                                               wait_for_ready=True)


def info_mismatch(a: pb.ModelInfo, b: pb.ModelInfo) -> str | None:
    """Why two replicas cannot serve one model behind one router (None: they can)."""
    for field in ("model", "tokenizer_id", "page_size"):
        if getattr(a, field) != getattr(b, field):
            return f"{field} {getattr(a, field)!r} != {getattr(b, field)!r}"
    return None


class ReplicaKvIndex:
    """The cached page hashes of one replica, as its KV events tell them.

    Attributes:
      seq: the number of the last batch applied (None: no snapshot yet).
      keys: the cached page hashes (device prefix cache).
      host_keys: the page hashes in its host KV tier.
      resyncs: snapshots taken after the first (gaps, broken streams).
    """

    def __init__(self) -> None:
        self.seq: int | None = None
        self.keys: set[bytes] = set()
        self.host_keys: set[bytes] = set()
        self.resyncs = 0

    def reset(self, seq: int | None, keys=(), host_keys=()) -> None:
        """Starts over from a snapshot (None: nothing known)."""
        if seq is not None and self.seq is not None:
            self.resyncs += 1
        self.seq = seq
        self.keys = set(keys)
        self.host_keys = set(host_keys)

    def apply(self, seq: int, stored=(), removed=(), host_stored=(), host_removed=()) -> bool:
        """Applies batch ``seq``; False (nothing applied) when it is not the next one."""
        if self.seq is None or seq != self.seq + 1:
            return False
        self.keys.difference_update(removed)
        self.keys.update(stored)
        self.host_keys.difference_update(host_removed)
        self.host_keys.update(host_stored)
        self.seq = seq
        return True

    def matched_pages(self, hashes, pending=()) -> int:
        """How many of the leading page ``hashes`` are cached on device (or in ``pending``, a
        container of hashes about to be)."""
        n = 0
        for h in hashes:
            if h not in self.keys and h not in pending:
                break
            n += 1
        return n

    def matched_tiers(self, hashes, pending=()) -> tuple[int, int]:
        """(leading pages cached on device or pending, the host-tier pages right after them):
        the replica reloads the latter instead of computing them (as its lookup does)."""
        device = self.matched_pages(hashes, pending)
        host = 0
        for h in hashes[device:]:
            if h not in self.host_keys:
                break
            host += 1
        return device, host


class RemoteEngine:
    """An engine replica behind gRPC: one channel, its load, its cached pages.

    Args:
      url: ``grpc://host:port``, or ``grpcs://host:port`` for TLS.
      info: its ``GetModelInfo`` answer (:func:`fetch_model_info`), or None
        when it has not answered yet: it is then asked before it is taken in.
      probe_interval: seconds between load or health probes.
      expected: the model info every replica of the router must match
        (:func:`info_mismatch`); default: ``info``.
      security: the TLS material and token it is called with
        (``serving.rpc.channel_security``; default: none).

    Attributes:
      url: as given.
      info: as given.
      up: whether requests may be sent to it.
      load: its last ``GetLoad`` answer.
      loras: the LoRA adapters it serves, {name: digest} (its last ``GetModelInfo`` or ``GetLoad``).
      kv_index: its cached page hashes (:class:`ReplicaKvIndex`).
      drop_next_kv_batch: testing aid: discard the next KV batch received, as
        if it were lost on the way (the follower must notice the gap).
    """

    def __init__(self, url: str, info: pb.ModelInfo | None, probe_interval: float = 0.5,
                 expected: pb.ModelInfo | None = None, security: ClientSecurity = PLAIN) -> None:
        if info is None and expected is None:
            raise ValueError("a replica that has not answered needs the expected model info")
        self.url = url
        self.target = parse_engine_url(url)
        self.security = security
        self._metadata = security.metadata  # on every call: the replica may check a token
        self.expected = expected or info
        self.info = info or self.expected  # the expected one until it answers
        self._verified = info is not None
        self._answered = info is not None  # its own info known (not only the expected one)
        self._refused: str | None = None  # why it was last refused (logged once)
        self.probe_interval = probe_interval
        self.up = False
        self.load = EngineStats()
        self.loras: dict[str, str] = convert.loras_from_proto(self.info.loras) if info is not None else {}
        self.kv_index = ReplicaKvIndex()
        self.drop_next_kv_batch = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineServiceStub | None = None
        self._tasks: list[asyncio.Task] = []
        self._kv_call = None
        self._up_event: asyncio.Event | None = None

    @property
    def page_size(self) -> int:
        return self.info.page_size

    @property
    def kv_format(self) -> str:
        """Its quantized KV format ("int8", "fp8"; "" unquantized): part of its page hashes."""
        return self.info.kv_format

    @property
    def role(self) -> str:
        """both | prefill | decode (``GetModelInfo``; both for replicas that predate roles)."""
        return self.info.role or "both"

    @property
    def labels(self) -> dict[str, str]:
        """Its ``--labels`` (``GetModelInfo``; kept while it is down): {} until it first answers."""
        return dict(self.info.labels) if self._answered else {}

    @property
    def region(self) -> str:
        """Its ``region`` label ("" when it has none or has not answered yet)."""
        return self.labels.get("region", "")

    @property
    def serves_lora(self) -> bool:
        """Whether it takes LoRA adapters (``GetModelInfo``)."""
        return self.info.serves_lora

    @property
    def kv_transport(self) -> str:
        """How it moves KV pages: jax | grpc ("" for a replica that takes no part)."""
        return self.info.kv_transport

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        """Opens the channel (on the running event loop) and starts the probe and KV follower."""
        self._channel = open_aio_channel(self.url, self.security, CHANNEL_OPTIONS)
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        self._up_event = asyncio.Event()
        self._tasks = [asyncio.create_task(self._probe(), name=f"probe {self.url}"),
                       asyncio.create_task(self._follow_kv(), name=f"kv events {self.url}")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    def mark_down(self, why: str) -> None:
        """Takes the replica out until a health probe answers ready."""
        if self.up:
            log.warning("engine replica %s taken out: %s", self.url, why)
        self.up = False
        self._verified = False  # whatever answers there next is asked what it serves
        if self._up_event is not None:
            self._up_event.clear()
        if self._kv_call is not None:
            self._kv_call.cancel()

    def _mark_up(self) -> None:
        if not self.up:
            log.info("engine replica %s is up", self.url)
        self.up = True
        self._up_event.set()

    async def _probe(self) -> None:
        while True:
            try:
                if self.up or (await self._verify() and (await self.health()).ready):
                    self.load, self.loras = await self._get_load_and_loras()
                    self._mark_up()
            except grpc.aio.AioRpcError as e:
                self.mark_down(f"{e.code().name}: {e.details()}")
            await asyncio.sleep(self.probe_interval)

    async def _verify(self) -> bool:
        """Whether the replica serves the expected model (asks it once, when it first answers)."""
        if not self._verified:
            info = await self._stub.GetModelInfo(pb.ModelInfoRequest(), timeout=RPC_TIMEOUT_S,
                                                  metadata=self._metadata)
            why = info_mismatch(info, self.expected)
            if why is not None:
                if why != self._refused:
                    log.error("engine replica %s is not taken in: it serves another model (%s)", self.url, why)
                self._refused = why
                return False
            self.info, self._verified, self._refused, self._answered = info, True, None, True
            self.loras = convert.loras_from_proto(info.loras)
        return True

    async def _follow_kv(self) -> None:
        while True:
            await self._up_event.wait()
            self._kv_call = call = self._stub.SubscribeKvEvents(pb.KvEventsRequest(), metadata=self._metadata)
            try:
                async for batch in call:
                    if batch.snapshot:
                        self.kv_index.reset(batch.seq, batch.stored, batch.host_stored)
                    elif self.drop_next_kv_batch:
                        self.drop_next_kv_batch = False
                    elif not self.kv_index.apply(batch.seq, batch.stored, batch.removed,
                                                 batch.host_stored, batch.host_removed):
                        log.warning("engine replica %s: KV event %d after %s: events lost, resubscribing",
                                    self.url, batch.seq, self.kv_index.seq)
                        break
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    self.mark_down(f"KV events stream failed: {e.code().name}: {e.details()}")
            finally:
                call.cancel()
                self._kv_call = None
            if not self.up:
                self.kv_index.reset(None)  # stale: nothing is known until the next snapshot

    # -- requests ------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """The request's events; leaving early cancels the call (the replica cancels the request).

        Raises:
          ReplicaUnavailable: the stream failed before its first message.
          EngineOverloadedError, RequestRejectedError: the replica did not admit it.
        """
        rid = request.request_id
        call = self._stub.Generate(convert.request_to_proto(request), metadata=self._metadata)
        received = False
        try:
            async for m in call:
                received = True
                kind = m.WhichOneof("event")
                if kind == "tokens":
                    yield convert.event_from_proto(rid, m.tokens)
                elif kind == "complete":
                    yield convert.event_from_proto(
                        rid, m.complete.last, m.complete.finish_reason, m.complete.message or None,
                        m.complete.kv_transfer if m.complete.HasField("kv_transfer") else None)
                    return
                else:
                    if m.error.code == pb.Error.OVERLOADED:
                        raise EngineOverloadedError(m.error.message)
                    if m.error.code == pb.Error.REJECTED:
                        raise RequestRejectedError(m.error.message)
                    yield convert.event_from_proto(rid, m.error.last, "error", m.error.message)
                    return
            yield TokenEvent(rid, (), "error", error=f"engine replica {self.url} ended the stream early")
        except grpc.aio.AioRpcError as e:
            self.mark_down(f"Generate failed: {e.code().name}: {e.details()}")
            if not received:
                raise ReplicaUnavailable(f"{self.url}: {e.code().name}: {e.details()}") from None
            yield TokenEvent(rid, (), "error", error=f"engine replica {self.url} failed mid-stream: "
                                                      f"{e.code().name}: {e.details()}")
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> None:
        """Asks the replica to end the request (errors are logged: a broken replica ends it anyway)."""
        try:
            await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=RPC_TIMEOUT_S,
                                   metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            log.warning("Abort(%s) on %s failed: %s", request_id, self.url, e.code().name)

    async def release_kv(self, transfer_id: str) -> None:
        """Tells a prefill replica an offer will not be pulled (errors are logged: it frees the
        pages at its timeout anyway)."""
        try:
            await self._stub.ReleaseKv(pb.ReleaseKvRequest(transfer_id=transfer_id), timeout=RPC_TIMEOUT_S,
                                       metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            log.warning("ReleaseKv(%s) on %s failed: %s", transfer_id, self.url, e.code().name)

    async def health(self) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=RPC_TIMEOUT_S, metadata=self._metadata)

    async def get_load(self) -> EngineStats:
        return (await self._get_load_and_loras())[0]

    async def _get_load_and_loras(self) -> tuple[EngineStats, dict[str, str]]:
        m = await self._stub.GetLoad(pb.LoadRequest(), timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        return convert.load_from_proto(m), convert.loras_from_proto(m.loras)

    async def load_lora(self, name: str, path: str) -> str:
        """Serves the PEFT folder ``path`` (on the replica's machine) as adapter ``name`` there;
        returns its digest.

        Raises:
          ValueError: the replica refused it (the folder cannot be served, the name is taken,
            no LoRA there; the message says why).
          grpc.aio.AioRpcError: the call failed otherwise (the replica is down).
        """
        try:
            m = await self._stub.LoadLora(pb.LoadLoraRequest(name=name, path=path), timeout=LORA_TIMEOUT_S,
                                          metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise
        self.loras = {**self.loras, name: m.digest}
        return m.digest

    async def unload_lora(self, name: str) -> None:
        """Stops serving adapter ``name`` there.

        Raises:
          KeyError: the replica does not serve it.
          LoraInUseError: requests there use it (retry once they finish).
          grpc.aio.AioRpcError: the call failed otherwise.
        """
        try:
            await self._stub.UnloadLora(pb.UnloadLoraRequest(name=name), timeout=LORA_TIMEOUT_S,
                                        metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.loras = {n: d for n, d in self.loras.items() if n != name}
                raise KeyError(name) from None
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LoraInUseError(e.details()) from None
            raise
        self.loras = {n: d for n, d in self.loras.items() if n != name}
