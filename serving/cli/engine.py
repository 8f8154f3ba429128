"""Replicas: ``xlaserve engine`` (one engine over gRPC) and the router a gateway builds for ``--engines``.

    xlaserve engine --grpc-port 50051 --model tiny-random          # a replica, no HTTP
    xlaserve serve --engines grpc://127.0.0.1:50051,grpc://127.0.0.1:50052 --router kv-aware

    xlaserve engine --grpc-port 50061 --role prefill               # disaggregated: prompts here,
    xlaserve engine --grpc-port 50062 --role decode                # decoding there
    xlaserve serve --engines grpc://127.0.0.1:50061,grpc://127.0.0.1:50062

``engine`` takes every model and engine setting ``serve`` takes; multi-host
slices run it on every process, and process 0 serves gRPC while the others
follow in lockstep, as ``serve`` does with HTTP. SIGTERM drains: new requests
get OVERLOADED, open streams get ``drain_timeout`` seconds.

``serve --engines`` loads no weights: it asks each replica for its model,
limits, tokenizer and chat template (``GetModelInfo``), waits until one
answers, checks the others serve the same model, tokenizer and page size when
they answer, and routes with :class:`serving.routing.router.Router`.

Roles (``--role``, reported in ``GetModelInfo``): every replica is a whole
engine with a KV connector (``serving.replica.kv_connector``), so any can compute a
prompt for another to decode or decode a prompt another computed; the role
tells the router what to send it. Given prefill and decode replicas, the router
sends each request's prompt to a prefill replica (kv-aware) and its decoding to
a decode replica (least load), the KV pages moving between them over
``--kv-transport``; ``both`` replicas serve requests whole. A decode replica
needs its prefix cache (received pages enter it). Multi-host replicas take no
part in KV transfer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

log = logging.getLogger("xlaserve")

ROLES = ("both", "prefill", "decode")
"""Replica roles: "both" serves requests whole; "prefill" computes prompts for "decode" replicas."""


def cmd_engine(args: argparse.Namespace, overrides: dict) -> int:
    """Runs one engine replica behind the gRPC engine service until SIGTERM / SIGINT."""
    from serving.cli.main import _is_leader, _is_loopback, build_engine, freeze_startup_heap
    from serving.replica.engine_service import EngineService, model_info, start_server
    from serving.config.server_config import load_server_config
    from serving.cli.shard_plan import join_processes, run_follower

    if args.role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {args.role!r}")
    cfg = load_server_config(args.config, **overrides)
    if join_processes(cfg) and not _is_leader():  # multi-host: only process 0 serves gRPC
        return run_follower(cfg)
    if args.role == "decode" and cfg.enable_prefix_caching is False:
        raise ValueError("--role decode needs the prefix cache: received KV pages enter it")
    # A prefill replica's requests end at their first token: its decode programs compile on first use.
    loop, tokenizer, name = build_engine(cfg, warmup_decode=args.role != "prefill")
    if loop.engine.lockstep is None:
        from serving.replica.kv_connector import KvConnector
        from serving.replica.kv_transport import Transport, resolve

        transport = Transport(resolve(args.kv_transport), args.host)
        loop.connector = KvConnector(loop.engine, loop.kv, transport, timeout_s=args.kv_transfer_timeout,
                                     chunk_pages=args.kv_chunk_pages, wake=loop.wake)
    elif args.role != "both":
        raise ValueError(f"--role {args.role}: multi-host replicas take no part in KV transfer")
    info = model_info(loop, cfg.served_model_name or name, tokenizer, role=args.role,
                      kv_transport=loop.connector.transport.kind if loop.connector is not None else "")

    async def serve() -> None:
        service = EngineService(loop, info)
        server, port = await start_server(service, args.host, args.grpc_port)
        log.info("engine replica of %s serving gRPC on %s:%d, role %s%s", info.model, args.host, port, args.role,
                 f", KV transport {info.kv_transport} (--kv-transport {args.kv_transport})"
                 if info.kv_transport else "")
        if not _is_loopback(args.host):
            log.warning("the engine service has no authentication: keep %s:%d on a private network",
                        args.host, port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        freeze_startup_heap()
        await stop.wait()
        log.info("draining: open streams get %.0f s", cfg.drain_timeout)
        loop.drain()
        await server.stop(grace=cfg.drain_timeout)

    try:
        asyncio.run(serve())
    finally:
        loop.stop()
        if loop.engine.lockstep is not None:
            loop.engine.lockstep.stop()
    return 0


def build_router(engine_urls: str, policy: str, prefill_weight: float = 2.0, balance_abs: int = 16,
                 balance_rel: float = 1.5, wait_log_s: float = 10.0):
    """The router over ``engine_urls`` (comma-separated ``grpc://host:port``), once one answers.

    Returns:
      (router, tokenizer, model name, the first replica's ModelInfo).

    Raises:
      ValueError: a malformed URL, an unknown policy, replicas that disagree.
    """
    import grpc

    from model.tokenizer_files import tokenizer_from_files
    from serving.routing import disaggregation
    from serving.routing.router import Router
    from serving.rpc.remote_engine import RemoteEngine, fetch_model_info, parse_engine_url

    urls = [u.strip() for u in engine_urls.split(",") if u.strip()]
    if not urls:
        raise ValueError("--engines needs at least one grpc://host:port")
    for u in urls:
        parse_engine_url(u)
    infos: dict[str, object] = {}
    last_log = time.monotonic()
    while not infos:
        for u in urls:
            try:
                infos[u] = fetch_model_info(u, timeout=2.0)
            except grpc.RpcError as e:
                if time.monotonic() - last_log > wait_log_s:
                    log.info("waiting for engine replica %s (%s)", u, getattr(e, "code", lambda: e)())
        if time.monotonic() - last_log > wait_log_s:
            last_log = time.monotonic()
    first = next(iter(infos.values()))
    replicas = [RemoteEngine(u, infos.get(u), expected=first) for u in urls]
    router = Router(replicas, policy=policy, prefill_weight=prefill_weight, balance_abs=balance_abs,
                    balance_rel=balance_rel)
    tokenizer = tokenizer_from_files(dict(first.tokenizer_files))
    roles = ", ".join(f"{u} {i.role or 'both'}" + (f" (KV over {i.kv_transport})" if i.role in ("prefill", "decode")
                                                    else "") for u, i in infos.items())
    log.info("routing %s (%s) over %d engine replicas, %d answering: %s", first.model, policy, len(urls),
             len(infos), roles)
    for why in disaggregation.unpaired(replicas):
        log.warning("%s", why)
    return router, tokenizer, first.model, first
