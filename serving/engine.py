"""The engine: device state and the two jitted step functions.

It owns the parameters (split once from the NNX model), the device state (the
paged KV cache and each slot's last sampled token) and the backend policy,
and executes the steps that the engine loop (``serving.engine_loop``) plans
with the scheduler. The step contract (the current form of the one drawn in
the project's architecture notes)::

    prefill_step(params, state: DeviceState, batch: PrefillBatch) -> (state, next_tokens [S])
    decode_step(params, state: DeviceState, batch: DecodeBatch)   -> (state, next_tokens [B])

    DeviceState   kv_cache: KVCache    k, v [layers, kv_heads, num_pages, page_size, head_dim]
                  slot_tokens [slots]  int32: each slot's last sampled token
    PrefillBatch, DecodeBatch: serving.step_batch (shapes and buckets there and in
                  serving.engine_config)

Both are pure and jitted once per shape bucket, with ``state`` donated by name
(``donate_argnames``), so the cache is updated in place. What depends on the
platform is fixed when the engine is built, by its :class:`BackendPolicy`
(``serving.backend_policy``): the storage of bfloat16 KV pages and stacked
weights, the model's ``Compute`` (dot, attention implementation, MoE), the
argmax, the smallest decode bucket and the dispatch-sync rule.

A prefill row's sampled token (when the row ends its sequence's known tokens)
and every decode row's token are written into ``slot_tokens``; the decode step
reads its input tokens from there, so the host never waits for step n's tokens
before dispatching step n+1 (JetStream-style pipelining). A row's sample is
keyed by (seed, position), so it depends only on the row.

Sharded serving: given a ``jax.sharding.Mesh`` (``sharding.mesh``), the
parameters are placed by their logical axes (``sharding.placement``), the KV
cache is created in its sharding (KV heads over ``tensor`` where they divide
it, pages over ``data``), and both steps are jitted with that state sharding
as their output sharding and run under ``jax.set_mesh(mesh)`` (which the MoE
layer's expert-parallel ``shard_map`` reads; its mesh axis names come from
the sharding rules through ``Compute``). XLA's SPMD partitioner inserts the
tensor-parallel collectives. Batches are replicated.

Multi-host: with a ``lockstep`` (``sharding.multihost.Lockstep``), process 0
publishes each batch's kind and leaves before running it, and the other
processes run the same step from what they receive (:meth:`Engine.run_published`),
so every process takes part in every collective in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.compute import Compute
from model.kv_cache import KVCache
from serving.backend_policy import BackendPolicy
from serving.engine_config import EngineConfig, batch_bucket, page_bucket
from serving.sampling import sample
from serving.step_batch import DecodeBatch, PrefillBatch, batch_treedef
from serving.step_plan import GREEDY, DecodeRow, PrefillRow

log = logging.getLogger(__name__)

StepBatch = PrefillBatch | DecodeBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """What the steps update in place (donated).

    Attributes:
      kv_cache: the paged KV cache of all layers, in the policy's storage dtype.
      slot_tokens: [max_slots] int32, each slot's last sampled token.
    """

    kv_cache: KVCache
    slot_tokens: jax.Array


def _write_slots(slot_tokens: jax.Array, slot_ids: jax.Array, real: jax.Array,
                 tokens: jax.Array) -> jax.Array:
    """slot_tokens with tokens[i] written to slot slot_ids[i] for real rows (padding rows
    scatter out of bounds and are dropped)."""
    return slot_tokens.at[jnp.where(real, slot_ids, slot_tokens.shape[0])].set(tokens, mode="drop")


def _prefill_step(graphdef, compute: Compute, argmax_block, params, state: DeviceState,
                  batch: PrefillBatch):
    model = nnx.merge(graphdef, params)
    md = batch.attention_metadata(state.kv_cache.page_size)
    logits, kv_cache = model(batch.tokens, batch.positions, state.kv_cache, md, batch.logits_indices,
                             compute=compute)
    next_tokens = sample(logits, batch.kv_lens, batch.sampling, argmax_block)
    slot_tokens = _write_slots(state.slot_tokens, batch.slot_ids, batch.real_rows, next_tokens)
    return DeviceState(kv_cache, slot_tokens), next_tokens


def _decode_step(graphdef, compute: Compute, argmax_block, params, state: DeviceState,
                 batch: DecodeBatch):
    model = nnx.merge(graphdef, params)
    rows = batch.slot_ids.shape[0]
    tokens = state.slot_tokens[jnp.minimum(batch.slot_ids, state.slot_tokens.shape[0] - 1)]
    md = batch.attention_metadata(state.kv_cache.page_size)
    logits, kv_cache = model(tokens, batch.positions, state.kv_cache, md,
                             jnp.arange(rows, dtype=jnp.int32), compute=compute)
    next_tokens = sample(logits, batch.lengths, batch.sampling, argmax_block)
    slot_tokens = _write_slots(state.slot_tokens, batch.slot_ids, batch.real_rows, next_tokens)
    return DeviceState(kv_cache, slot_tokens), next_tokens


class Engine:
    """Device state plus compiled steps. Not thread-safe: one caller (the engine loop)."""

    def __init__(self, model: nnx.Module, cfg: EngineConfig, mesh=None, rules=None, lockstep=None,
                 policy: BackendPolicy | None = None):
        """Args:
          model: a decoder of ``model/`` (Gemma3 or Llama) with ``.cfg``.
          cfg: engine sizes (``min_decode_batch`` None: the policy's).
          mesh: optional ``jax.sharding.Mesh`` with axes data, tensor, expert.
          rules: ``sharding.rules.ShardingRules`` (default: configs/sharding.yaml).
          lockstep: optional ``sharding.multihost.Lockstep`` (multi-process serving).
          policy: the backend policy (default: :meth:`BackendPolicy.detect` for the
            mesh's devices, or JAX's default backend).

        Raises:
          ValueError: the mesh cannot split the model (e.g. tensor does not divide heads).
        """
        self.policy = policy or BackendPolicy.detect(mesh)
        if cfg.min_decode_batch is None:
            cfg = dataclasses.replace(cfg, min_decode_batch=self.policy.min_decode_batch)
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.mesh = mesh
        self.lockstep = lockstep
        graphdef, params = nnx.split(model)
        kv_stored = self.policy.storage_dtype(jnp.dtype(cfg.kv_dtype))
        kv_shape = KVCache.shape(model.cfg, cfg.num_pages, cfg.page_size)
        if mesh is None:
            self.params = self.policy.store_params(params)
            self.state = DeviceState(KVCache.zeros(model.cfg, cfg.num_pages, cfg.page_size, kv_stored),
                                     jnp.zeros((cfg.max_slots,), jnp.int32))
            out_shardings = None
            compute = self.policy.compute(dtype=model.dtype)
        else:
            from sharding.placement import kv_cache_sharding, place_params, replicated, sharded_zeros
            from sharding.rules import ShardingRules

            rules = rules or ShardingRules.default()
            self.params = self.policy.store_params(place_params(params, mesh, rules))
            kv_sh = kv_cache_sharding(kv_shape, mesh, rules)
            rep = replicated(mesh)
            self.state = DeviceState(
                KVCache(sharded_zeros(kv_shape, kv_stored, kv_sh), sharded_zeros(kv_shape, kv_stored, kv_sh)),
                sharded_zeros((cfg.max_slots,), jnp.int32, rep))
            out_shardings = (DeviceState(KVCache(kv_sh, kv_sh), rep), rep)
            compute = self.policy.compute(rules, dtype=model.dtype)
        jit = functools.partial(jax.jit, donate_argnames=("state",), out_shardings=out_shardings)
        self._steps = {
            "prefill": jit(functools.partial(_prefill_step, graphdef, compute, self.policy.argmax_block)),
            "decode": jit(functools.partial(_decode_step, graphdef, compute, self.policy.argmax_block)),
        }
        self._treedefs = {kind: batch_treedef(kind) for kind in self._steps}
        self.compile_times: dict[tuple, float] = {}
        self._in_flight = None
        self._sync_each_step = self.policy.sync_sharded_steps and mesh is not None and mesh.size > 1

    @property
    def kv_cache(self) -> KVCache:
        return self.state.kv_cache

    # -- steps -------------------------------------------------------------------------

    def prefill(self, rows: Sequence[PrefillRow]) -> jax.Array:
        """Dispatches one prefill step over up to ``max_prefill_seqs`` plan rows.

        Returns:
          next_tokens: [S] int32 device array (not yet synced); element i is the
          token sampled after rows[i] (meaningful only when rows[i].samples).

        Raises:
          ValueError: too many rows or tokens for one step.
        """
        return self.run(PrefillBatch.from_rows(rows, self.cfg))

    def decode(self, rows: Sequence[DecodeRow]) -> jax.Array:
        """Dispatches one decode step over the given plan rows (running slots).

        Returns:
          next_tokens: [B] int32 device array (not yet synced); element i belongs to rows[i].

        Raises:
          ValueError: no rows or more than ``max_slots``.
        """
        return self.run(DecodeBatch.from_rows(rows, self.cfg))

    def run(self, batch: StepBatch) -> jax.Array:
        """Runs one step on a host-built batch; returns its next_tokens (device array).

        With a lockstep, process 0 publishes the batch first so that the other
        processes run the same step.
        """
        if self.lockstep is not None:
            self.lockstep.publish(batch.kind, [np.asarray(x) for x in jax.tree.leaves(batch)])
        return self._dispatch(batch)

    def run_published(self, kind: str, leaves: list[np.ndarray]) -> None:
        """A follower process's step: the batch the leader published, rebuilt from its leaves."""
        self._dispatch(jax.tree.unflatten(self._treedefs[kind], leaves))

    def _dispatch(self, batch: StepBatch) -> jax.Array:
        if self._sync_each_step and self._in_flight is not None:
            # On a multi-device CPU mesh every device's share of a collective runs on one
            # shared thread pool; with many multi-device steps queued, the participants of
            # a later step's all-gather can hold the threads that an earlier one waits for,
            # and the step deadlocks (seen: 7 of 8 devices waiting in an all-gather within
            # 2000 unsynchronised tiny-moe decode steps on 1x1x8). The policy says wait.
            jax.block_until_ready(self._in_flight)
        if self.mesh is not None and jax.process_count() > 1:
            from sharding.multihost import global_inputs

            batch = global_inputs(batch, self.mesh)
        key = batch.shape_key
        t0 = time.perf_counter()
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with ctx:
            self.state, next_tokens = self._steps[batch.kind](self.params, self.state, batch)
        if key not in self.compile_times:
            # The first call of a shape includes tracing and compiling (or a
            # persistent-cache hit); dispatch of later calls is asynchronous.
            self.compile_times[key] = time.perf_counter() - t0
            log.info("compiled %s in %.2f s", key, self.compile_times[key])
        self._in_flight = next_tokens
        return next_tokens

    def warmup(self) -> None:
        """Compiles (or loads from the persistent cache) the common programs up front:
        every prefill token bucket for a fresh prompt, and every decode
        (batch, page-table width) bucket, so no running stream stalls on a
        compile. Prefill of later chunks (a prefix in the cache) compiles on
        first use. Writes go to the null page 0 only, so the cache is unaffected."""
        cfg = self.cfg
        null_pages = (0,) * cfg.max_pages_per_seq
        T = 16
        while T <= cfg.prefill_chunk:
            self.prefill([PrefillRow("warmup", 0, 0, (0,) * T, null_pages, True, GREEDY)])
            T *= 2
        for B in sorted({batch_bucket(n, cfg) for n in range(1, cfg.max_slots + 1)}):
            for P in sorted({page_bucket(n, cfg) for n in range(1, cfg.max_pages_per_seq + 1)}):
                position = min(P * cfg.page_size, cfg.max_model_len) - 1
                self.decode([DecodeRow("warmup", 0, position, null_pages, GREEDY)] * B)
        jax.block_until_ready(self.state.slot_tokens)
