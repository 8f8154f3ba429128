"""Speculative decoding with an EAGLE-3 draft head (``--speculative eagle3 --draft-model DIR``):
the head's one-layer paged KV cache, the target features it drafts from, and its jitted steps.

The head (``model.eagle3``) drafts from the served model's hidden states at three layers
(``model.eagle3.aux_layers``), which the served model's prefill and verify steps return
(``model.llama.Llama.__call__``'s ``aux_layers``; the engine asks only when it holds a head).
Position t of the head's cache holds (token t + 1, the target's features at t); its
proposal at t is token t + 2. The engine keeps, per slot, the target's features at the
position before the row's last token (``hidden [slots, 3 Dt]``). Three jitted steps (the cache
donated, and the buffer where a step returns it):

    prefill  (params, kv, hidden, batch: PrefillBatch, aux [T, 3 Dt]) -> (kv, hidden)
        after each served prefill step: position i of a chunk gets (its prompt successor
        ``next_ids[i]``, aux[i]) where the successor is known (the chunk's last token of a
        whole prompt waits for propose); each row's features at its last token go to its slot.
    propose  (params, kv, hidden, batch: VerifyBatch) -> (kv, drafts [S, K], q [S, K, V])
        step 0 feeds (the row's last token x_p, its slot's features) at p - 1 and draws
        draft 1; a ``lax.scan`` of K - 1 steps feeds draft j at p + j - 1 with the head's
        own previous output as the hidden input and draws draft j + 1 (greedy: argmax;
        temperature: a sample of q, ``serving.engine.sample.rejection``). A row with d < K
        drafts never writes past p + d - 1.
    store    (hidden, aux [T, 3 Dt], batch: VerifyBatch, accepted [S]) -> hidden
        after each verify step: each row's features at its last accepted input (offset
        ``accepted``: the position before its new last token); after a plain decode step
        each row's features at the token it fed (``store_decode``).

The head's K/V at positions the verify step accepted are the ones its own drafting wrote
(the head's own hidden states, as EAGLE-3's training-time test trains it for), and step 0
rewrites the position before the new last token with the target's features. Not kept in
step (lower acceptance, never another output): tokens decoded without drafts (K shrunk to 0
under load, a token in flight) get no head K/V (their slot's features are kept fresh by the
decode step); pages from the host tier, KV transfer or the prefix cache have no head K/V.
Verification is the verify step's (``serving.engine.verify_step``): greedy rows exact,
temperature rows speculative sampling, so outputs are the served model's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.eagle3 import Eagle3Head, aux_layers
from model.kv_cache import KVCache
from serving.config.engine_config import EngineConfig
from serving.engine.backend_policy import BackendPolicy
from serving.engine.draft_model import draft_rows, kv_slots, proposer
from serving.engine.sample.rejection import draft_sample


def _prefill(graphdef, compute, params, kv: KVCache, hidden, batch, aux):
    head = nnx.merge(graphdef, params)
    kv = kv.copy_pages(batch.copy_src, batch.copy_dst)  # forked requests' pages, as the served cache
    md = batch.attention_metadata(kv.page_size)
    known = batch.real_tokens & (batch.next_ids >= 0)
    md = AttentionMetadata(slot_mapping=jnp.where(known, md.slot_mapping, 0).astype(jnp.int32),
                           page_table=md.page_table, kv_lens=md.kv_lens, cu_q_lens=md.cu_q_lens,
                           num_seqs=md.num_seqs, mode=md.mode)
    _, _, kv = head(jnp.maximum(batch.next_ids, 0), aux, batch.positions, kv, md, compute=compute)
    slots = jnp.where(batch.real_rows, batch.slot_ids, hidden.shape[0])
    hidden = hidden.at[slots].set(aux[batch.logits_indices].astype(hidden.dtype), mode="drop")
    return kv, hidden


def _propose(graphdef, compute, argmax_block, num_tokens: int, params, kv: KVCache, hidden, batch):
    head = nnx.merge(graphdef, params)
    S = batch.page_table.shape[0]
    ps = kv.page_size
    starts, real, d, p0, row_sampling = draft_rows(batch)
    rows = jnp.arange(S)
    feats = hidden[jnp.minimum(batch.slot_ids, hidden.shape[0] - 1)]

    def run(kv, tok, h, pos, write):
        md = AttentionMetadata(
            slot_mapping=kv_slots(batch.page_table, rows, pos, write, ps),
            page_table=batch.page_table, kv_lens=jnp.where(real, pos + 1, 0).astype(jnp.int32),
            cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32), num_seqs=jnp.asarray(S, jnp.int32), mode="decode")
        return head(tok, h, pos.astype(jnp.int32), kv, md, compute=compute)

    # Step 0: (last token x_p, the target's features at p - 1) at p - 1; draws draft 1 (at p + 1).
    pos0 = jnp.maximum(p0 - 1, 0)
    logits, out, kv = run(kv, batch.tokens[starts], feats, pos0, real & (p0 > 0))
    first, q_first = draft_sample(logits, p0 + 1, row_sampling, argmax_block)

    def step(carry, j):  # feeds draft j at p + j - 1, draws draft j + 1 (at p + j + 1)
        kv, tok, h = carry
        logits, out, kv = run(kv, tok, h, p0 + j - 1, real & (j <= d))
        nxt, q = draft_sample(logits, p0 + j + 1, row_sampling, argmax_block)
        return (kv, nxt, out), (nxt, q)

    (kv, _, _), (rest, q_rest) = jax.lax.scan(step, (kv, first, out), jnp.arange(1, num_tokens))
    drafts = jnp.concatenate([first[None], rest], axis=0).T  # [S, K]
    q = jnp.concatenate([q_first[None], q_rest], axis=0)  # [K, S, V]
    return kv, drafts, jnp.swapaxes(q, 0, 1)


def _store(hidden, aux, cu_q_lens, num_seqs, slot_ids, accepted):
    S = slot_ids.shape[0]
    real = jnp.arange(S) < num_seqs
    idx = jnp.minimum(cu_q_lens[:-1] + accepted, aux.shape[0] - 1)
    slots = jnp.where(real, slot_ids, hidden.shape[0])
    return hidden.at[slots].set(aux[idx].astype(hidden.dtype), mode="drop")


def _store_rows(hidden, aux, slot_ids, real):
    slots = jnp.where(real, slot_ids, hidden.shape[0])
    return hidden.at[slots].set(aux.astype(hidden.dtype), mode="drop")


class Eagle3Draft:
    """An EAGLE-3 head's parameters, KV cache, per-slot target features and jitted steps
    (single device). Not thread-safe: the engine calls it from its one caller's thread."""

    shares_cache = False

    def __init__(self, head: Eagle3Head, target_cfg, cfg: EngineConfig, policy: BackendPolicy, num_tokens: int):
        """Args:
          head: the draft head (``model.eagle3``), checked against ``target_cfg``.
          target_cfg: the served model's ``ModelConfig`` (its layers pick the aux layers).
          cfg: the served engine's sizes (the head's cache has its ``num_pages`` and ``page_size``).
          policy: the served engine's backend policy; num_tokens: K.
        """
        self.model_cfg = head.cfg.layer
        self.num_tokens = num_tokens
        self.aux_layers = aux_layers(head.cfg, target_cfg.num_layers)
        graphdef, params = nnx.split(head)
        self.params = params
        stored = policy.storage_dtype(jnp.dtype(cfg.kv_dtype))
        self.kv = KVCache.zeros(head.cfg.layer, cfg.num_pages, cfg.page_size, stored)
        self.hidden = jnp.zeros((cfg.max_slots, 3 * head.cfg.target_hidden_size), jnp.float32)
        compute = policy.compute(dtype=head.dtype)
        self._prefill = jax.jit(functools.partial(_prefill, graphdef, compute), donate_argnames=("kv", "hidden"))
        self._proposers = {}  # drafts per row (the verify batch's width) -> its jitted propose step
        self._make_propose = lambda width: jax.jit(  # noqa: E731
            functools.partial(_propose, graphdef, compute, policy.argmax_block, width), donate_argnames=("kv",))
        self._store = jax.jit(_store, donate_argnames=("hidden",))
        self._store_rows = jax.jit(_store_rows, donate_argnames=("hidden",))

    def prefill(self, batch, aux) -> None:
        """Dispatches the head's prefill of a served prefill step (``aux``: [T, 3 Dt] its features)."""
        self.kv, self.hidden = self._prefill(self.params, self.kv, self.hidden, batch, aux)

    def propose(self, batch):
        """Dispatches the draft steps of a ``VerifyBatch``; returns (drafts [S, K] int32,
        q [S, K, V] float32) device arrays, as ``serving.engine.draft_model.DraftModel.propose``."""
        propose = proposer(self._proposers, self._make_propose, batch)
        self.kv, drafts, q = propose(self.params, self.kv, self.hidden, batch)
        return drafts, q

    def store_decode(self, batch, aux) -> None:
        """Keeps each plain decode row's features (``aux`` [B, 3 Dt]: at the token it fed, the
        position before the token it samples)."""
        self.hidden = self._store_rows(self.hidden, aux, batch.slot_ids, batch.real_rows)

    def store(self, batch, accepted, aux) -> None:
        """Keeps each verified row's features at its last accepted input (device arrays)."""
        self.hidden = self._store(self.hidden, aux, batch.cu_q_lens, batch.num_seqs, batch.slot_ids, accepted)
