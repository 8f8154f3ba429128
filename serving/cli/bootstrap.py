"""Starting an engine in this process, shared by ``serve``, ``engine`` and ``generate``: the model
loaded onto its mesh (``serving.loading.mesh_loader``), the engine and its loop built and warmed up
(:func:`build_engine`); a multi-host job joined, its followers running the leader's steps; the
start-up heap frozen once a long-running command is up."""

from __future__ import annotations

import dataclasses
import gc
import ipaddress
import logging
import time

log = logging.getLogger("xlaserve")


def build_engine(cfg, warmup: bool = True, warmup_decode: bool = True):
    """Loads the model and starts the batching loop (``warmup``: compiling the common shapes
    first, the decode ones only with ``warmup_decode``). Returns (EngineLoop, tokenizer,
    model name)."""
    from serving.config.engine_config import EngineConfig
    from serving.core.kv.host_kv_cache import GIB
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.engine import Engine
    from serving.engine.kv_pages import page_bytes
    from serving.loading.mesh_loader import load_for_serving
    from serving.runtime.disk_tier_steps import model_identity
    from serving.runtime.engine_loop import EngineLoop

    enable_compilation_cache()
    t0 = time.perf_counter()
    cfg = with_default_quantization(cfg)
    model, tokenizer, mesh = load_for_serving(cfg)
    policy = BackendPolicy.detect(mesh, attention_impl=cfg.attention_impl, quantization=cfg.quantization,
                                  cpu_kernels=cfg.cpu_kernels)
    advice = policy.advice(cfg.dtype, cfg.quantization != "none")
    if advice:
        log.warning(advice)
    if policy.int8_matmul is not None and cfg.quantization != "none":
        rows = getattr(policy.int8_matmul, "max_rows", None)
        above = "its AMX-INT8 tiles above" if getattr(policy.int8_matmul, "amx", False) else "XLA's dot above"
        log.info("int8 dots: integer products by xlaserve's CPU kernel (kernels_cpu, --cpu-kernels %s), %s",
                 cfg.cpu_kernels, f"up to {rows} int8 rows, {above}" if rows else "at every row count")
    if policy.bf16_matmul is not None and str(cfg.dtype) == "bfloat16":
        rows = getattr(policy.bf16_matmul, "max_rows", None)
        head = getattr(policy.bf16_matmul, "contracts", (0, 1)) == (1,)
        log.info("bf16 dots: xlaserve's CPU kernel (kernels_cpu, --cpu-kernels %s), %s", cfg.cpu_kernels,
                 f"up to {rows} rows, XLA's dot above" if rows
                 else "the output head's at every row count, XLA's for the others" if head
                 else "at every row count")
    vision = None
    if getattr(model.cfg, "architecture", None) == "gemma3" and cfg.checkpoint is None:
        from serving.loading.model_registry import load_vision

        vision = load_vision(cfg.model, cfg.revision)
        if vision is not None and (mesh is not None or policy.attention.kernel != "xla"):
            log.warning("the vision tower is not served: image inputs need a single-device engine "
                        "with the xla attention kernel (requests with images get 400)")
            vision = None
    engine_cfg = EngineConfig.from_server_config(cfg, model.cfg)
    draft = None
    if cfg.speculative in ("draft", "eagle3"):
        from serving.engine.draft_model import shared_pages
        from serving.loading.draft_source import load_draft

        draft = load_draft(cfg, model, tokenizer)
        if draft is not None:  # self:int8 drafts over the served cache
            pages = shared_pages(engine_cfg.num_pages, model.cfg, getattr(draft, "layer_cfg", draft.cfg))
            log.info("the draft model's KV cache shares --num-pages %d: %d pages each", engine_cfg.num_pages, pages)
            engine_cfg = dataclasses.replace(engine_cfg, num_pages=pages)
    engine = Engine(model, engine_cfg, mesh=mesh, lockstep=lockstep_for(mesh), policy=policy, vision=vision,
                    draft=draft)
    if vision is not None:
        log.info("vision tower loaded: %d soft tokens per %d-pixel image", vision.cfg.mm_tokens_per_image,
                 vision.cfg.siglip.image_size)
    if cfg.host_kv_cache_gib and engine.lockstep is not None:
        raise ValueError("--host-kv-cache-gib needs a single-host engine (pages are copied on one host)")
    loop = EngineLoop(engine, max_waiting=cfg.max_waiting, max_waiting_tokens=cfg.max_waiting_tokens,
                      token_budget=cfg.token_budget, enable_prefix_caching=cfg.enable_prefix_caching,
                      max_queued_events=cfg.stream_buffer_events, tokenizer=tokenizer,
                      host_kv_cache_bytes=int(cfg.host_kv_cache_gib * GIB),
                      kv_disk_dir=cfg.kv_disk_dir, kv_disk_max_bytes=cfg.kv_disk_max_bytes,
                      kv_disk_model_id=model_identity(model.cfg, _weights_stamp(cfg.checkpoint or cfg.model),
                                                      cfg.revision, cfg.dtype, cfg.quantization),
                      starvation_preemptions=cfg.flex_starvation_preemptions,
                      starvation_seconds=cfg.flex_starvation_seconds,
                      lora_modules=dict(cfg.lora_modules), max_cpu_loras=cfg.max_cpu_loras)
    loop.start(warmup=warmup, warmup_decode=warmup_decode)
    log.info("engine ready in %.1f s (model %s, %d slots, %d pages of %d tokens, KV %s: %d bytes a page)",
             time.perf_counter() - t0, model.cfg.name, cfg.max_slots, engine_cfg.num_pages, cfg.page_size,
             engine.kv_cache.kv_format, page_bytes(engine.kv_cache))
    return loop, tokenizer, model.cfg.name


