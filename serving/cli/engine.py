"""``xlaserve engine``: one engine replica behind the gRPC engine service, no HTTP.

    xlaserve engine --grpc-port 50051 --model tiny-random          # a replica, no HTTP
    xlaserve serve --engines grpc://127.0.0.1:50051,grpc://127.0.0.1:50052 --router kv-aware

    xlaserve engine --grpc-port 50061 --role prefill               # disaggregated: prompts here,
    xlaserve engine --grpc-port 50062 --role decode                # decoding there
    xlaserve serve --engines grpc://127.0.0.1:50061,grpc://127.0.0.1:50062

``engine`` takes every model and engine setting ``serve`` takes; multi-host
slices run it on every process, and process 0 serves gRPC while the others
follow in lockstep, as ``serve`` does with HTTP. SIGTERM drains: new requests
get OVERLOADED, open streams get ``drain_timeout`` seconds.

The gateway side, ``serve --engines``, is ``serving.cli.serve``'s.

Who may call the port (TLS, client certificates, a shared token; a port that
authenticates no caller refuses a non-loopback ``--host`` unless
``--insecure-engine-port``): ``serving.cli.engine_port``.

Roles (``--role``, reported in ``GetModelInfo``): every replica is a whole
engine with a KV connector (``serving.replica.kv_connector``), so any can compute a
prompt for another to decode or decode a prompt another computed; the role
tells the router what to send it. Given prefill and decode replicas, the router
sends each request's prompt to a prefill replica (kv-aware) and its decoding to
a decode replica (least load), the KV pages moving between them over
``--kv-transport``; ``both`` replicas serve requests whole. A decode replica
needs its prefix cache (received pages enter it). Multi-host replicas take no
part in KV transfer.

Labels (``--labels region=R,zone=Z``, reported in ``GetModelInfo``) say where the
replica runs; the gateway's router prefers replicas of its own ``--region`` and
crosses regions only when those are down or overloaded (docs/operator/replicas.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from serving.cli.bootstrap import (
    _is_leader,
    build_engine,
    freeze_startup_heap,
    join_processes,
    run_follower,
)
from serving.cli.engine_port import add_port_flags, check_exposure, client_security, port_security
from serving.cli.settings import _add_settings, _overrides

log = logging.getLogger("xlaserve")

ROLES = ("both", "prefill", "decode")
"""Replica roles: "both" serves requests whole; "prefill" computes prompts for "decode" replicas."""


def parse_labels(value: str | None) -> dict[str, str]:
    """``--labels KEY=VALUE,KEY=VALUE`` as a dict (None or "": no labels).

    Raises:
      ValueError: an item without ``=``, an empty key, or a key given twice.
    """
    labels: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not key:
            raise ValueError(f"--labels takes KEY=VALUE[,KEY=VALUE...], got {item.strip()!r}")
        if key in labels:
            raise ValueError(f"--labels: {key!r} given twice")
        labels[key] = val
    return labels


def register(sub) -> None:
    """Adds the ``engine`` subcommand to the CLI's subparsers."""
    engine = sub.add_parser("engine", help="run one engine replica as a gRPC service (no HTTP), for "
                            "`serve --engines`")
    _add_settings(engine)
    engine.add_argument("--grpc-port", type=int, required=True, help="port of the engine service (0: any free one)")
    engine.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    engine.add_argument("--skip-warmup", action="store_true",
                        help="serve without compiling the common step shapes first (as for serve)")
    engine.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                        help="both (default): computes prompts and decodes; prefill: computes prompts and "
                        "hands their KV pages to a decode replica; decode: pulls them, then decodes "
                        "(the gateway's router pairs them: serving/cli/engine.py)")
    engine.add_argument("--kv-transport", default="auto", choices=("auto", "jax", "grpc"),
                        help="how KV pages move between replicas: jax (jax.experimental.transfer), grpc "
                        "(host staging over the engine service); auto (default): jax where it imports, "
                        "grpc when the port has TLS or a token (jax's transfer port has neither)")
    engine.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                        help="seconds a prefill replica keeps a prompt's pages for a decode replica to "
                        "pull before it frees them (default 30)")
    engine.add_argument("--kv-chunk-pages", type=int, default=16,
                        help="KV pages per transfer message, every layer of each (default 16)")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None, help="turn the automatic prefix cache off")
    engine.add_argument("--labels", metavar="region=R,zone=Z",
                        help="where this replica runs, reported to gateways: the router prefers replicas "
                        "whose region label is the gateway's --region (default: no labels)")
    engine.add_argument("--served-model-name", help="the model id the gateway serves it as")
    engine.add_argument("--stream-buffer-events", type=int, default=None,
                        help="events a stream may fall behind before the request is cancelled (default 1024)")
    add_port_flags(engine)
    engine.set_defaults(func=cmd_engine)


def cmd_engine(args: argparse.Namespace) -> int:
    """Runs one engine replica behind the gRPC engine service until SIGTERM / SIGINT."""
    overrides = _overrides(args, ("enable_prefix_caching", "served_model_name", "stream_buffer_events"))
    from serving.config.server_config import load_server_config
    from serving.replica.engine_service import EngineService, model_info, start_server

    if args.role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {args.role!r}")
    labels = parse_labels(args.labels)
    security = port_security(args)  # before the engine: a refused start is quick
    check_exposure(args.host, security, args.insecure_engine_port)
    peers = client_security(args, peer=True)
    cfg = load_server_config(args.config, **overrides)
    if join_processes(cfg) and not _is_leader():  # multi-host: only process 0 serves gRPC
        return run_follower(cfg)
    if args.role == "decode" and cfg.enable_prefix_caching is False:
        raise ValueError("--role decode needs the prefix cache: received KV pages enter it")
    # A prefill replica's requests end at their first token: its decode programs compile on first use.
    loop, tokenizer, name = build_engine(cfg, warmup=not args.skip_warmup, warmup_decode=args.role != "prefill")
    if loop.engine.lockstep is None:
        from serving.replica.kv_connector import KvConnector
        from serving.replica.kv_transport import Transport, resolve

        kind = args.kv_transport
        if kind == "auto" and (security.tls or security.token is not None):
            kind = "grpc"  # the pages go through the secured engine port
        elif kind == "jax" and (security.tls or security.token is not None):
            log.warning("--kv-transport jax: KV pages move over jax's transfer port, which has neither the "
                        "engine port's TLS nor its token")
        transport = Transport(resolve(kind), args.host, security=peers)
        loop.connector = KvConnector(loop.engine, loop.kv, transport, timeout_s=args.kv_transfer_timeout,
                                     chunk_pages=args.kv_chunk_pages, wake=loop.wake)
    elif args.role != "both":
        raise ValueError(f"--role {args.role}: multi-host replicas take no part in KV transfer")
    info = model_info(loop, cfg.served_model_name or name, tokenizer, role=args.role,
                      kv_transport=loop.connector.transport.kind if loop.connector is not None else "",
                      labels=labels)

    async def serve() -> None:
        service = EngineService(loop, info)
        server, port = await start_server(service, args.host, args.grpc_port, security)
        log.info("engine replica of %s serving gRPC on %s:%d (%s), role %s%s", info.model, args.host, port,
                 security.describe(), args.role,
                 f", KV transport {info.kv_transport} (--kv-transport {args.kv_transport})"
                 if info.kv_transport else "")
        if labels:
            log.info("labels: %s", ", ".join(f"{k}={v}" for k, v in labels.items()))
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
