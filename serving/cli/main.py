"""The ``xlaserve`` command: ``serve``, ``engine``, ``generate``, the gateway's ``keys``, ``tenants``, ``usage``
(serving/cli/admin.py), and ``convert``, ``shard-plan`` (serving/cli/shard_plan.py).

    xlaserve serve                       # Gemma 3 270M on 127.0.0.1:8000
    xlaserve serve --model tiny-random --port 8100
    xlaserve serve --model path/to/hf_checkpoint_dir     # or a .gguf file, or a Hub id org/name
    xlaserve engine --grpc-port 50051                    # a replica behind gRPC (serving/cli/engine.py)
    xlaserve serve --engines grpc://127.0.0.1:50051,grpc://127.0.0.1:50052
    xlaserve generate "The capital of France is" --max-tokens 24
    xlaserve keys create --tenant acme --rpm 60
    xlaserve usage --group-by day
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import sys
import time

from serving.cli import admin as admin_cli
from serving.gateway.http.log_context import LOG_FORMAT, RequestIdLogFilter

log = logging.getLogger("xlaserve")

_SETTINGS = [
    # (flag, type, help)
    ("model", str, "model name from configs/models.yaml, a .gguf file, a Hugging Face checkpoint "
                   "directory, or a Hugging Face Hub id (org/name)"),
    ("revision", str, "branch, tag or commit of a Hub id --model (default: main)"),
    ("dtype", str, "float32 | bfloat16: weights and matmul inputs"),
    ("kv_dtype", str, "KV cache dtype (default: same as --dtype)"),
    ("max_model_len", int, "context window in tokens (prompt + completion)"),
    ("max_slots", int, "concurrently decoding sequences"),
    ("page_size", int, "tokens per KV-cache page"),
    ("num_pages", int, "KV-cache pool size in pages"),
    ("host_kv_cache_gib", float, "host-memory KV tier under the prefix cache, in GiB: evicted and "
                                 "preempted pages are kept there and reloaded on a prefix hit (0: off)"),
    ("prefill_chunk", int, "most prompt tokens per prefill step (power of two)"),
    ("max_prefill_seqs", int, "sequences packed into one prefill step"),
    ("min_decode_batch", int, "smallest decode batch bucket"),
    ("max_waiting", int, "waiting requests before new ones get 503"),
    ("max_waiting_tokens", int, "waiting prompt tokens before new ones get 503"),
    ("token_budget", int, "most tokens computed per step (decode rows + prompt chunks)"),
    ("attention_impl", str, "auto | xla | pallas"),
    ("drain_timeout", float, "seconds open streams get to finish after SIGTERM"),
    ("mesh", str, "device mesh, e.g. data=1,tensor=4,expert=1 (default: one device)"),
    ("checkpoint", str, "orbax checkpoint directory (from xlaserve convert) instead of --model"),
    ("chat_template", str, "Jinja chat template FILE (or JSON with a chat_template field) served "
                           "instead of the model's own"),
    ("quantization", str, "none | int8: int8 weights (layer matrices and output head) with float "
                          "scales; GGUF Q8_0 blocks exactly"),
    ("speculative", str, "speculative decoding method: ngram (drafts from the request's own n-grams)"),
    ("num_speculative_tokens", int, "K: draft tokens verified per step (1..15; with --speculative)"),
    ("prompt_lookup_min", int, "shortest n-gram looked up for drafts (default 2)"),
    ("prompt_lookup_max", int, "longest n-gram looked up for drafts, tried first (default 4)"),
    ("speculative_max_batch", int, "speculate only while at most this many requests run (default 2)"),
]


def _add_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="server YAML (default: configs/server.yaml)")
    for name, typ, help_ in _SETTINGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)


def _overrides(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    names = [n for n, _, _ in _SETTINGS] + list(extra)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def build_engine(cfg, warmup: bool = True, warmup_decode: bool = True):
    """Loads the model and starts the batching loop (``warmup``: compiling the common shapes
    first, the decode ones only with ``warmup_decode``). Returns (EngineLoop, tokenizer,
    model name)."""
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.engine import Engine
    from serving.config.engine_config import EngineConfig
    from serving.runtime.engine_loop import EngineLoop
    from serving.core.kv.host_kv_cache import GIB
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.cli.shard_plan import load_for_serving, lockstep_for

    enable_compilation_cache()
    t0 = time.perf_counter()
    model, tokenizer, mesh = load_for_serving(cfg)
    policy = BackendPolicy.detect(mesh, attention_impl=cfg.attention_impl)
    engine = Engine(model, EngineConfig.from_server_config(cfg, model.cfg), mesh=mesh,
                    lockstep=lockstep_for(mesh), policy=policy)
    if cfg.host_kv_cache_gib and engine.lockstep is not None:
        raise ValueError("--host-kv-cache-gib needs a single-host engine (pages are copied on one host)")
    loop = EngineLoop(engine, max_waiting=cfg.max_waiting, max_waiting_tokens=cfg.max_waiting_tokens,
                      token_budget=cfg.token_budget, enable_prefix_caching=cfg.enable_prefix_caching,
                      max_queued_events=cfg.stream_buffer_events, tokenizer=tokenizer,
                      host_kv_cache_bytes=int(cfg.host_kv_cache_gib * GIB))
    loop.start(warmup=warmup, warmup_decode=warmup_decode)
    log.info("engine ready in %.1f s (model %s, %d slots, %d pages of %d tokens)",
             time.perf_counter() - t0, model.cfg.name, cfg.max_slots, cfg.num_pages, cfg.page_size)
    return loop, tokenizer, model.cfg.name


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        prefix_cache_groups=dict(cfg.prefix_cache_groups), redis_url=cfg.redis_url)
    store = services.authenticator.key_store
    if not store.has_keys():
        if not _is_loopback(cfg.host) and not cfg.allow_unauthenticated:
            services.close()
            db = f" --database-url {cfg.database_url}" if cfg.database_url else ""
            raise ValueError(
                f"refusing to serve {cfg.host} without API keys: create one with "
                f"'xlaserve keys create --tenant NAME{db}', or pass --allow-unauthenticated")
        log.warning("no API keys configured: the API is open to anyone who can reach %s", cfg.host)
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
    import uvicorn

    from serving.gateway.app import GatewayLimits, ServedModel, create_app
    from serving.gateway.tools.output_formats import pick_reasoning_parser, pick_tool_call_parser
    from serving.gateway.batch.batch_runner import BatchSettings
    from serving.config.server_config import load_server_config
    from serving.cli.shard_plan import join_processes, run_follower

    overrides = _overrides(args, ("host", "port", "enable_prefix_caching", "allow_unauthenticated",
                                  "otel_traces", "database_url", "prices", "served_model_name",
                                  "max_request_bytes", "max_prompt_chars", "stream_buffer_events",
                                  "stream_write_timeout", "default_chat_max_tokens",
                                  "redis_url", "tool_call_parser", "reasoning_parser",
                                  "max_file_bytes", "batch_concurrency", "batch_lease_seconds"))
    if args.prefix_cache_group:
        overrides["prefix_cache_groups"] = _prefix_cache_groups(args.prefix_cache_group)
    cfg = load_server_config(args.config, **overrides)
    if join_processes(cfg) and not _is_leader():  # multi-host: only process 0 serves HTTP
        return run_follower(cfg)
    services = open_gateway_services(cfg)  # before the engine: a refused start is quick
    loop = None
    try:
        if args.engines:  # a gateway over remote replicas: no weights here
            from serving.cli.engine import build_router

            engine, tokenizer, name, _ = build_router(
                args.engines, args.router, prefill_weight=args.router_prefill_weight,
                balance_abs=args.router_balance_abs, balance_rel=args.router_balance_rel)
        else:
            loop, tokenizer, name = build_engine(cfg)
            engine = loop
        name = cfg.served_model_name or name
        limits = GatewayLimits(max_request_bytes=cfg.max_request_bytes, max_prompt_chars=cfg.max_prompt_chars,
                               stream_write_timeout=cfg.stream_write_timeout, max_file_bytes=cfg.max_file_bytes)
        batches = BatchSettings(concurrency=cfg.batch_concurrency, lease_seconds=cfg.batch_lease_seconds)
        tool_parser = pick_tool_call_parser(tokenizer, cfg.tool_call_parser)
        reasoning_parser = pick_reasoning_parser(tokenizer, cfg.reasoning_parser)
        log.info("tool-call parser: %s; reasoning parser: %s", tool_parser, reasoning_parser)
        app = create_app({name: ServedModel(name=name, engine=engine, tokenizer=tokenizer,
                                             max_model_len=engine.max_model_len,
                                             kv_capacity_tokens=engine.kv_capacity_tokens,
                                             default_chat_max_tokens=cfg.default_chat_max_tokens,
                                             tool_call_parser=tool_parser,
                                             reasoning_parser=reasoning_parser)},
                         services, limits, batches)
        log.info("serving %s on http://%s:%d/v1", name, cfg.host, cfg.port)
        freeze_startup_heap()
        try:
            # On SIGTERM, open streams get drain_timeout seconds to finish, then are cut.
            uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level.lower(),
                        timeout_graceful_shutdown=cfg.drain_timeout, log_config=_uvicorn_log_config())
        finally:
            if loop is not None:
                loop.stop()
                if loop.engine.lockstep is not None:
                    loop.engine.lockstep.stop()
    finally:
        services.close()
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from serving.cli.engine import cmd_engine as run_engine

    return run_engine(args, _overrides(args, ("enable_prefix_caching", "served_model_name",
                                              "stream_buffer_events")))


def freeze_startup_heap() -> None:
    """Moves every object alive after start-up (modules, the model, compiled
    programs, the app) into the garbage collector's permanent generation
    (``gc.freeze``), after collecting what start-up left behind.

    A full collection otherwise walks all of them while serving and holds every
    thread meanwhile (0.2-0.3 s on a 2-core VM: a visible stall in every stream,
    ``benchmarks.stream_stall``); frozen, it walks only what requests allocate.
    """
    gc.collect()
    gc.freeze()
    log.debug("gc: %d start-up objects frozen", gc.get_freeze_count())


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


def _is_leader() -> bool:
    import jax

    return jax.process_index() == 0


def cmd_generate(args: argparse.Namespace) -> int:
    from serving.cli.generate import build_request, generate_text
    from serving.output.output_processor import GenerationError
    from serving.config.server_config import load_server_config

    overrides = _overrides(args)
    overrides.setdefault("max_slots", 8)
    overrides.setdefault("num_pages", 1024)
    overrides.setdefault("max_model_len", 4096)
    cfg = load_server_config(args.config, **overrides)
    loop, tokenizer, _ = build_engine(cfg, warmup=False)

    def write(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    async def run(request):
        try:
            return await generate_text(loop, tokenizer, request, args.stop or (), write)
        finally:
            # Stop the engine thread while this event loop is still open: after a stop
            # string cancels the request, a step in flight may still send it events.
            await asyncio.to_thread(loop.stop)

    try:
        request = build_request(tokenizer, args.prompt, chat=args.chat, max_tokens=args.max_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed)
        result = asyncio.run(run(request))
    except GenerationError as e:
        sys.stdout.write("\n")
        print(f"xlaserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        loop.stop()
    sys.stdout.write("\n")
    print(result.summary(), file=sys.stderr)
    return 0


PLUGIN_COMMANDS_GROUP = "xlaserve.commands"
"""Entry-point group of extra subcommands: each entry is a ``register(subparsers)``
function (pyproject.toml registers ``bench`` from ``benchmarks.cli``)."""


def _register_plugin_commands(sub) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=PLUGIN_COMMANDS_GROUP):
        try:
            register = ep.load()
        except ImportError as e:  # e.g. a source tree without the benchmarks package
            log.debug("xlaserve command %r not available: %s", ep.name, e)
            continue
        register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xlaserve", description="LLM inference on JAX/XLA")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_settings(serve)
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       default=None, help="turn the automatic prefix cache off")
    serve.add_argument("--database-url", help="SQLAlchemy URL of the keys + usage ledger "
                       "(default: $XLASERVE_DATABASE_URL, else SQLite under the data dir)")
    serve.add_argument("--redis-url", help="Redis that holds rate limits shared by every gateway using "
                       "it, redis://host:port/db (default: $XLASERVE_REDIS_URL, else limits per process)")
    serve.add_argument("--prices", help="price table YAML (default: configs/prices.yaml)")
    serve.add_argument("--served-model-name", help="the model id clients send as \"model\" "
                       "(default: the model's own name)")
    serve.add_argument("--allow-unauthenticated", action="store_true", default=None,
                       help="serve a non-loopback address even though no API keys exist")
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
    serve.add_argument("--max-file-bytes", type=int, default=None,
                       help="larger uploads to POST /v1/files get 413, counted as they stream in; this "
                       "route is held to it instead of --max-request-bytes (default 100 MiB)")
    serve.add_argument("--batch-concurrency", type=int, default=None,
                       help="batch lines this gateway runs at once, at batch priority (default 8)")
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
                       "the model, tokenizer and chat template come from them")
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
    serve.set_defaults(func=cmd_serve)

    engine = sub.add_parser("engine", help="run one engine replica as a gRPC service (no HTTP), for "
                            "`serve --engines`")
    _add_settings(engine)
    engine.add_argument("--grpc-port", type=int, required=True, help="port of the engine service (0: any free one)")
    engine.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    engine.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                        help="both (default): computes prompts and decodes; prefill: computes prompts and "
                        "hands their KV pages to a decode replica; decode: pulls them, then decodes "
                        "(the gateway's router pairs them: serving/cli/engine.py)")
    engine.add_argument("--kv-transport", default="auto", choices=("auto", "jax", "grpc"),
                        help="how KV pages move between replicas: jax (jax.experimental.transfer), grpc "
                        "(host staging over the engine service); auto (default): jax where it imports")
    engine.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                        help="seconds a prefill replica keeps a prompt's pages for a decode replica to "
                        "pull before it frees them (default 30)")
    engine.add_argument("--kv-chunk-pages", type=int, default=16,
                        help="KV pages per transfer message, every layer of each (default 16)")
    engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None, help="turn the automatic prefix cache off")
    engine.add_argument("--served-model-name", help="the model id the gateway serves it as")
    engine.add_argument("--stream-buffer-events", type=int, default=None,
                        help="events a stream may fall behind before the request is cancelled (default 1024)")
    engine.set_defaults(func=cmd_engine)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    _add_settings(gen)
    gen.add_argument("prompt", help="prompt text (BOS is added)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=cmd_generate)

    admin_cli.add_commands(sub)

    from serving.cli.shard_plan import register as register_sharding_commands

    register_sharding_commands(sub)  # convert, shard-plan

    _register_plugin_commands(sub)  # e.g. `xlaserve bench` (benchmarks/cli.py)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdLogFilter())
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("xlaserve: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # bad settings: a clear message, not a traceback
        print(f"xlaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