def with_default_quantization(cfg):
    """``cfg`` with ``quantization`` set: as given, else the backend policy's default for this
    model, dtype, platform and ``--cpu-kernels`` (``BackendPolicy.default_quantization``; logged
    when it is int8). An orbax ``--checkpoint`` holds float weights: "none"; so does a server
    drafting with ``self:int8`` (its drafts are the int8 copy of the served weights, which
    verify them: one bf16 stream then decodes at 0.83x the int8 default's speed (1.58-1.61x bf16's), where int8
    weights drafting with their own layers lost (0.90x); benchmarks/RESULTS.md, issue 46)."""
    if cfg.quantization is not None:
        return cfg
    from serving.config.speculative_config import SELF_INT8

    if cfg.speculative == "draft" and cfg.draft_model == SELF_INT8:
        return dataclasses.replace(cfg, quantization="none")
    import jax

    from serving.engine.backend_policy import BackendPolicy
    from serving.loading.model_source import stored_quantized
    from sharding.mesh import MeshConfig

    devices = MeshConfig.parse(cfg.mesh).size if cfg.mesh else 1
    quantization = BackendPolicy.default_quantization(
        jax.default_backend(), stored_quantized=not cfg.checkpoint and stored_quantized(cfg.model),
        dtype=cfg.dtype, cpu_kernels=cfg.cpu_kernels, devices=devices)
    if quantization != "none":
        log.info("--quantization %s by default: %s stores quantized weights and the CPU kernel serves "
                 "the int8 dots (--quantization none: %s weights)", quantization, cfg.model, cfg.dtype)
    return dataclasses.replace(cfg, quantization=quantization)


def _weights_stamp(source: str | None) -> str:
    """What names the served weights in the disk KV tier's files: ``source`` (a model name, Hub
    id or path), with a file's size and modification time (other weights under one path)."""
    import os

    if source and os.path.isfile(source):
        st = os.stat(source)
        return f"{os.path.abspath(source)}:{st.st_size}:{st.st_mtime_ns}"
    return str(source)


def build_embedding_engine(cfg, warmup: bool = True):
    """Loads an embedding model (``--task embed``) and starts its loop. Returns (EmbeddingLoop,
    tokenizer, model name, the model's ``EmbeddingHead``).

    Raises:
      ValueError: a mesh or checkpoint setting (embedding models run on one device, from
        their sentence-transformers directory), or what ``load_embedding_model`` raises.
    """
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.embedding_engine import EmbeddingEngine
    from serving.loading.embedding_model import load_embedding_model
    from serving.runtime.embedding_loop import EmbeddingLoop

    if cfg.mesh or cfg.checkpoint or cfg.num_processes:
        raise ValueError("--task embed serves a sentence-transformers --model on one device "
                         "(no --mesh, --checkpoint or multi-process settings)")
    enable_compilation_cache()
    t0 = time.perf_counter()
    model, head, tokenizer, name = load_embedding_model(cfg.model, cfg.dtype, revision=cfg.revision)
    max_len = min(cfg.max_model_len, head.max_seq_length or cfg.max_model_len)
    engine = EmbeddingEngine(model, head, max_len=max_len, max_batch=cfg.embed_max_batch,
                             max_batch_tokens=max(cfg.embed_max_batch_tokens, max_len),
                             policy=BackendPolicy.detect(attention_impl="xla"))
    loop = EmbeddingLoop(engine, max_waiting=max(cfg.max_waiting, cfg.embed_max_batch) * 16)
    loop.start(warmup=warmup)
    log.info("embedding engine ready in %.1f s (model %s, dim %d, inputs up to %d tokens)",
             time.perf_counter() - t0, name, engine.dim, engine.max_len)
    return loop, tokenizer, name, head


