"""KV transports: how a prompt's page chunks go from a prefill replica to a decode replica.

Two transports behind one interface, picked per replica (``--kv-transport``):

- ``jax``: ``jax.experimental.transfer``. Each replica starts a transfer server;
  the prefill side offers each chunk (``await_pull`` under its own uuid) and the
  decode side pulls the chunks it needs straight into its own device memory
  (tpu-inference's TPU connector pulls the same way). On GPUs and TPUs the copy
  goes device to device over the network without the host; it also runs between
  two CPU processes on loopback (JAX 0.10), which is what CI tests.
- ``grpc``: host staging over the engine service. The prefill side keeps the
  chunks; the decode side streams them with ``PullKv`` (one message per chunk,
  K and V, and a quantized cache's scale pages, as raw bytes) and writes them from host memory. The fallback where
  ``jax.experimental.transfer`` does not import (``auto`` picks it then).

A chunk is a page payload (``serving.engine.kv_pages``): {"k", "v"}, each ``[layers,
kv_heads, chunk_pages, page_size, head_dim]`` in the KV storage dtype, and with a quantized
format (``KvTransferParams.kv_format`` "int8" / "fp8") also {"k_scale", "v_scale"}, each
``[layers, kv_heads, chunk_pages, page_size]`` float32: the scales travel with their pages.

The decode side calls the prefill replica's engine service (``PullKv``, ``Health``,
``ReleaseKv``) at the URL the gateway knows it by, with the transport's
:class:`~serving.rpc.channel_security.ClientSecurity`: TLS for ``grpcs://``, its client
certificate and the shared token, as the gateway calls it. (``jax``'s own transfer
connection is not encrypted or authenticated by xlaserve: see docs/operator/disaggregation.md.)

A pull that cannot finish must not hang the decode side: ``jax``'s pull of an
offer that is gone (expired, or its process died) blocks until the connection
closes, so pulls run in worker threads that give up at the offer's
expiry and whenever the source's engine service stops answering ``Health``
(:func:`pull_chunks`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from serving.contract.engine_client import KvTransferParams
from serving.rpc import engine_pb2 as pb
from serving.rpc import engine_pb2_grpc as pb_grpc
from serving.rpc.channel_security import PLAIN, ClientSecurity, open_channel

log = logging.getLogger("xlaserve.kv_transport")

TRANSPORTS = ("auto", "jax", "grpc")
PROBE_INTERVAL_S = 0.5
"""How often a pull waiting on a ``jax`` transfer checks that its source still answers."""

Chunk = dict[str, object]  # a page payload: name -> device or host array

SCALE_DTYPE = np.dtype(np.float32)


def chunk_names(params: KvTransferParams) -> tuple[str, ...]:
    """The arrays of a chunk of an offer, in their wire order."""
    return ("k", "k_scale", "v", "v_scale") if params.kv_format else ("k", "v")


def _chunk_specs(params: KvTransferParams) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each array of a chunk of ``params``' offer."""
    shape = _chunk_shape(params)
    return {name: (shape[:-1], SCALE_DTYPE) if name.endswith("_scale") else (shape, np.dtype(params.dtype))
            for name in chunk_names(params)}


class KvTransferError(RuntimeError):
    """A pull failed: the source died, the offer expired, or the data did not fit."""


def _jax_transfer():
    from jax.experimental import transfer  # noqa: PLC0415 (optional: not in every jaxlib)

    return transfer


def resolve(kind: str) -> str:
    """``auto`` -> ``jax`` if ``jax.experimental.transfer`` imports, else ``grpc``.

    Raises:
      ValueError: an unknown transport; ``jax`` asked for where it does not import.
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    if kind == "grpc":
        return kind
    try:
        _jax_transfer()
        return "jax"
    except ImportError as e:
        if kind == "jax":
            raise ValueError(f"--kv-transport jax: jax.experimental.transfer does not import ({e})") from e
        return "grpc"


class _Offers:
    """Offered chunks by transfer id, with their expiry (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, list[Chunk]] = {}

    def put(self, transfer_id: str, chunks: list[Chunk]) -> None:
        with self._lock:
            self._offers[transfer_id] = chunks

    def get(self, transfer_id: str) -> list[Chunk] | None:
        with self._lock:
            return self._offers.get(transfer_id)

    def drop(self, transfer_id: str) -> None:
        with self._lock:
            self._offers.pop(transfer_id, None)


