"""``xlaserve serve``: the OpenAI-compatible HTTP gateway over an engine in this process, or over
remote engine replicas (``--engines``: the router :func:`build_router` builds).

    xlaserve serve                       # Gemma 3 270M on 127.0.0.1:8000
    xlaserve serve --model tiny-random --port 8100
    xlaserve serve --engines grpc://127.0.0.1:50051,grpc://127.0.0.1:50052 --router kv-aware
    xlaserve serve --model path/to/embeddinggemma --task embed   # POST /v1/embeddings only
    xlaserve serve --model path/to/cross-encoder                   # --task rerank: /v1/rerank, /v1/score

``--task embed`` (``auto``: when the model's directory has ``modules.json``) serves a
sentence-transformers model through the embedding loop (``serving.cli.bootstrap.build_embedding_engine``).
``--task rerank`` (``auto``: when ``config.json`` names a ``*ForSequenceClassification``) serves a
cross-encoder, or a decoder scored by label tokens (``--rerank-template``), on the same loop
(``serving.cli.bootstrap.build_rerank_engine``).

``serve --engines grpcs://...`` reaches replicas over TLS; ``--grpc-ca-file``,
``--grpc-client-cert/--grpc-client-key`` and ``--grpc-token-file`` say what it trusts,
presents and sends (``serving.cli.engine_port``).

``serve --engines`` loads no weights: it asks each replica for its model,
limits, tokenizer and chat template (``GetModelInfo``), waits until one
answers, checks the others serve the same model, tokenizer and page size when
they answer, and routes with :class:`serving.routing.router.Router`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

from serving.cli.bootstrap import (
    _is_leader,
    _is_loopback,
    build_engine,
    freeze_startup_heap,
    join_processes,
    run_follower,
)
from serving.cli.engine_port import add_client_flags, check_engine_urls, client_security
from serving.cli.settings import _add_settings, _overrides
from serving.gateway.http.log_context import RequestIdLogFilter

log = logging.getLogger("xlaserve")


def register(sub) -> None:
    """Adds the ``serve`` subcommand to the CLI's subparsers."""
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_settings(serve)
    serve.add_argument("--task", default=None, choices=("auto", "generate", "embed", "rerank"),
                       help="generate (completions, chat, responses) | embed (a sentence-transformers model on "
                       "/v1/embeddings) | rerank (a cross-encoder, or a decoder scored by label tokens, on "
                       "/v1/rerank and /v1/score) | auto (default): rerank when config.json names a "
                       "*ForSequenceClassification, embed when the model's directory has modules.json")
    serve.add_argument("--rerank-template", default=None, metavar="PATH",
                       help="--task rerank with a decoder: a JSON file of prefix, body, suffix, instruction and "
                       "labels (default: Qwen3-Reranker's prompt and its no/yes tokens)")
    serve.add_argument("--embed-max-batch", type=int, default=None,
                       help="--task embed: most inputs in one step, a power of two (default 32)")
    serve.add_argument("--embed-max-batch-tokens", type=int, default=None,
                       help="--task embed: most padded tokens (inputs x length bucket) in one step (default 16384)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       default=None, help="turn the automatic prefix cache off")
    serve.add_argument("--skip-warmup", action="store_true",
                       help="serve without compiling the common step shapes first: each compiles "
                            "(or loads from the compilation cache) at its first use, stalling that "
                            "step's streams; for development and tests")
    serve.add_argument("--database-url", help="SQLAlchemy URL of the keys + usage ledger "
                       "(default: $XLASERVE_DATABASE_URL, else SQLite under the data dir)")
    serve.add_argument("--ledger-spool-dir", help="where usage rows wait, fsynced, while the ledger "
                       "database is unreachable (default: $XLASERVE_DATA_DIR/ledger-spool)")
    serve.add_argument("--ledger-spool-max-bytes", type=int, default=None,
                       help="the spool's bound; once full, new requests get 503 (default 256 MiB)")
    serve.add_argument("--redis-url", help="Redis that holds rate limits shared by every gateway using "
                       "it, redis://host:port/db (default: $XLASERVE_REDIS_URL, else limits per process)")
    serve.add_argument("--prices", help="price table YAML (default: configs/prices.yaml)")
    serve.add_argument("--served-model-name", help="the model id clients send as \"model\" "
                       "(default: the model's own name)")
    serve.add_argument("--allow-unauthenticated", action="store_true", default=None,
                       help="serve a non-loopback address even though no API keys exist")
    serve.add_argument("--limit-concurrency", type=int, default=None,
                       help="HTTP connections and requests at once; past it new requests get 503 "
                       "(default 2048)")
    serve.add_argument("--header-timeout", type=float, default=None,
                       help="seconds a connection has to send a request's headers, from its start or "
                       "its last response, before it is closed (default 10)")
    serve.add_argument("--lora-root", default=None, metavar="DIR",
                       help="the folder POST /v1/load_lora_adapter may load adapters from (its "
                       "lora_path must lie under it; default: none, run-time loads are refused)")
    serve.add_argument("--otel-traces", action="store_true", default=None,
                       help="emit OpenTelemetry spans per request to the global tracer provider")
    serve.add_argument("--prefix-cache-group", action="append", metavar="GROUP=TENANT,TENANT",
                       help="let these tenants share prefix-cache pages (repeatable; replaces the "
                       "config's prefix_cache_groups); by default each tenant shares only with itself")
    serve.add_argument("--max-request-bytes", type=int, default=None,
                       help="larger request bodies get 413 before they are read (default 4 MiB)")
    serve.add_argument("--tool-call-parser", default=None,
                       help="format tool calls are parsed from: auto (from the chat template; see "
                       "serving/gateway/tools/output_formats.py) | none | hermes | llama3_json | pythonic")
    serve.add_argument("--reasoning-parser", default=None,
                       help="auto (from the chat template) | none | think: <think>...</think> is "
                       "returned as reasoning_content")
    serve.add_argument("--allowed-media-domains", default=None, metavar="HOST[,HOST...]",
                       help="hosts (or *.example.com) whose http(s) image URLs are fetched, with a size "
                       "and time cap; others get 400 (default: none, only data URLs)")
    serve.add_argument("--max-image-bytes", type=int, default=None,
                       help="larger image inputs get 400 (default 10 MiB)")
    serve.add_argument("--max-image-pixels", type=int, default=None,
                       help="image inputs of more pixels get 400 (default 40,000,000)")
    serve.add_argument("--max-images-per-request", type=int, default=None,
                       help="more image parts in one request get 400 (default 8)")
    serve.add_argument("--max-tenant-image-pixels", type=int, default=None,
                       help="image pixels one tenant may have waiting for a decode or decoding, all its "
                       "requests together; an image past it gets 429 (default 4 x --max-image-pixels)")
    serve.add_argument("--tenant-image-pixel-rate", type=float, default=None,
                       help="image pixels a second one tenant's decodes may take; its further images wait "
                       "(a burst of 2 x --max-image-pixels; default 20,000,000; 0: no bound)")
    serve.add_argument("--max-file-bytes", type=int, default=None,
                       help="larger uploads to POST /v1/files get 413, counted as they stream in; this "
                       "route is held to it instead of --max-request-bytes (default 100 MiB)")
    serve.add_argument("--batch-concurrency", type=int, default=None,
                       help="batch lines this gateway runs at once, at batch priority (default 8)")
    serve.add_argument("--flex-max-waiting", type=int, default=None,
                       help="service_tier flex requests are shed with 429 when more requests than this wait "
                       "for an engine slot (default 0) ...")
    serve.add_argument("--flex-max-kv-usage", type=float, default=None,
                       help="... or when more than this fraction of the KV cache is in use (default 0.9)")
    serve.add_argument("--batch-lease-seconds", type=float, default=None,
                       help="how long this gateway's lease on a batch lasts unrenewed: another gateway "
                       "(or this one restarted) resumes a batch this long after its runner died (default 30)")
    serve.add_argument("--default-chat-max-tokens", type=int, default=None,
                       help="cap the completion of a chat request that sends no max_tokens (default: "
                       "the most that fits the context window and the KV cache)")
    serve.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longer prompts (chat: all message contents) get 400 before tokenizing "
                       "(default 1000000)")
    serve.add_argument("--stream-buffer-events", type=int, default=None,
                       help="events (~tokens) a stream may fall behind its client before the request "
                       "is cancelled (default 1024)")
    serve.add_argument("--stream-write-timeout", type=float, default=None,
                       help="seconds a streaming client may leave a write unaccepted before its request "
                       "is cancelled (default 30)")
    serve.add_argument("--engines", metavar="grpc://HOST:PORT,...",
                       help="serve remote engine replicas (`xlaserve engine`) instead of loading a model: "
                       "the model, tokenizer and chat template come from them; grpcs://HOST:PORT for TLS")
    serve.add_argument("--router", default="kv-aware", choices=("kv-aware", "least-load", "round-robin"),
                       help="with --engines: how a replica is chosen (default kv-aware: where the prompt's "
                       "pages are cached, against load, with an imbalance guard)")
    serve.add_argument("--router-prefill-weight", type=float, default=2.0,
                       help="kv-aware: the cost of one prompt page a replica would compute, against one KV page "
                       "of its load (default 2.0)")
    serve.add_argument("--router-balance-abs", type=int, default=16,
                       help="kv-aware routing gives way to least-load when the busiest replica has more than "
                       "this many requests more than the idlest (default 16) ...")
    serve.add_argument("--router-balance-rel", type=float, default=1.5,
                       help="... and more than this many times as many (default 1.5)")
    serve.add_argument("--region", default=None,
                       help="with --engines: this gateway's region; the router prefers replicas labelled "
                       "region=REGION (`xlaserve engine --labels`) and crosses regions only when those are "
                       "down or overloaded (default: no preference)")
    serve.add_argument("--router-overload-per-slot", type=float, default=2.0,
                       help="with --region: a replica holding this many requests per slot (running + "
                       "waiting) counts as overloaded (default 2.0)")
    add_client_flags(serve)
    serve.set_defaults(func=cmd_serve)