def build_rerank_engine(cfg, warmup: bool = True):
    """Loads a reranker (``--task rerank``: a cross-encoder, or a decoder scored by label tokens)
    onto the embedding engine and starts its loop. Returns (EmbeddingLoop, ``RerankModel``).

    Raises:
      ValueError: a mesh or checkpoint setting (rerankers run on one device), a bad
        ``--rerank-template``, or what ``load_rerank_model`` raises.
    """
    from model.rerank_prompt import RerankTemplate
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.compilation_cache import enable_compilation_cache
    from serving.engine.embedding_engine import EmbeddingEngine
    from serving.loading.rerank_model import load_rerank_model
    from serving.runtime.embedding_loop import EmbeddingLoop

    if cfg.mesh or cfg.checkpoint or cfg.num_processes:
        raise ValueError("--task rerank serves a --model on one device (no --mesh, --checkpoint or multi-process "
                         "settings)")
    template = RerankTemplate.from_file(cfg.rerank_template) if cfg.rerank_template else None
    enable_compilation_cache()
    t0 = time.perf_counter()
    rerank = load_rerank_model(cfg.model, cfg.dtype, revision=cfg.revision, template=template)
    max_len = min(cfg.max_model_len, rerank.head.max_seq_length or cfg.max_model_len)
    engine = EmbeddingEngine(rerank.model, rerank.head, max_len=max_len, max_batch=cfg.embed_max_batch,
                             max_batch_tokens=max(cfg.embed_max_batch_tokens, max_len),
                             policy=BackendPolicy.detect(attention_impl="xla"))
    loop = EmbeddingLoop(engine, max_waiting=max(cfg.max_waiting, cfg.embed_max_batch) * 16)
    loop.start(warmup=warmup)
    log.info("rerank engine ready in %.1f s (model %s, %s, pairs up to %d tokens)", time.perf_counter() - t0,
             rerank.name, rerank.kind, engine.max_len)
    return loop, rerank


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_leader() -> bool:
    import jax

    return jax.process_index() == 0


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


def join_processes(cfg) -> bool:
    """Joins a multi-process job if the settings or JAX_* env vars name one. True if it did."""
    from sharding.multihost import ProcessConfig, initialize

    return initialize(ProcessConfig.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id))


def lockstep_for(mesh):
    """A Lockstep when the mesh spans several processes, else None."""
    import jax

    if mesh is None or jax.process_count() == 1:
        return None
    from sharding.multihost import Lockstep

    return Lockstep()


def run_follower(cfg) -> int:
    """A non-leader process of ``serve``: loads the same model onto the same mesh and runs
    the steps process 0 publishes, until it stops."""
    import jax

    from serving.config.engine_config import EngineConfig
    from serving.engine.backend_policy import BackendPolicy
    from serving.engine.engine import Engine
    from serving.loading.mesh_loader import load_for_serving
    from sharding.multihost import Lockstep

    cfg = with_default_quantization(cfg)
    model, _, mesh = load_for_serving(cfg)
    engine = Engine(model, EngineConfig.from_server_config(cfg, model.cfg), mesh=mesh,
                    lockstep=Lockstep(), policy=BackendPolicy.detect(mesh, attention_impl=cfg.attention_impl,
                                                           quantization=cfg.quantization,
                                                           cpu_kernels=cfg.cpu_kernels))
    log.info("process %d following process 0's steps", jax.process_index())
    steps = engine.lockstep.follow(engine.run_published)
    log.info("process %d ran %d steps; leader stopped", jax.process_index(), steps)
    return 0
