"""The engine: device state and the two jitted step functions.

It owns the parameters (split once from the NNX model), the paged KV cache
and a per-slot "last token" buffer, and executes the steps that the batching
loop (``serving.engine_loop``) runs for the scheduler. Step functions are pure and the cache is
donated, so a step updates the cache in place::

    prefill_step(params, kv_cache, tokens [T], positions [T], cu_q_lens [S+1],
                 kv_lens [S], page_table [S, P], num_seqs [], logits_indices [S],
                 sampling [S], slot_ids [S], slot_tokens [slots])
        -> (kv_cache, next_tokens [S], slot_tokens)
    decode_step(params, kv_cache, slot_ids [B], positions [B], page_table [B, P],
                lengths [B], sampling [B], slot_tokens [slots])
        -> (kv_cache, next_tokens [B], slot_tokens)

Shapes are fixed per compilation and come from small bucket sets (JetStream's
approach), so the number of compiled programs stays small:
  * T: token-count buckets, powers of two from 16 up to the prefill chunk.
  * B: decode batch buckets, powers of two from ``min_decode_batch`` up to
    the slot count; a step's rows are the running slots (gathered by
    ``slot_ids``), so a lone stream does not pay for 32 slots.
  * P: page-table width buckets, powers of two (in pages) from 512 tokens'
    worth up to ``max_pages_per_seq``, covering the longest sequence in the
    step, so attention work follows the real context length.

The decode step reads its input tokens from ``slot_tokens`` on device and
writes its outputs back there, so the host never has to wait for step n's
tokens before dispatching step n+1 (JetStream-style pipelining).

Sharded serving: given a ``jax.sharding.Mesh`` (``sharding.mesh``), the
parameters are placed by their logical axes (``sharding.placement``), the KV
cache is created in its sharding (KV heads over ``tensor`` where they divide
it, pages over ``data``), and both steps are jitted with that cache sharding
as their output sharding and run under ``jax.set_mesh(mesh)`` (which the MoE
layer's expert-parallel ``shard_map`` reads). XLA's SPMD partitioner inserts
the tensor-parallel collectives. Host inputs are replicated.

Multi-host: with a ``lockstep`` (``sharding.multihost.Lockstep``), process 0
publishes each step's host arrays before running it and the other processes
run the same step from what they receive (``Lockstep.follow``), so every
process takes part in every collective in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.kv_cache import KVCache
from serving.sampling import SamplingArrays, sample

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine.

    Attributes:
      max_slots: decode rows (concurrently running sequences).
      page_size: tokens per KV page.
      num_pages: KV pool size in pages, including the null page 0.
      max_model_len: context window in tokens (prompt + generated).
      prefill_chunk: most tokens in one prefill step (a power of two >= 16).
      max_prefill_seqs: sequences packed into one prefill step (S).
      min_decode_batch: smallest decode batch bucket (XLA:CPU runs bf16
        matrix-vector products far slower than small matrix products).
      kv_dtype: KV cache dtype name ("float32" or "bfloat16").
    """

    max_slots: int = 32
    page_size: int = 16
    num_pages: int = 4096
    max_model_len: int = 8192
    prefill_chunk: int = 512
    max_prefill_seqs: int = 1
    min_decode_batch: int = 8
    kv_dtype: str = "float32"

    def __post_init__(self):
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
        if self.max_model_len % self.page_size:
            raise ValueError("max_model_len must be a multiple of page_size")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        # A pool smaller than one full context is allowed: requests that could
        # never fit are rejected at submit (RequestRejectedError).

    @property
    def max_pages_per_seq(self) -> int:
        return self.max_model_len // self.page_size


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def token_bucket(n: int, cfg: EngineConfig) -> int:
    """Prefill token-count bucket for n tokens (16, 32, ..., prefill_chunk)."""
    return _pow2_at_least(n, 16, cfg.prefill_chunk)


MIN_PAGE_BUCKET_TOKENS = 512
"""The narrowest page-table bucket, in tokens: attention over 512 tokens costs
little next to reading the weights, and fewer buckets mean fewer programs."""