def open_gateway_services(cfg):
    """The gateway's database-backed services for `cfg`.

    Raises:
      ValueError: `cfg.host` is not a loopback address, no API keys exist and
        `cfg.allow_unauthenticated` is off.
    """
    from serving.gateway.services.gateway_services import GatewayServices

    services = GatewayServices.open_server(
        database_url=cfg.database_url, prices_path=cfg.prices, blocklist=cfg.policy_blocklist,
        blocklist_applies_to=cfg.policy_blocklist_applies_to, policy_plugins=cfg.policy_plugins,
        otel_traces=cfg.otel_traces, log_text=cfg.log_text,
        prefix_cache_groups=dict(cfg.prefix_cache_groups), redis_url=cfg.redis_url,
        ledger_spool_dir=cfg.ledger_spool_dir, ledger_spool_max_bytes=cfg.ledger_spool_max_bytes)
    store = services.authenticator.key_store
    if not store.has_keys():
        if not _is_loopback(cfg.host) and not cfg.allow_unauthenticated:
            services.close()
            db = f" --database-url {cfg.database_url}" if cfg.database_url else ""
            raise ValueError(
                f"refusing to serve {cfg.host} without API keys: create one with "
                f"'xlaserve keys create --tenant NAME{db}', or pass --allow-unauthenticated")
        log.warning("no API keys configured: the API is open to anyone who can reach %s", cfg.host)
    # The same rule while it runs: keys deleted later never turn a non-loopback gateway open.
    services.authenticator.require_keys = not _is_loopback(cfg.host) and not cfg.allow_unauthenticated
    return services


