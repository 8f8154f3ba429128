"""The engine: device state and the two jitted step functions.

It owns the parameters (split once from the NNX model), the device state (the
paged KV cache and each slot's last sampled token) and the backend policy,
and executes the steps that the engine loop (``serving.runtime.engine_loop``) plans
with the scheduler. The step contract and the step programs: ``serving.engine.step_programs``.

Both are pure and jitted once per shape bucket, with ``state`` donated by name
(``donate_argnames``), so the cache is updated in place. What depends on the
platform is fixed when the engine is built, by its :class:`BackendPolicy`
(``serving.engine.backend_policy``): the storage of bfloat16 KV pages and stacked
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

LoRA (``cfg.max_loras`` > 0): the engine also holds the stacked adapter buffers of
``model.lora`` (``[layers, max_loras + 1, ...]`` per projection, slot 0 zeros, in the
model's dtype; not donated), written outside the steps one slot at a time
(:meth:`Engine.write_lora_slot`, called by ``serving.engine.lora_registry``); each
batch carries its rows' slots, so one compiled step serves any mix of adapters and
base rows. The backend policy picks the update's formulation
(:meth:`BackendPolicy.lora_formulation`). On a mesh the stacks are sharded like the
projections they adapt (``sharding.placement.lora_shardings``); multi-host engines and
mixtures of experts refuse LoRA.

int8 weights by row count (the policy's ``int8_max_rows``, ``--quantization auto``): the
engine also holds an int8 copy of the weights (``model.factory.quantized_copy``) with its own
jitted steps, and a step of at most that many token rows (:meth:`Engine.weights_for`) runs
with it. The choice is a function of the step's shape, so each shape still compiles one
program; the KV cache and the state are the same for both.

Speculative decoding with a draft model (``--speculative draft``): the engine also holds a
``serving.engine.draft_model.DraftModel`` (its own KV cache at the same page ids, prefilled
after each prefill step with the same batch; ``self:int8``: the served cache, no prefill, the
served int8 weights or their int8 copy with a head of the draft vocabulary), and
each verify step is preceded by the draft's propose step, whose [S, K] drafts (and their
distributions) the verify step takes on the device. Single device only. An EAGLE-3 head
(``--speculative eagle3``: ``serving.engine.eagle3_draft``) drafts from the served model's
hidden states at three layers, which the prefill, decode and verify steps then also return
(``aux_layers``; only with a head).

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
from kernels_pallas.kv_quant import SCALE_DTYPE, QuantizedPages, quantized_dtype
from model.kv_cache import KVCache
from model.lora import slot_weights, write_slot, zero_stacks
from serving.config.engine_config import (EngineConfig, batch_bucket, page_bucket, prefill_page_bucket,
                                          prefill_rows_bucket, token_bucket)
from serving.core.sched.step_plan import GREEDY, DecodeRow, PrefillRow
from serving.engine import kv_pages
from serving.engine.backend_policy import BackendPolicy
from serving.engine.sample import token_counts
from serving.engine.sample.logprobs import StepOutput
from serving.engine.sample.token_bitmask import mask_words, pad_rows
from serving.engine.step_batch import DecodeBatch, PrefillBatch, PromptLogprobsBatch, batch_treedef
from serving.engine.step_programs import DeviceState, decode_step, prefill_step, sample_step, score_step
from serving.engine.verify_step import VerifyBatch, verify_step, verify_treedef

log = logging.getLogger(__name__)

StepBatch = PrefillBatch | DecodeBatch | VerifyBatch


def _warmup_row_lengths(T: int, P: int, cfg: EngineConfig) -> list[list[int]]:
    """Fresh prompts' lengths (from position 0) that make a prefill step of token bucket T,
    page-table width P and each row bucket S, one list per (T, P, S) they can reach."""
    per_row = min(P * cfg.page_size, T)  # rows of at most P pages fill the T tokens
    if -(-T // per_row) > cfg.max_prefill_seqs:
        return []  # more rows than a step takes: fresh prompts never make this shape
    lens = [per_row] * (T // per_row) + ([T % per_row] if T % per_row else [])
    few = prefill_rows_bucket(1, cfg)
    if len(lens) <= few < cfg.max_prefill_seqs:  # also more rows: 1-token rows peeled off the first
        extra = few + 1 - len(lens)
        lens_more = [lens[0] - extra] + lens[1:] + [1] * extra
    else:  # also the fewest rows: as many full rows as the small bucket holds
        lens_more = [per_row] * few
    out = [lens]
    want_p = prefill_page_bucket(-(-max(lens) // cfg.page_size), cfg)
    if (min(lens_more) > 0 and token_bucket(sum(lens_more), cfg) == T
            and prefill_page_bucket(-(-max(lens_more) // cfg.page_size), cfg) == want_p
            and prefill_rows_bucket(len(lens_more), cfg) != prefill_rows_bucket(len(lens), cfg)):
        out.append(lens_more)
    return out


class Engine:
    """Device state plus compiled steps. Not thread-safe: one caller (the engine loop)."""

    def __init__(self, model: nnx.Module, cfg: EngineConfig, mesh=None, rules=None, lockstep=None,
                 policy: BackendPolicy | None = None, vision=None, draft: nnx.Module | None = None):
        """Args:
          model: a decoder of ``model/`` (Gemma3 or Llama) with ``.cfg``.
          cfg: engine sizes (``min_decode_batch`` None: the policy's).
          mesh: optional ``jax.sharding.Mesh`` with axes data, tensor, expert.
          rules: ``sharding.rules.ShardingRules`` (default: configs/sharding.yaml).
          lockstep: optional ``sharding.multihost.Lockstep`` (multi-process serving).
          policy: the backend policy (default: :meth:`BackendPolicy.detect` for the
            mesh's devices, or JAX's default backend).
          vision: the model's vision tower (``model.gemma3_vision.Gemma3VisionTower``) or
            None: prompts with images are refused. With one, every prefill step carries
            image inputs (``serving.engine.vision_inputs``).
          draft: the draft model of ``--speculative draft`` (``serving.engine.draft_model``);
            None with ``draft_model`` ``self:int8``: the served model's int8 copy.

        Raises:
          ValueError: the mesh cannot split the model (e.g. tensor does not divide heads);
            a vision tower with a mesh or a lockstep, or with an attention kernel other than "xla";
            LoRA (``cfg.max_loras``) on a multi-host engine or a mixture of experts;
            ``--speculative draft`` without a draft model or on a mesh or multi-host engine.
        """
        self.policy = policy or BackendPolicy.detect(mesh)
        self.vision = None
        if vision is not None:
            from serving.engine.vision_inputs import ImageEncoder

            if mesh is not None or lockstep is not None:
                raise ValueError("image inputs are served on a single-device engine only")
            if self.policy.attention.kernel != "xla":
                raise ValueError("image inputs need the xla attention kernel (--attention-impl xla), "
                                 f"not {self.policy.attention.kernel!r}")
            self.vision = ImageEncoder(vision)
        if cfg.min_decode_batch is None:
            cfg = dataclasses.replace(cfg, min_decode_batch=self.policy.min_decode_batch)
        self.cfg = cfg
        self.model_cfg = model.cfg
        self.mesh = mesh
        self.lockstep = lockstep
        graphdef, params = nnx.split(model)
        kv_stored = self.policy.storage_dtype(jnp.dtype(cfg.kv_dtype))
        kv_shape = KVCache.shape(model.cfg, cfg.num_pages, cfg.page_size)
        kv_format = self.policy.kv_format(cfg.kv_format, cfg.kv_dtype)
        if mesh is None:
            self.params = self.policy.store_params(params)
            q_stored = None if kv_format is None else self.policy.storage_dtype(quantized_dtype(kv_format))
            self.state = DeviceState(KVCache.zeros(model.cfg, cfg.num_pages, cfg.page_size, kv_stored, kv_format,
                                                   q_stored),
                                     jnp.zeros((cfg.max_slots,), jnp.int32),
                                     *token_counts.zeros(cfg.max_slots, model.cfg.vocab_size))
            out_shardings = None
            compute = self.policy.compute(dtype=model.dtype)
        else:
            from sharding.placement import kv_cache_sharding, place_params, replicated, sharded_zeros
            from sharding.rules import ShardingRules

            rules = rules or ShardingRules.default()
            self.params = self.policy.store_params(place_params(params, mesh, rules))
            kv_sh = kv_cache_sharding(kv_shape, mesh, rules)
            rep = replicated(mesh)
            values_sh = kv_sh
            kv_zeros = lambda: sharded_zeros(kv_shape, kv_stored, values_sh)  # noqa: E731
            if kv_format is not None:  # values and scale pages, split alike (head_dim is never split)
                from sharding.placement import kv_scale_sharding

                scale_sh = kv_scale_sharding(values_sh)
                kv_zeros = lambda: QuantizedPages(  # noqa: E731
                    sharded_zeros(kv_shape, self.policy.storage_dtype(quantized_dtype(kv_format)), values_sh),
                    sharded_zeros(kv_shape[:-1], SCALE_DTYPE, scale_sh), jnp.dtype(cfg.kv_dtype).name)
                kv_sh = QuantizedPages(values_sh, scale_sh, jnp.dtype(cfg.kv_dtype).name)
            self.state = DeviceState(
                KVCache(kv_zeros(), kv_zeros()),
                sharded_zeros((cfg.max_slots,), jnp.int32, rep),
                sharded_zeros((cfg.max_slots, model.cfg.vocab_size), jnp.int32, rep),
                sharded_zeros((cfg.max_slots, model.cfg.vocab_size), jnp.bool_, rep))
            out_shardings = (DeviceState(KVCache(kv_sh, kv_sh), rep, rep, rep), rep)
            compute = self.policy.compute(rules, dtype=model.dtype)
        self.lora_stacks = None
        self._lora_shardings = None
        if cfg.max_loras > 0:
            if lockstep is not None or model.cfg.is_moe:
                raise ValueError("LoRA adapters are served by a single-host engine of a dense model "
                                 "(not multi-host, not a mixture of experts)")
            self.lora_stacks = zero_stacks(model.cfg, cfg.max_loras, cfg.max_lora_rank, model.dtype)
            if mesh is not None:
                from sharding.placement import lora_shardings, place_tree

                self._lora_shardings = lora_shardings(self.lora_stacks, model.cfg, mesh, rules)
                self.lora_stacks = place_tree(self.lora_stacks, self._lora_shardings)
            compute = dataclasses.replace(compute, lora=self.policy.lora_formulation(
                cfg.max_loras + 1, cfg.max_lora_rank))
        self._write_pages = kv_pages.write_pages_fn(None if out_shardings is None else out_shardings[0])
        self._aux_layers = self._eagle3_layers(model, draft)
        self._steps = self._jit_steps(graphdef, compute, out_shardings)
        self._sample = jax.jit(functools.partial(sample_step, self.policy.argmax_block),
                               donate_argnames=("slot_tokens",),
                               out_shardings=None if out_shardings is None else out_shardings[1])
        self._int8 = None  # (steps, params) of the int8 copy (--quantization auto)
        qmodel = None
        if self.policy.int8_max_rows:
            from model.factory import quantized_copy

            qmodel = quantized_copy(model)
            qgraphdef, qparams = nnx.split(qmodel)
            if mesh is not None:
                from sharding.placement import place_params

                qparams = place_params(qparams, mesh, rules)
            self._int8 = (self._jit_steps(qgraphdef, compute, out_shardings), self.policy.store_params(qparams))
            log.info("int8 weights for steps of up to %d token rows, %s above",
                     self.policy.int8_max_rows, jnp.dtype(model.dtype).name)
        self.draft = self._draft_model(model, qmodel, draft)
        self._treedefs = {kind: batch_treedef(kind) for kind in ("prefill", "prefill_logprobs", "decode")}
        if "verify" in self._steps:
            self._treedefs["verify"] = verify_treedef()
        self.mask_words = mask_words(model.cfg.vocab_size)  # every batch carries a token mask
        self.compile_times: dict[tuple, float] = {}
        self._in_flight = None
        self._aux = None  # the last prefill step's features, for the EAGLE-3 head's prefill
        self._sync_each_step = self.policy.sync_sharded_steps and mesh is not None and mesh.size > 1

    def _eagle3_layers(self, model, draft) -> tuple[int, ...] | None:
        """The served layers an EAGLE-3 head fuses (``--speculative eagle3``), else None.

        Raises:
          ValueError: eagle3 without a head, a head for another target, a mesh."""
        spec = self.cfg.speculative
        if spec is None or spec.method != "eagle3":
            return None
        from model.eagle3 import Eagle3Head, aux_layers, check_target

        if not isinstance(draft, Eagle3Head):
            raise ValueError(f"--speculative eagle3: the EAGLE-3 head {spec.draft_model!r} was not given to the engine")
        if self.mesh is not None or self.lockstep is not None:
            raise ValueError("--speculative eagle3 is served on a single-device engine only")
        check_target(draft.cfg, model.cfg)
        return aux_layers(draft.cfg, model.cfg.num_layers)

    def _draft_model(self, model, qmodel, draft):
        """The :class:`~serving.engine.draft_model.DraftModel` of ``--speculative draft`` (the
        :class:`~serving.engine.eagle3_draft.Eagle3Draft` of ``eagle3``) or None."""
        spec = self.cfg.speculative
        if spec is None or spec.method not in ("draft", "eagle3"):
            return None
        from serving.config.speculative_config import SELF_INT8
        from serving.engine.draft_model import DraftModel

        if self.mesh is not None or self.lockstep is not None:
            raise ValueError("--speculative draft is served on a single-device engine only")
        if spec.method == "eagle3":
            from serving.engine.eagle3_draft import Eagle3Draft

            log.info("speculative drafts from the EAGLE-3 head %s (target layers %s), K = %d", spec.draft_model,
                     self._aux_layers, spec.num_tokens)
            return Eagle3Draft(draft, model.cfg, self.cfg, self.policy, spec.num_tokens)
        if draft is None and spec.draft_model == SELF_INT8:
            return self._self_draft(model, qmodel, spec)
        if draft is None:
            raise ValueError(f"--speculative draft: the draft model {spec.draft_model!r} was not given to the engine")
        log.info("speculative drafts from %s (%s, %d layers), K = %d", spec.draft_model, draft.cfg.name,
                 draft.cfg.num_layers, spec.num_tokens)
        return DraftModel(draft, self.cfg, self.policy, spec.num_tokens)

    def _self_draft(self, model, qmodel, spec):
        """The ``self:int8`` draft: the served model's int8 weights (the served ones when they are
        int8, else the engine's int8 copy of ``--quantization auto`` or a new one) with a head of
        the draft vocabulary (``SpeculativeConfig.draft_vocab_for`` ids, ``serving.config.draft_vocab``),
        over the served cache.

        Raises:
          ValueError: int8-served weights with the whole vocabulary (the draft would be the served
            model itself), a draft vocabulary above the served one."""
        from serving.engine.draft_model import DraftModel
        from serving.config.draft_vocab import draft_ids, frequent_ids

        vocab = model.cfg.vocab_size
        n = spec.draft_vocab_for(vocab)
        params = None
        if getattr(model, "quantization", "none") != "none":
            if n == vocab:
                raise ValueError(f"--draft-model {spec.draft_model} with the whole vocabulary ({vocab} ids) drafts "
                                 f"with the served {model.quantization} weights themselves: give a smaller "
                                 "--draft-vocab, or serve the weights with --quantization none")
            draft, params = model, self.params  # the served layers, only the head is narrower
        elif qmodel is not None:
            draft, params = qmodel, self._int8[1]  # the engine's int8 copy
        else:
            from model.factory import quantized_copy

            draft = quantized_copy(model)
        log.info("speculative drafts from %s (%s int8 weights, a head of %d of %d ids), K = %d", spec.draft_model,
                 "the served" if draft is model else "a copy of the", n, vocab, spec.num_tokens)
        ids = draft_ids(vocab, n, frequent_ids(model.cfg.architecture, vocab))
        return DraftModel(draft, self.cfg, self.policy, spec.num_tokens, shares_cache=True, params=params,
                          draft_ids=ids)

    def _jit_steps(self, graphdef, compute: Compute, out_shardings) -> dict:
        """The step functions of one model graph, jitted with ``state`` donated (the prefill
        and decode forwards; verify samples inside its program)."""
        jit = functools.partial(jax.jit, donate_argnames=("state",), out_shardings=out_shardings)
        aux = self._aux_layers  # an EAGLE-3 head's target layers: prefill and verify return them
        steps = {
            "prefill": jit(functools.partial(prefill_step, graphdef, compute, aux_layers=aux)),
            "decode": jit(functools.partial(decode_step, graphdef, compute, aux_layers=aux)),
            "score": jax.jit(functools.partial(score_step, graphdef, compute),
                             out_shardings=None if out_shardings is None else out_shardings[1]),
        }
        if self.cfg.speculative is not None:
            steps["verify"] = jit(functools.partial(verify_step, graphdef, compute, self.policy.argmax_block,
                                                    self.cfg.speculative.num_tokens, aux_layers=aux))
        return steps

    def weights_for(self, batch: StepBatch) -> str:
        """Which weights run ``batch``: "int8" for a step of at most the policy's
        ``int8_max_rows`` token rows (a decode batch's rows B, a prefill's or verify's tokens T)
        when the engine holds an int8 copy, else "served" (and always for a verify step
        after a draft model's steps). Depends only on the batch's shapes."""
        if self._int8 is None or (batch.kind == "verify" and self.draft is not None):
            return "served"  # a draft model's tokens are verified by the served weights
        rows = batch.slot_ids.shape[0] if batch.kind == "decode" else batch.tokens.shape[0]
        return "int8" if rows <= self.policy.int8_max_rows else "served"

    @property
    def kv_cache(self) -> KVCache:
        return self.state.kv_cache

    # -- steps -------------------------------------------------------------------------

    def prefill(self, rows: Sequence[PrefillRow], token_mask: np.ndarray | None = None, images=None):
        """Dispatches one prefill step over up to ``max_prefill_seqs`` plan rows (as the
        prompt-logprobs variant when a row has prompt tokens to score).

        `token_mask`: [len(rows), ceil(vocab / 32)] int32 structured-output
        bitmask of the rows (``serving.engine.sample.token_bitmask``), or None: unconstrained.
        `images`: {request id: its ``ImageInput``s} of rows whose prompts hold images (an
        engine with a vision tower only; their soft tokens come from its encoder cache).

        Returns:
          a :class:`~serving.engine.sample.logprobs.StepOutput` of [S] device arrays (not yet
          synced); row i is the token sampled after rows[i] (meaningful only when
          rows[i].samples). The variant returns ``(StepOutput, PromptLogprobs)``,
          the latter [T] in the batch's token order (rows back to back).

        Raises:
          ValueError: too many rows or tokens for one step.
        """
        cls = PromptLogprobsBatch if any(r.wants_prompt_logprobs for r in rows) else PrefillBatch
        mask = pad_rows(token_mask, prefill_rows_bucket(len(rows), self.cfg), self.mask_words)
        pack = None
        if self.vision is not None:
            from serving.engine.vision_inputs import pack_images

            def pack(rows, T):
                return pack_images(rows, images or {}, self.vision, T, self.model_cfg.hidden_size)
        batch = cls.from_rows(rows, self.cfg, mask, pack)
        out = self.run(batch)
        if self._aux_layers is not None:  # the EAGLE-3 head's, from the served step's features
            self.draft.prefill(batch.as_prefill(), self._aux)
            self._aux = None
        elif self.draft is not None:
            self.draft.prefill(batch.as_prefill())
        return out

    def decode(self, rows: Sequence[DecodeRow], token_mask: np.ndarray | None = None) -> StepOutput:
        """Dispatches one decode step over the given plan rows (running slots).

        `token_mask`: as for :meth:`prefill`.

        Returns:
          a :class:`~serving.engine.sample.logprobs.StepOutput` of [B] device arrays (not yet
          synced); row i belongs to rows[i].

        Raises:
          ValueError: no rows or more than ``max_slots``.
        """
        mask = pad_rows(token_mask, batch_bucket(max(len(rows), 1), self.cfg), self.mask_words)
        return self.run(DecodeBatch.from_rows(rows, self.cfg, mask))

    def verify(self, rows: Sequence[DecodeRow], max_drafts: int | None = None):
        """Dispatches one verify step (speculative decoding) over plan rows with their last
        token and drafts (``DecodeRow.last_token``, ``draft_ids``).

        ``max_drafts``: the K of the present load (``Scheduler.speculative_tokens_now``; None:
        ``num_speculative_tokens``). The step's width (drafts per row) is the draft bucket of
        the larger of it and the longest row's drafts, so steps of one load share a program
        whatever their n-gram matches, and a K that shrank computes fewer tokens.

        Returns:
          a :class:`~serving.engine.verify_step.VerifyOutput` of device arrays (not yet synced):
          row i's tokens start at sum(1 + len(rows[j].draft_ids) for j < i). With a draft
          model, the rows' draft ids are placeholders (only their count matters): the draft
          model's steps propose them first (``serving.engine.draft_model``).

        Raises:
          ValueError: speculative decoding is off, no rows, or more than ``max_slots``.
        """
        if self.cfg.speculative is None:
            raise ValueError("this engine was built without speculative decoding")
        spec = self.cfg.speculative
        width = spec.draft_bucket(max([len(r.draft_ids) for r in rows]
                                      + [spec.num_tokens if max_drafts is None else max_drafts, 1]))
        T = batch_bucket(max(len(rows), 1), self.cfg) * (width + 1)
        batch = VerifyBatch.from_rows(rows, self.cfg, width, pad_rows(None, T, self.mask_words))
        if self.draft is None:
            return self.run(batch)
        if not self.draft.shares_cache:
            return self._dispatch(batch, *self.draft.propose(batch))  # no lockstep with a draft model
        kv, drafts, q = self.draft.propose(batch, self.state.kv_cache)  # drafts over the served cache
        self.state = dataclasses.replace(self.state, kv_cache=kv)
        return self._dispatch(batch, drafts, q)

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Writes ``adapter`` (a ``model.lora_adapter.LoraAdapter``, None: zeros) into LoRA slot
        ``slot`` (1..max_loras) of the device stacks, ordered before every later step.

        Raises:
          ValueError: no LoRA on this engine, a slot out of range or a rank above max_lora_rank.
        """
        if self.lora_stacks is None:
            raise ValueError("this engine was built without LoRA (max_loras 0)")
        contents = slot_weights(adapter, self.model_cfg, self.cfg.max_lora_rank)
        stacks = write_slot(self.lora_stacks, slot, contents)
        if self._lora_shardings is not None:  # as placed (a no-op where the update kept them)
            stacks = jax.device_put(stacks, self._lora_shardings)
        self.lora_stacks = stacks

    # -- whole pages (KV transfer, host tier) ----------------------------------------

    def read_pages(self, page_ids: Sequence[int], chunk_pages: int) -> dict[str, jax.Array]:
        """Dispatches a copy of up to ``chunk_pages`` pages of every layer (``serving.engine.kv_pages``).

        Returns:
          the payload {name: device array}, not yet synced: "k", "v" [layers, kv_heads,
          chunk_pages, page_size, head_dim] in the storage dtype, and for a quantized cache
          "k_scale", "v_scale" [layers, kv_heads, chunk_pages, page_size] float32
          (``kv_pages.payload_names``); entries past ``len(page_ids)`` hold the null page.

        Raises:
          ValueError: too many pages; RuntimeError: a multi-host engine (not supported).
        """
        self._single_host("reading KV pages")
        return kv_pages.read_pages(self.state.kv_cache, kv_pages.pad_page_ids(page_ids, chunk_pages))

    def write_pages(self, page_ids: Sequence[int], payload) -> None:
        """Dispatches writing a payload of C pages (host or device arrays as :meth:`read_pages`
        returns, C >= len(page_ids); rows past ``len(page_ids)`` go to the null page) into the
        cache's pages ``page_ids``, ordered before every later step.

        Raises:
          ValueError: more pages than the chunk holds, or a payload of another KV format;
          RuntimeError: a multi-host engine.
        """
        self._single_host("writing KV pages")
        kv_pages.check_payload(self.state.kv_cache, payload)
        ids = kv_pages.pad_page_ids(page_ids, payload["k"].shape[2])
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
        with ctx:
            self.state = self._write_pages(self.state, ids, dict(payload))

    def _single_host(self, what: str) -> None:
        if self.lockstep is not None:
            raise RuntimeError(f"{what} is not supported on a multi-host engine")

    def run(self, batch: StepBatch):
        """Runs one step on a host-built batch; returns its output (device arrays).

        With a lockstep, process 0 publishes the batch first so that the other
        processes run the same step.
        """
        if self.lockstep is not None:
            self.lockstep.publish(batch.kind, [np.asarray(x) for x in jax.tree.leaves(batch)])
        return self._dispatch(batch)

    def run_published(self, kind: str, leaves: list[np.ndarray]) -> None:
        """A follower process's step: the batch the leader published, rebuilt from its leaves."""
        self._dispatch(jax.tree.unflatten(self._treedefs[kind], leaves))

    def _dispatch(self, batch: StepBatch, drafts=None, draft_probs=None):
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
        steps, params = self._int8 if self.weights_for(batch) == "int8" else (self._steps, self.params)
        with ctx:
            if batch.kind == "verify":
                self.state, out = steps[batch.kind](params, self.state, batch, drafts, draft_probs)
                if self._aux_layers is not None:  # the EAGLE-3 head keeps the accepted rows' features
                    out, aux = out
                    self.draft.store(batch, out.accepted, aux)
            elif batch.kind == "decode":
                self.state, logits = steps["decode"](params, self.state, batch, self.lora_stacks)
                if self._aux_layers is not None:  # the features at the token fed: the next propose's
                    logits, aux = logits
                    self.draft.store_decode(batch, aux)
                out = self._sample_rows(batch, logits)
            else:  # a prefill, and a prompt-logprobs one through the same forward program
                self.state, (logits, hidden, *aux) = steps["prefill"](params, self.state, batch.as_prefill(),
                                                                      self.lora_stacks)
                if aux:  # an EAGLE-3 head's features, for its prefill after this step (prefill())
                    self._aux = aux[0]
                out = self._sample_rows(batch, logits)
                if batch.kind == "prefill_logprobs":
                    out = (out, steps["score"](params, hidden, batch.next_ids))
        if key not in self.compile_times:
            # The first call of a shape includes tracing and compiling (or a
            # persistent-cache hit); dispatch of later calls is asynchronous.
            self.compile_times[key] = time.perf_counter() - t0
            log.info("compiled %s in %.2f s", key, self.compile_times[key])
        self._in_flight = out
        return out

    def _sample_rows(self, batch: PrefillBatch | DecodeBatch, logits):
        """Dispatches the sampler program on a forward's rows' logits; returns the step's output."""
        positions = batch.lengths if batch.kind == "decode" else batch.kv_lens
        st = self.state
        slot_tokens, out = self._sample(st.slot_tokens, st.output_counts, st.prompt_seen, logits, positions,
                                        batch.sampling, batch.slot_ids)
        self.state = dataclasses.replace(st, slot_tokens=slot_tokens)
        return out

    def warmup(self, decode: bool = True) -> None:
        """Compiles (or loads from the persistent cache) the common programs up front:
        every prefill (token bucket, page-table width, row bucket) that fresh prompts
        packed up to ``max_prefill_seqs`` per step can reach, and (``decode``) every decode
        and verify (batch, page-table width) bucket, so no running stream stalls on a
        compile. Also the last chunk of a prompt of at most ``prefill_chunk`` tokens
        that started in another step's bucket padding (``Scheduler._padding``): fewer
        tokens than the page-table width, in the fewest-rows bucket. Other later chunks (a prefix in
        the cache, a prompt longer than a chunk) compile on first use. Writes go to the
        null page 0 only, so the cache is unaffected.
        ``decode=False`` is for a replica that only computes prompts (``--role prefill``)."""
        cfg = self.cfg
        null_pages = (0,) * cfg.max_pages_per_seq
        chunk_pages = -(-min(cfg.prefill_chunk, cfg.max_model_len) // cfg.page_size)
        T = 16
        while T <= cfg.prefill_chunk:
            widths = {prefill_page_bucket(n, cfg) for n in range(1, -(-T // cfg.page_size) + 1)}
            for P in sorted(widths):
                for lens in _warmup_row_lengths(T, P, cfg):
                    self.prefill([PrefillRow("warmup", i, 0, (0,) * n, null_pages, True, GREEDY)
                                  for i, n in enumerate(lens)])
            wider = {prefill_page_bucket(n, cfg) for n in range(1, chunk_pages + 1)} - widths
            for P in sorted(wider):  # a last chunk of T tokens ending at P pages (one row)
                start = min(P * cfg.page_size, cfg.max_model_len) - T
                self.prefill([PrefillRow("warmup", 0, start, (0,) * T, null_pages, True, GREEDY)])
            T *= 2
        for B in sorted({batch_bucket(n, cfg) for n in range(1, cfg.max_slots + 1)}) if decode else ():
            for P in sorted({page_bucket(n, cfg) for n in range(1, cfg.max_pages_per_seq + 1)}):
                position = min(P * cfg.page_size, cfg.max_model_len) - 1
                self.decode([DecodeRow("warmup", 0, position, null_pages, GREEDY)] * B)
        spec = cfg.speculative if decode else None
        if spec is not None:  # verify buckets up to the batch size that speculates, at its K_eff
            shapes = {(batch_bucket(n, cfg), spec.draft_bucket(spec.tokens_at(n)))
                      for n in range(1, min(spec.max_batch, cfg.max_slots) + 1) if spec.tokens_at(n) > 0}
            for B, width in sorted(shapes):
                for P in sorted({page_bucket(n, cfg) for n in range(1, cfg.max_pages_per_seq + 1)}):
                    position = min(P * cfg.page_size, cfg.max_model_len) - 1 - width
                    row = DecodeRow("warmup", 0, max(position, 0), null_pages, GREEDY, last_token=0,
                                    draft_ids=(0,) * width)
                    self.verify([row] * B, width)
        jax.block_until_ready(self.state.slot_tokens)