def page_bucket(num_pages: int, cfg: EngineConfig) -> int:
    """Page-table width bucket covering num_pages (powers of two, >= 512 tokens' worth)."""
    lo = max(1, min(MIN_PAGE_BUCKET_TOKENS // cfg.page_size, cfg.max_pages_per_seq))
    return _pow2_at_least(num_pages, lo, cfg.max_pages_per_seq)


def batch_bucket(n: int, cfg: EngineConfig) -> int:
    """Decode batch bucket for n running slots."""
    return _pow2_at_least(n, min(cfg.min_decode_batch, cfg.max_slots), cfg.max_slots)


def _prefill_step(graphdef, params, kv_cache, tokens, positions, cu_q_lens, kv_lens, page_table,
                  num_seqs, logits_indices, sampling, slot_ids, slot_tokens):
    model = nnx.merge(graphdef, params)
    page_size = kv_cache.page_size
    seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(tokens.shape[0]), side="right")
    valid = jnp.arange(tokens.shape[0]) < cu_q_lens[num_seqs]
    seq = jnp.minimum(seq, page_table.shape[0] - 1)
    page = page_table[seq, positions // page_size]
    slot_mapping = jnp.where(valid, page * page_size + positions % page_size, 0).astype(jnp.int32)
    md = AttentionMetadata(slot_mapping=slot_mapping, page_table=page_table, kv_lens=kv_lens,
                           cu_q_lens=cu_q_lens, num_seqs=num_seqs, mode="prefill")
    logits, kv_cache = model(tokens, positions, kv_cache, md, logits_indices)
    next_tokens = sample(logits, kv_lens, sampling)
    real = jnp.arange(slot_ids.shape[0]) < num_seqs
    # Padding rows scatter out of bounds and are dropped.
    slot_tokens = slot_tokens.at[jnp.where(real, slot_ids, slot_tokens.shape[0])].set(
        next_tokens, mode="drop")
    return kv_cache, next_tokens, slot_tokens


def _decode_step(graphdef, params, kv_cache, slot_ids, positions, page_table, lengths, sampling,
                 slot_tokens):
    model = nnx.merge(graphdef, params)
    page_size = kv_cache.page_size
    rows = slot_ids.shape[0]
    tokens = slot_tokens[jnp.minimum(slot_ids, slot_tokens.shape[0] - 1)]
    real = lengths > 0
    page = page_table[jnp.arange(rows), positions // page_size]
    slot_mapping = jnp.where(real, page * page_size + positions % page_size, 0).astype(jnp.int32)
    md = AttentionMetadata(slot_mapping=slot_mapping, page_table=page_table, kv_lens=lengths,
                           cu_q_lens=jnp.arange(rows + 1, dtype=jnp.int32),
                           num_seqs=jnp.asarray(rows, jnp.int32), mode="decode")
    logits, kv_cache = model(tokens, positions, kv_cache, md, jnp.arange(rows, dtype=jnp.int32))
    next_tokens = sample(logits, lengths, sampling)
    slot_tokens = slot_tokens.at[jnp.where(real, slot_ids, slot_tokens.shape[0])].set(
        next_tokens, mode="drop")
    return kv_cache, next_tokens, slot_tokens


@dataclasses.dataclass
class PrefillChunk:
    """One sequence's share of a prefill step (host side).

    Attributes:
      slot: the slot the sequence runs in.
      tokens: this chunk's token ids.
      start: position of the chunk's first token (tokens before it are cached).
      pages: the sequence's pages, in order (covering at least start + len(tokens)).
      sampling: (temperature, top_k, top_p, seed), used if this chunk ends the prompt.
    """

    slot: int
    tokens: list[int]
    start: int
    pages: list[int]
    sampling: tuple[float, int, float, int]


@dataclasses.dataclass
class DecodeRow:
    """One running slot's share of a decode step (host side).

    Attributes:
      slot: the slot; its input token is the slot's last token on device.
      position: position of that input token (= tokens in cache before this step).
      pages: the sequence's pages.
      sampling: (temperature, top_k, top_p, seed).
    """

    slot: int
    position: int
    pages: list[int]
    sampling: tuple[float, int, float, int]


class Engine:
    """Device state plus compiled steps. Not thread-safe: one caller (the batching loop)."""

    def __init__(self, model: nnx.Module, cfg: EngineConfig, mesh=None, rules=None, lockstep=None):
        """Args:
          model: a decoder of ``model/`` (Gemma3 or Llama) with ``.cfg``.
          cfg: engine sizes.
          mesh: optional ``jax.sharding.Mesh`` with axes data, tensor, expert.
          rules: ``sharding.rules.ShardingRules`` (default: configs/sharding.yaml).
          lockstep: optional ``sharding.multihost.Lockstep`` (multi-process serving).

        Raises:
          ValueError: the mesh cannot split the model (e.g. tensor does not divide heads).
        """
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.mesh = mesh
        self.lockstep = lockstep
        self.graphdef, self.params = nnx.split(model)
        kv_dtype = jnp.dtype(cfg.kv_dtype)
        if mesh is None:
            self.kv_cache = KVCache.zeros(model.cfg, cfg.num_pages, cfg.page_size, kv_dtype)
            self.slot_tokens = jnp.zeros((cfg.max_slots,), jnp.int32)
            out_shardings = None
        else:
            from kernels_pallas.kv_storage import storage_dtype
            from sharding.placement import kv_cache_sharding, place_params, replicated, sharded_zeros
            from sharding.rules import ShardingRules

            rules = rules or ShardingRules.default()
            self.params = place_params(self.params, mesh, rules)
            shape = KVCache.shape(model.cfg, cfg.num_pages, cfg.page_size)
            kv_sh = kv_cache_sharding(shape, mesh, rules)
            stored = storage_dtype(kv_dtype)
            self.kv_cache = KVCache(sharded_zeros(shape, stored, kv_sh), sharded_zeros(shape, stored, kv_sh))
            rep = replicated(mesh)
            self.slot_tokens = sharded_zeros((cfg.max_slots,), jnp.int32, rep)
            out_shardings = (KVCache(kv_sh, kv_sh), rep, rep)
        self._prefill = jax.jit(functools.partial(_prefill_step, self.graphdef), donate_argnums=(1, 11),
                                out_shardings=out_shardings)
        self._decode = jax.jit(functools.partial(_decode_step, self.graphdef), donate_argnums=(1, 7),
                               out_shardings=out_shardings)
        self.compile_times: dict[tuple, float] = {}
        self._in_flight = None
        self._bound_in_flight = (mesh is not None and mesh.size > 1
                                 and mesh.devices.flat[0].platform == "cpu")

    def run_step(self, kind: str, host: tuple) -> jax.Array:
        """Runs one step from its host arrays (``kind``: "prefill" or "decode").

        With a lockstep, process 0 publishes ``host`` first so that the other
        processes run the same step. Returns the step's next_tokens (device array).
        """
        if self.lockstep is not None:
            self.lockstep.publish(kind, host)
        if self._bound_in_flight and self._in_flight is not None:
            # XLA:CPU runs every fake device's share of a collective on one shared
            # thread pool; with many multi-device steps queued, the participants of
            # a later step's all-gather can hold the threads that an earlier one
            # waits for, and the step deadlocks (seen: 7 of 8 devices waiting in an
            # all-gather within 2000 unsynchronised tiny-moe decode steps on 1x1x8). So on CPU
            # a sharded step waits for the previous one before it is dispatched.
            jax.block_until_ready(self._in_flight)
        fn = self._prefill if kind == "prefill" else self._decode
        if self.mesh is not None and jax.process_count() > 1:
            from sharding.multihost import global_inputs

            host = global_inputs(host, self.mesh)
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with ctx:
            self.kv_cache, next_tokens, self.slot_tokens = fn(
                self.params, self.kv_cache, *host, self.slot_tokens)
        self._in_flight = next_tokens
        return next_tokens

    # -- prefill ---------------------------------------------------------------

    def prefill(self, chunks: list[PrefillChunk]) -> jax.Array:
        """Dispatches one prefill step over up to max_prefill_seqs chunks.

        Returns:
          next_tokens: [S] int32 device array (not yet synced); row i is the
          token sampled after chunk i (meaningful only for a prompt's last chunk).

        Raises:
          ValueError: too many chunks or tokens for one step.
        """
        cfg = self.cfg
        S = cfg.max_prefill_seqs
        n_tok = sum(len(c.tokens) for c in chunks)
        if not chunks or len(chunks) > S or n_tok > cfg.prefill_chunk:
            raise ValueError(f"prefill step takes 1..{S} chunks and <= {cfg.prefill_chunk} tokens")
        T = token_bucket(n_tok, cfg)
        max_kv = max(c.start + len(c.tokens) for c in chunks)
        P = page_bucket(-(-max_kv // cfg.page_size), cfg)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        cu = np.full(S + 1, n_tok, np.int32)
        kv_lens = np.zeros(S, np.int32)
        page_table = np.zeros((S, P), np.int32)
        logits_indices = np.zeros(S, np.int32)
        slot_ids = np.zeros(S, np.int32)
        off = 0
        for i, c in enumerate(chunks):
            n = len(c.tokens)
            tokens[off:off + n] = c.tokens
            positions[off:off + n] = np.arange(c.start, c.start + n)
            cu[i] = off
            kv_lens[i] = c.start + n
            used = -(-(c.start + n) // cfg.page_size)
            page_table[i, :used] = c.pages[:used]
            logits_indices[i] = off + n - 1
            slot_ids[i] = c.slot
            off += n
        cu[len(chunks)] = off
        sampling = SamplingArrays.from_rows([c.sampling for c in chunks], S)
        key = ("prefill", T, P)
        t0 = time.perf_counter()
        next_tokens = self.run_step("prefill", (tokens, positions, cu, kv_lens, page_table,
                                                np.int32(len(chunks)), logits_indices, sampling,
                                                slot_ids))
        self._note_compile(key, t0)
        return next_tokens

    # -- decode ----------------------------------------------------------------

    def decode(self, rows: list[DecodeRow]) -> jax.Array:
        """Dispatches one decode step for the given running slots.

        Returns:
          next_tokens: [B] int32 device array (not yet synced); row i belongs to rows[i].
        """
        cfg = self.cfg
        B = batch_bucket(len(rows), cfg)
        max_len = max(r.position + 1 for r in rows)
        P = page_bucket(-(-max_len // cfg.page_size), cfg)
        slot_ids = np.full(B, cfg.max_slots, np.int32)  # padding rows: out of range -> dropped
        positions = np.zeros(B, np.int32)
        lengths = np.zeros(B, np.int32)
        page_table = np.zeros((B, P), np.int32)
        for i, r in enumerate(rows):
            slot_ids[i] = r.slot
            positions[i] = r.position
            lengths[i] = r.position + 1
            used = -(-(r.position + 1) // cfg.page_size)
            page_table[i, :used] = r.pages[:used]
        sampling = SamplingArrays.from_rows([r.sampling for r in rows], B)
        key = ("decode", B, P)
        t0 = time.perf_counter()
        next_tokens = self.run_step("decode", (slot_ids, positions, page_table, lengths, sampling))
        self._note_compile(key, t0)
        return next_tokens

    def _note_compile(self, key: tuple, t0: float) -> None:
        if key not in self.compile_times:
            # The first call of a shape includes tracing and compiling (or a
            # persistent-cache hit); dispatch of later calls is asynchronous.
            self.compile_times[key] = time.perf_counter() - t0
            log.info("compiled %s in %.2f s", key, self.compile_times[key])

    def warmup(self) -> None:
        """Compiles (or loads from the persistent cache) the common programs up front:
        every prefill token bucket for a fresh prompt, and every decode
        (batch, page-table width) bucket, so no running stream stalls on a
        compile. Prefill of later chunks (a prefix in the cache) compiles on
        first use. Writes go to the null page 0 only, so the cache is unaffected."""
        cfg = self.cfg
        null_pages = [0] * cfg.max_pages_per_seq
        greedy = (0.0, 0, 1.0, 0)
        T = 16
        while T <= cfg.prefill_chunk:
            self.prefill([PrefillChunk(0, [0] * T, 0, null_pages, greedy)])
            T *= 2
        for B in sorted({batch_bucket(n, cfg) for n in range(1, cfg.max_slots + 1)}):
            for P in sorted({page_bucket(n, cfg) for n in range(1, cfg.max_pages_per_seq + 1)}):
                position = min(P * cfg.page_size, cfg.max_model_len) - 1
                self.decode([DecodeRow(0, position, null_pages, greedy)] * B)
        jax.block_until_ready(self.slot_tokens)