class Transport:
    """One replica's transport: offers chunks (prefill side) and pulls them (decode side).

    Args:
      kind: "jax" or "grpc" (:func:`resolve` first).
      host: the address the ``jax`` transfer server binds (the engine service's host).
      security: how the decode side calls a prefill replica's engine service (TLS material,
        client certificate, token; default: none).
    """

    def __init__(self, kind: str, host: str = "127.0.0.1", security: ClientSecurity = PLAIN) -> None:
        if kind not in ("jax", "grpc"):
            raise ValueError(f"a transport is jax or grpc, got {kind!r}")
        self.kind = kind
        self.security = security
        self.offers = _Offers()  # grpc: served by PullKv; jax: kept alive until released
        self._server = None
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()
        if kind == "jax":
            import jax

            self._server = _jax_transfer().start_transfer_server(
                jax.devices()[0].client, f"{host}:0", [f"{host}:0"])

    @property
    def address(self) -> str:
        """The ``jax`` transfer server's host:port ("" for grpc)."""
        return self._server.address() if self._server is not None else ""

    # -- prefill side ----------------------------------------------------------------

    def offer(self, transfer_id: str, chunks: list[Chunk], expires_at: float) -> None:
        """Makes ``chunks`` pullable until ``expires_at`` (wall-clock seconds) or :meth:`drop`."""
        self.offers.put(transfer_id, chunks)
        if self._server is not None:
            deadline = datetime.datetime.fromtimestamp(expires_at)
            for i, chunk in enumerate(chunks):
                self._server.await_pull(_uuid(transfer_id, i), [chunk[n] for n in sorted(chunk)],
                                        timeout=deadline)

    def drop(self, transfer_id: str) -> None:
        """Forgets an offer (pulled, or expired). A ``jax`` server drops an unpulled chunk
        itself at the expiry it was offered with."""
        self.offers.drop(transfer_id)

    # -- decode side -------------------------------------------------------------------

    def pull(self, params: KvTransferParams, chunk_ids: Sequence[int], deadline: float,
             alive: Callable[[], bool]) -> list[Chunk]:
        """The chunks ``chunk_ids`` of an offer, in order (blocks: call from a worker thread).

        Args:
          deadline: wall-clock seconds to give up at.
          alive: returns False once the source is known dead (checked while waiting).

        Raises:
          KvTransferError: the source died, the deadline passed, or the chunks do not fit.
        """
        if params.transport != self.kind:
            raise KvTransferError(f"the prefill replica offers pages over {params.transport!r}, "
                                  f"this replica pulls over {self.kind!r}")
        if self.kind == "grpc":
            return _pull_grpc(self.source_stub(params.source_url), params, chunk_ids, deadline)
        return self._pull_jax(params, chunk_ids, deadline, alive)

    def _pull_jax(self, params: KvTransferParams, chunk_ids: Sequence[int], deadline: float,
                  alive: Callable[[], bool]) -> list[Chunk]:
        import jax

        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        names = sorted(chunk_names(params))  # the order the offer listed them in
        specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=device)
                 for shape, dtype in (_chunk_specs(params)[n] for n in names)]
        with self._lock:
            conn = self._connections.get(params.transfer_address)
            if conn is None:
                conn = self._connections[params.transfer_address] = self._server.connect(params.transfer_address)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xlaserve-kv-pull")
        def pull_all():
            # A pull returns arrays whose bytes are still on the way: wait for them here, so a
            # source that dies mid-transfer fails this pull, not the engine step that reads them.
            return jax.block_until_ready([conn.pull(_uuid(params.transfer_id, c), specs)
                                          for c in chunk_ids])

        try:
            future = pool.submit(pull_all)
            while True:
                try:
                    return [dict(zip(names, arrays)) for arrays in future.result(timeout=PROBE_INTERVAL_S)]
                except concurrent.futures.TimeoutError:
                    pass
                except Exception as e:  # noqa: BLE001 (the transfer's own errors: the peer went away)
                    raise KvTransferError(f"pulling KV pages from {params.source_url} failed: {e}") from e
                if time.time() > deadline:
                    raise KvTransferError("the KV pages did not arrive before the offer expired")
                if not alive():
                    raise KvTransferError(f"the prefill replica {params.source_url} stopped answering "
                                          f"during the KV transfer")
        finally:
            pool.shutdown(wait=False)  # a pull blocked on a dead peer is left behind (daemon-like)

    def source_stub(self, url: str) -> pb_grpc.EngineServiceStub:
        """A (shared, thread-safe) stub of the source replica's engine service, called with this
        transport's security."""
        return source_stub(url, self.security)