def _uvicorn_log_config() -> dict:
    """uvicorn's logging config with the request id in its access lines too."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg.setdefault("filters", {})["request_id"] = {"()": RequestIdLogFilter}
    for handler in cfg["handlers"].values():
        handler.setdefault("filters", []).append("request_id")
    cfg["formatters"]["access"]["fmt"] = (
        '%(asctime)s %(levelprefix)s [%(request_id)s] %(client_addr)s - "%(request_line)s" %(status_code)s')
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    from serving.config.server_config import load_server_config
    from serving.gateway.app import ServedModel
    from serving.gateway.openai.served_model import adapter_model
    from serving.gateway.services.service_tiers import FlexAdmission
    from serving.gateway.tools.output_formats import pick_reasoning_parser, pick_tool_call_parser
    from serving.loading.model_source import resolve_task

    overrides = _overrides(args, ("task", "embed_max_batch", "embed_max_batch_tokens", "rerank_template", "host",
                                  "port", "enable_prefix_caching", "allow_unauthenticated", "lora_root",
                                  "limit_concurrency", "header_timeout",
                                  "otel_traces", "database_url", "prices", "served_model_name",
                                  "max_request_bytes", "max_prompt_chars", "stream_buffer_events",
                                  "stream_write_timeout", "default_chat_max_tokens",
                                  "redis_url", "ledger_spool_dir", "ledger_spool_max_bytes",
                                  "tool_call_parser", "reasoning_parser",
                                  "max_file_bytes", "batch_concurrency", "batch_lease_seconds",
                                  "flex_max_waiting", "flex_max_kv_usage", "max_image_bytes",
                                  "max_image_pixels", "max_images_per_request", "max_tenant_image_pixels",
                                  "tenant_image_pixel_rate"))
    if args.allowed_media_domains is not None:
        overrides["allowed_media_domains"] = tuple(
            d.strip() for d in args.allowed_media_domains.split(",") if d.strip())
    if args.prefix_cache_group:
        overrides["prefix_cache_groups"] = _prefix_cache_groups(args.prefix_cache_group)
    cfg = load_server_config(args.config, **overrides)
    if join_processes(cfg) and not _is_leader():  # multi-host: only process 0 serves HTTP
        return run_follower(cfg)
    services = open_gateway_services(cfg)  # before the engine: a refused start is quick
    services.flex_admission = FlexAdmission(max_waiting=cfg.flex_max_waiting, max_kv_usage=cfg.flex_max_kv_usage)
    loop = None
    try:
        task = "generate" if args.engines else resolve_task(cfg.task, cfg.model, cfg.revision)
        if task in ("embed", "rerank"):
            loop, served = (_embedding_model if task == "embed" else _rerank_model)(cfg, warmup=not args.skip_warmup)
            return _run_gateway(args, cfg, services, {served.name: served}, loop)
        if args.engines:  # a gateway over remote replicas: no weights here
            engine, tokenizer, name, _ = build_router(
                args.engines, args.router, prefill_weight=args.router_prefill_weight,
                balance_abs=args.router_balance_abs, balance_rel=args.router_balance_rel,
                region=args.region, overload_per_slot=args.router_overload_per_slot,
                security=client_security(args))
        else:
            loop, tokenizer, name = build_engine(cfg, warmup=not args.skip_warmup)
            engine = loop
        name = cfg.served_model_name or name
        tool_parser = pick_tool_call_parser(tokenizer, cfg.tool_call_parser)
        reasoning_parser = pick_reasoning_parser(tokenizer, cfg.reasoning_parser)
        log.info("tool-call parser: %s; reasoning parser: %s", tool_parser, reasoning_parser)
        base = ServedModel(name=name, engine=engine, tokenizer=tokenizer, max_model_len=engine.max_model_len,
                           kv_capacity_tokens=engine.kv_capacity_tokens,
                           default_chat_max_tokens=cfg.default_chat_max_tokens,
                           tool_call_parser=tool_parser, reasoning_parser=reasoning_parser)
        models = {name: base}
        # --lora-modules; behind a router, what the replicas serve (followed from then on)
        for lora in loop.lora_names() if loop is not None else engine.routed_lora_names():
            if lora in models:
                raise ValueError(f"LoRA adapter name {lora!r} is the base model's served name")
            models[lora] = adapter_model(base, lora)
        return _run_gateway(args, cfg, services, models, loop)
    finally:
        services.close()


def _embedding_model(cfg, warmup: bool = True):
    """The embedding loop and the ServedModel of ``--task embed`` (``warmup``: compile first)."""
    from serving.cli.bootstrap import build_embedding_engine
    from serving.gateway.app import ServedModel

    loop, tokenizer, name, head = build_embedding_engine(cfg, warmup=warmup)
    name = cfg.served_model_name or name
    return loop, ServedModel(name=name, engine=loop, tokenizer=tokenizer, max_model_len=loop.max_model_len,
                             task="embed", embedding_dim=head.dim, matryoshka_dims=head.matryoshka_dims,
                             vocab_size=loop.vocab_size)


def _rerank_model(cfg, warmup: bool = True):
    """The embedding loop over a reranker and the ServedModel of ``--task rerank``."""
    from serving.cli.bootstrap import build_rerank_engine
    from serving.gateway.app import ServedModel

    loop, rerank = build_rerank_engine(cfg, warmup=warmup)
    name = cfg.served_model_name or rerank.name
    return loop, ServedModel(name=name, engine=loop, tokenizer=rerank.tokenizer, max_model_len=loop.max_model_len,
                             task="rerank", vocab_size=loop.vocab_size, pair_encoder=rerank.pair_encoder)


def _run_gateway(args, cfg, services, models, loop) -> int:
    """Serves ``models`` over HTTP until SIGTERM; stops ``loop`` (the in-process engine, or None) after."""
    import uvicorn

    from serving.gateway.app import GatewayLimits, create_app
    from serving.gateway.batch.batch_runner import BatchSettings
    from serving.gateway.http.header_timeout import header_timeout_protocol
    from serving.gateway.http.limits import MediaLimits

    try:
        media = MediaLimits(max_image_bytes=cfg.max_image_bytes, max_image_pixels=cfg.max_image_pixels,
                            max_images=cfg.max_images_per_request,
                            allowed_media_domains=tuple(cfg.allowed_media_domains),
                            fetch_timeout_s=cfg.media_fetch_timeout,
                            max_tenant_image_pixels=cfg.max_tenant_image_pixels,
                            tenant_image_pixel_rate=cfg.tenant_image_pixel_rate or None)
        limits = GatewayLimits(max_request_bytes=cfg.max_request_bytes, max_prompt_chars=cfg.max_prompt_chars,
                               stream_write_timeout=cfg.stream_write_timeout, max_file_bytes=cfg.max_file_bytes,
                               media=media)
        batches = BatchSettings(concurrency=cfg.batch_concurrency, lease_seconds=cfg.batch_lease_seconds)
        app = create_app(models, services, limits, batches, lora_root=cfg.lora_root)
        for name in models:
            log.info("serving %s on http://%s:%d/v1", name, cfg.host, cfg.port)
        freeze_startup_heap()
        # uvicorn re-raises the SIGTERM it handled once it has shut down; with the default
        # action that would end the process here, before the engine stops below (the disk KV
        # tier saves its pages then): a handler of ours takes the re-raised signal instead.
        signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: stopping the engine"))
        # On SIGTERM, open streams get drain_timeout seconds to finish, then are cut.
        # Slow or idle clients: a deadline on each request's headers, and a bound on connections.
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=cfg.drain_timeout, log_config=_uvicorn_log_config(),
                    limit_concurrency=cfg.limit_concurrency, http=header_timeout_protocol(cfg.header_timeout))
    finally:
        if loop is not None:
            loop.stop()
            engine = getattr(loop, "engine", None)
            if getattr(engine, "lockstep", None) is not None:
                engine.lockstep.stop()
    return 0


def _prefix_cache_groups(values: list[str]) -> dict[str, list[str]]:
    """``--prefix-cache-group GROUP=TENANT,TENANT`` flags as {group: [tenant, ...]}.

    Raises:
      ValueError: a value without ``=`` or without tenants.
    """
    groups: dict[str, list[str]] = {}
    for value in values:
        group, sep, tenants = value.partition("=")
        names = [t.strip() for t in tenants.split(",") if t.strip()]
        if not sep or not group.strip() or not names:
            raise ValueError(f"--prefix-cache-group takes GROUP=TENANT[,TENANT...], got {value!r}")
        groups.setdefault(group.strip(), []).extend(names)
    return groups


def build_router(engine_urls: str, policy: str, prefill_weight: float = 2.0, balance_abs: int = 16,
                 balance_rel: float = 1.5, wait_log_s: float = 10.0, region: str | None = None,
                 overload_per_slot: float = 2.0, security=None):
    """The router over ``engine_urls`` (comma-separated ``grpc://host:port`` or ``grpcs://host:port``),
    once one answers.

    Args:
      region: the gateway's own, preferred (see :class:`serving.routing.router.Router`).
      security: how the replicas are called (``serving.rpc.channel_security.ClientSecurity``:
        CA, client certificate, token; default: none).

    Returns:
      (router, tokenizer, model name, the first replica's ModelInfo).

    Raises:
      ValueError: a malformed URL, an unknown policy, replicas that disagree; a replica that
        refused the token (UNAUTHENTICATED: a wrong or missing --grpc-token-file).
    """
    import grpc

    from model.tokenizer_files import tokenizer_from_files
    from serving.routing import disaggregation
    from serving.routing.router import Router
    from serving.rpc.channel_security import PLAIN
    from serving.rpc.remote_engine import RemoteEngine, fetch_model_info, parse_engine_url

    security = security or PLAIN
    urls = [u.strip() for u in engine_urls.split(",") if u.strip()]
    if not urls:
        raise ValueError("--engines needs at least one grpc://host:port")
    for u in urls:
        parse_engine_url(u)
    check_engine_urls(urls, security)
    infos: dict[str, object] = {}
    last_log = time.monotonic()
    while not infos:
        for u in urls:
            try:
                infos[u] = fetch_model_info(u, timeout=2.0, security=security)
            except grpc.RpcError as e:
                code = getattr(e, "code", lambda: None)()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise ValueError(f"engine replica {u} refused this gateway: {e.details()} "
                                     f"(--grpc-token-file must hold the replicas' token)") from None
                if time.monotonic() - last_log > wait_log_s:
                    log.info("waiting for engine replica %s (%s: %s)", u, code or e,
                             getattr(e, "details", lambda: "")())
        if time.monotonic() - last_log > wait_log_s:
            last_log = time.monotonic()
    first = next(iter(infos.values()))
    replicas = [RemoteEngine(u, infos.get(u), expected=first, security=security) for u in urls]
    router = Router(replicas, policy=policy, prefill_weight=prefill_weight, balance_abs=balance_abs,
                    balance_rel=balance_rel, region=region, overload_per_slot=overload_per_slot)
    tokenizer = tokenizer_from_files(dict(first.tokenizer_files))
    roles = ", ".join(f"{u} {i.role or 'both'}" + (f" (KV over {i.kv_transport})" if i.role in ("prefill", "decode")
                                                    else "") for u, i in infos.items())
    log.info("routing %s (%s) over %d engine replicas, %d answering: %s", first.model, policy, len(urls),
             len(infos), roles)
    for why in disaggregation.unpaired(replicas):
        log.warning("%s", why)
    if region:
        local = [r.url for r in replicas if r.region == region]
        labelled = ", ".join(f"{u} {i.labels.get('region') or '(no region)'}" for u, i in infos.items())
        if local:
            log.info("region %s: %s preferred (%s)", region, ", ".join(local), labelled)
        else:
            log.warning("region %s: no answering replica is labelled region=%s (%s); requests cross regions "
                        "until one is", region, region, labelled)
    return router, tokenizer, first.model, first