def _uuid(transfer_id: str, chunk: int) -> int:
    """The ``jax`` uuid of one chunk of an offer: the id's 48 bits, then 16 bits of chunk index."""
    return (int(transfer_id, 16) << 16) | chunk


def new_transfer_id() -> str:
    """A fresh offer id: 12 hex digits (48 random bits; see :func:`_uuid`)."""
    return secrets.token_hex(6)


def _chunk_shape(params: KvTransferParams) -> tuple[int, ...]:
    L, H, ps, D = params.page_shape
    return (L, H, params.chunk_pages, ps, D)


_channels: dict[tuple[str, ClientSecurity], grpc.Channel] = {}
_channels_lock = threading.Lock()


def source_stub(url: str, security: ClientSecurity = PLAIN) -> pb_grpc.EngineServiceStub:
    """A (shared, thread-safe) stub of the source replica's engine service (``grpc://`` or
    ``grpcs://``), every call carrying ``security``'s token."""
    from serving.rpc.remote_engine import CHANNEL_OPTIONS

    with _channels_lock:
        ch = _channels.get((url, security))
        if ch is None:
            ch = _channels[(url, security)] = open_channel(
                url, security, CHANNEL_OPTIONS + [("grpc.max_send_message_length", 64 << 20)])
    return pb_grpc.EngineServiceStub(ch)


def _pull_grpc(stub: pb_grpc.EngineServiceStub, params: KvTransferParams, chunk_ids: Sequence[int],
               deadline: float) -> list[Chunk]:
    specs = _chunk_specs(params)
    try:
        stream = stub.PullKv(
            pb.PullKvRequest(transfer_id=params.transfer_id, chunks=list(chunk_ids)),
            timeout=max(0.1, deadline - time.time()))
        out = []
        for m in stream:
            chunk = {}
            for name, (shape, dtype) in specs.items():
                raw = getattr(m, name)
                size = int(np.prod(shape)) * dtype.itemsize
                if len(raw) != size:
                    raise KvTransferError(f"chunk {m.index}: {len(raw)} bytes of {name}, expected {size}")
                chunk[name] = np.frombuffer(raw, dtype).reshape(shape)
            out.append(chunk)
    except grpc.RpcError as e:
        raise KvTransferError(f"pulling KV pages from {params.source_url} failed: "
                              f"{e.code().name}: {e.details()}") from e
    if len(out) != len(chunk_ids):
        raise KvTransferError(f"the prefill replica sent {len(out)} of {len(chunk_ids)} chunks "
                              f"(the offer expired or was released)")
    return out


def chunk_messages(chunks: list[Chunk], chunk_ids: Sequence[int]):
    """``PullKv``'s messages for the offered ``chunks`` asked for (host copies, one per chunk)."""
    for c in chunk_ids:
        if not 0 <= c < len(chunks):
            return
        yield pb.KvChunk(index=c, **{name: np.asarray(a).tobytes() for name, a in chunks[c].items()})
