"""Speculative decoding with a draft model (``--speculative draft --draft-model SPEC``): the
draft's own paged KV cache and its two jitted steps.

A draft model is a smaller decoder with the served model's tokenizer, or the served model's
own int8 copy (``self:int8``, ``model.factory.quantized_copy``). It proposes the K drafts
that the verify step (``serving.engine.verify_step``) checks, so outputs are the served
model's whatever the draft proposes (the acceptance rule of ``serving.core.sched.speculative``).
The scheme is speculative decoding's (Leviathan, Kalman, Matias, "Fast Inference from
Transformers via Speculative Decoding", 2023; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023); the code is our own.

The draft's cache has the served cache's pages (the same count and page size, its own
layers, KV heads and head size), and a request's pages hold both models' K/V at the same
page ids, so the KV-cache manager and the page tables serve both unchanged. Two steps, each
jitted once per shape bucket with the cache donated:

    draft prefill   (params, kv, batch: PrefillBatch) -> kv
        run after every prefill step of the served model on the same batch: the draft's
        K/V of the same prompt chunks (images: their placeholder tokens' embeddings only).
    draft propose   (params, kv, batch: VerifyBatch) -> (kv, drafts [S, K] int32)
        K draft steps per row (K: the verify batch's width, fewer than ``num_tokens`` when
        K shrank under load; one program per width): step 0 feeds a 2-token chunk, the row's previous token and
        its last token at p - 1 and p (``VerifyBatch.prev_tokens``), then a ``lax.scan``
        of K - 1 one-token decode steps feeds its own drafts at p + 1 .. p + K - 1 (a draft over
        the served cache: step 0 is the scan's one-token step of the last token at p); step j
        draws draft j + 1: the argmax for a greedy row, a sample of the draft's
        distribution q (kept, [S, K, V]) for a temperature row
        (``serving.engine.sample.rejection``). Refeeding p - 1 writes the K/V of the last
        round's draft K when all K were accepted (the round never fed it), and rewrites
        the same K/V otherwise. A row with d < K drafts (``max_tokens``, the token budget)
        never writes K/V past p + d.

The verify step then replaces the batch's placeholder drafts with these (on the device: no
host round trip). After a verify step the draft's K/V is valid exactly where the served
model's is (positions up to the last accepted token). Not kept in step: tokens that a
request decodes without drafts (more than ``--speculative-max-batch`` requests running),
pages restored from the host tier, sent by KV transfer or found in the prefix cache after
plain decode wrote them. The draft then attends over stale K/V at those positions, which
lowers acceptance but never changes an output.

The served model's own int8 copy (``self:int8``) needs no cache of its own: it drafts over the
served cache (``shares_cache``), attending to the served model's K/V of every earlier token and
writing its own only at positions p .. p + d, which the verify step then overwrites with the
served model's (it writes every position it feeds). So ``self:int8`` costs no pages and no
prefill, and nothing it misses can go stale.

A self draft's **draft vocabulary** (``--draft-vocab N``, ``SpeculativeConfig.draft_vocab_for``;
32768 by default): its head computes logits over N of the served vocabulary's ids only
(``serving.config.draft_vocab``: for Gemma 3 the corpus's most frequent ids, then the lowest;
:func:`head_slice`: those rows of the tied embedding, or columns of an untied head, with their
scales), so a draft step of Gemma 3 270M reads its int8 layers (~94 MB) and 21 MB of head
instead of the whole 262144-row head (168 MB). The draft proposes its argmax (or samples q)
among those ids, mapped back to the served ids, and q is zero at the others ([S, K, V]:
:func:`full_vocab`), which speculative sampling's rule handles as any q (the residual
max(0, p - q) covers them). The structured-output mask is not applied to such a draft (those
rows do not speculate, and any q keeps the rule exact). Input tokens are looked up in the full
float32 table (``embed_lookup``), which a quantized model always has. With int8-served weights
the self draft is the served model itself with the head slice: no second copy of the layers.

Memory: :func:`shared_pages` splits the page budget of ``--num-pages`` served pages
between the two caches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention_metadata import AttentionMetadata
from model.kv_cache import KVCache
from serving.config.engine_config import EngineConfig
from serving.engine.backend_policy import BackendPolicy
from serving.engine.sample.rejection import draft_sample


def shared_pages(num_pages: int, served_cfg, draft_cfg) -> int:
    """Pages each cache gets when a draft model's cache shares the memory of ``num_pages``
    pages of the served model's.

    Args:
      num_pages: the served cache's page budget (``--num-pages``, page 0 included).
      served_cfg, draft_cfg: the two models' ``model.config.ModelConfig`` (a page's bytes are
        proportional to layers x KV heads x head size; both caches have one dtype).

    Returns:
      floor(num_pages x served / (served + draft)), at least 2.
    """
    def per_page(c):
        return c.num_layers * c.num_kv_heads * c.head_dim

    return max(2, num_pages * per_page(served_cfg) // (per_page(served_cfg) + per_page(draft_cfg)))


def _draft_prefill(graphdef, compute, params, kv: KVCache, batch) -> KVCache:
    model = nnx.merge(graphdef, params)
    kv = kv.copy_pages(batch.copy_src, batch.copy_dst)  # forked requests' pages, as the served cache
    md = batch.attention_metadata(kv.page_size)
    _, kv = model(batch.tokens, batch.positions, kv, md, batch.logits_indices, compute=compute)
    return kv


def _draft_propose(graphdef, compute, argmax_block, num_tokens: int, refeed: bool, vocab: int,
                   params, kv: KVCache, batch, ids=None):
    """(kv, VerifyBatch) -> (kv, drafts [S, K] int32, q [S, K, V] float32); see the module
    docstring. ``vocab``: V, the served vocabulary; ``ids``: [N] int32 the draft vocabulary
    (the head's rows; None: all V)."""
    model = nnx.merge(graphdef, params)
    S = batch.page_table.shape[0]
    ps = kv.page_size
    starts, real, d, p0, row_sampling = draft_rows(batch)
    if ids is not None:  # no structured-output mask over the draft vocabulary (see the module docstring)
        row_sampling = dataclasses.replace(row_sampling, token_mask=None)
        sample = functools.partial(_sample_within, ids, argmax_block)
    else:
        sample = functools.partial(draft_sample, argmax_block=argmax_block)
    rows = jnp.arange(S)

    def step(carry, j):  # feeds draft j at p + j, draws draft j + 1
        kv, tok = carry
        pos = p0 + j
        md = AttentionMetadata(
            slot_mapping=kv_slots(batch.page_table, rows, pos, real & (j <= d), ps), page_table=batch.page_table,
            kv_lens=jnp.where(real, jnp.minimum(pos, p0 + d) + 1, 0).astype(jnp.int32),
            cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32), num_seqs=jnp.asarray(S, jnp.int32),
            mode="decode")
        logits, kv = model(tok, pos.astype(jnp.int32), kv, md, rows.astype(jnp.int32), compute=compute)
        nxt, q = sample(logits.astype(jnp.float32), pos + 1, row_sampling)
        return (kv, nxt), (nxt, q)

    if not refeed:  # a shared cache holds the served K/V at p - 1: step 0 is the scan's (j = 0) at p
        (kv, _), (drafts, q) = jax.lax.scan(step, (kv, batch.tokens[starts]), jnp.arange(num_tokens))
        return kv, drafts.T, jnp.swapaxes(full_vocab(q, vocab, ids), 0, 1)

    # Step 0 of a draft with its own cache: [previous token, last token] at p - 1, p (a 2-token
    # chunk per row; refeeding p - 1 writes an all-accepted round's last draft).
    pos2 = jnp.stack([jnp.maximum(p0 - 1, 0), p0], axis=1).reshape(-1).astype(jnp.int32)  # [2S]
    tok2 = jnp.stack([batch.prev_tokens, batch.tokens[starts]], axis=1).reshape(-1)
    write2 = jnp.repeat(real, 2) & ((jnp.arange(2 * S) % 2 == 1) | jnp.repeat(p0 > 0, 2))
    md = AttentionMetadata(
        slot_mapping=kv_slots(batch.page_table, jnp.repeat(rows, 2), pos2, write2, ps),
        page_table=batch.page_table, kv_lens=jnp.where(real, p0 + 1, 0).astype(jnp.int32),
        cu_q_lens=(2 * jnp.minimum(jnp.arange(S + 1), batch.num_seqs)).astype(jnp.int32),
        num_seqs=batch.num_seqs, mode="prefill")
    logits, kv = model(tok2, pos2, kv, md, (2 * rows + 1).astype(jnp.int32), compute=compute)
    first, q_first = sample(logits.astype(jnp.float32), p0 + 1, row_sampling)
    (kv, _), (rest, q_rest) = jax.lax.scan(step, (kv, first), jnp.arange(1, num_tokens))
    drafts = jnp.concatenate([first[None], rest], axis=0).T  # [S, K]
    q = jnp.concatenate([q_first[None], q_rest], axis=0)  # [K, S, N]
    return kv, drafts, jnp.swapaxes(full_vocab(q, vocab, ids), 0, 1)


def _sample_within(ids, argmax_block, logits, positions, s):
    """:func:`~serving.engine.sample.rejection.draft_sample` over a draft vocabulary's logits
    [R, N]: (served ids [R] int32, q [R, N] float32)."""
    tok, q = draft_sample(logits, positions, s, argmax_block)
    return ids[tok], q


def full_vocab(q: jax.Array, vocab: int, ids: jax.Array | None) -> jax.Array:
    """A draft vocabulary's distributions q [..., N] float32 over the served vocabulary: [..., vocab]
    with q[..., j] at id ``ids[j]`` and zero at every other id (what speculative sampling's
    rule reads, ``serving.engine.sample.rejection.accept_and_residual``); ``q`` itself when
    ``ids`` is None."""
    if ids is None:
        return q
    return jnp.zeros(q.shape[:-1] + (vocab,), q.dtype).at[..., ids].set(q)


def head_slice(model: nnx.Module, params: nnx.State, ids) -> nnx.State:
    """``params`` (``model``'s state, stored) with the LM head limited to the token ids ``ids``
    ([N] int, ascending): an untied ``lm_head`` [D, V]'s columns, else the tied ``embed``
    [V, D]'s rows, with their int8 scales (``name_scale``, the weight's rank); every other leaf
    the same array (nothing copied).

    Raises:
      ValueError: a tied head whose input lookup reads the same table (no ``embed_lookup``:
        the draft's inputs need every row).
    """
    flat = list(nnx.to_flat_state(params))
    untied = any(path[0] == "lm_head" for path, _ in flat)
    name, axis = ("lm_head", 1) if untied else ("embed", 0)
    if not untied and getattr(model, "embed_lookup", None) is None:
        raise ValueError("a draft vocabulary needs the model's float32 lookup table (embed_lookup) beside its "
                         "tied head: a quantized or low-precision model has one")
    vocab = model.cfg.vocab_size
    ids = jnp.asarray(ids, jnp.int32)
    out = []
    for path, v in flat:
        if path[0] in (name, name + "_scale"):
            value = v.get_value()
            if value.shape[axis] == vocab:
                v = v.replace(jnp.take(value, ids, axis=axis))
        out.append((path, v))
    return nnx.from_flat_state(out)


def draft_rows(batch):
    """A ``VerifyBatch``'s rows as a propose program reads them (traced).

    Returns:
      (starts [S] int32: each row's first token in the batch, its last known one; real [S]
      bool: not padding; wanted [S] int32: the drafts it asks for, 0 for padding; p0 [S]
      int32: that token's position; sampling: each row's ``SamplingArrays`` [S]).
    """
    S = batch.page_table.shape[0]
    starts = jnp.minimum(batch.cu_q_lens[:-1], batch.tokens.shape[0] - 1)
    real = jnp.arange(S) < batch.num_seqs
    wanted = jnp.where(real, batch.cu_q_lens[1:] - batch.cu_q_lens[:-1] - 1, 0)
    return starts, real, wanted, batch.positions[starts], jax.tree.map(lambda a: a[starts], batch.sampling)


def kv_slots(page_table: jax.Array, rows: jax.Array, pos: jax.Array, write: jax.Array, page_size: int) -> jax.Array:
    """[N] int32 the KV slot (page * page_size + offset) of token i of row ``rows[i]`` at
    position ``pos[i]`` through ``page_table`` [S, P] int32; 0 (the null page) where
    ``write[i]`` is false. rows, pos: [N] int32; write: [N] bool."""
    page = page_table[rows, jnp.minimum(pos // page_size, page_table.shape[1] - 1)]
    return jnp.where(write, page * page_size + pos % page_size, 0).astype(jnp.int32)


class DraftModel:
    """A draft model's parameters, KV cache and jitted steps (single device). Not
    thread-safe: the engine calls it from its one caller's thread."""

    def __init__(self, model: nnx.Module, cfg: EngineConfig, policy: BackendPolicy, num_tokens: int,
                 shares_cache: bool = False, params: nnx.State | None = None, draft_ids=None):
        """Args:
          model: a decoder of ``model/`` (its own config; the served model's vocabulary).
          cfg: the served engine's sizes (the draft cache has its ``num_pages`` and ``page_size``).
          policy: the served engine's backend policy (storage and compute of the draft too).
          num_tokens: K, the most drafts proposed per row.
          shares_cache: the draft is the served model's own copy (``self:int8``): it has no
            cache and no prefill of its own, and drafts over the served cache (see the module
            docstring).
          params: ``model``'s parameters as the engine already stores them (the served int8
            weights, or the engine's int8 copy): the draft reads those arrays; None: its own
            (``policy.store_params``).
          draft_ids: [N] int ascending, the draft vocabulary (the head's ids:
            ``serving.config.draft_vocab``, :func:`head_slice`); None: the whole vocabulary.

        Raises:
          ValueError: what :func:`head_slice` raises.
        """
        self.model_cfg = model.cfg
        self.num_tokens = num_tokens
        self.shares_cache = shares_cache
        graphdef, own = nnx.split(model)
        self.params = policy.store_params(own) if params is None else params
        vocab = model.cfg.vocab_size
        self.draft_ids = None if draft_ids is None or len(draft_ids) == vocab else jnp.asarray(draft_ids, jnp.int32)
        if self.draft_ids is not None:
            self.params = head_slice(model, self.params, self.draft_ids)
        stored = policy.storage_dtype(jnp.dtype(cfg.kv_dtype))
        self.kv = None if shares_cache else KVCache.zeros(model.cfg, cfg.num_pages, cfg.page_size, stored)
        compute = policy.compute(dtype=model.dtype)
        jit = functools.partial(jax.jit, donate_argnames=("kv",))
        self._prefill = jit(functools.partial(_draft_prefill, graphdef, compute))
        self._proposers = {}  # drafts per row (the verify batch's width) -> its jitted propose step
        self._make_propose = lambda width: jit(functools.partial(  # noqa: E731
            _draft_propose, graphdef, compute, policy.argmax_block, width, not shares_cache, vocab))

    def prefill(self, batch) -> None:
        """Dispatches the draft's prefill of a served prefill step's ``PrefillBatch`` (nothing
        when it shares the served cache)."""
        if not self.shares_cache:
            self.kv = self._prefill(self.params, self.kv, batch)

    def propose(self, batch, served_kv: KVCache | None = None):
        """Dispatches the draft steps of a ``VerifyBatch``.

        Args:
          served_kv: with ``shares_cache``, the served cache (donated: use the one returned).

        Returns:
          (drafts [S, K] int32, q [S, K, V] float32) device arrays, not synced: row i's first
          ``cu_q_lens[i + 1] - cu_q_lens[i] - 1`` drafts and the distributions they were drawn
          from (temperature rows; ``serving.engine.sample.rejection``); with ``shares_cache``,
          (served cache, drafts, q).
        """
        propose = proposer(self._proposers, self._make_propose, batch)
        if self.shares_cache:
            return propose(self.params, served_kv, batch, self.draft_ids)
        self.kv, drafts, q = propose(self.params, self.kv, batch, self.draft_ids)
        return drafts, q


def proposer(cache: dict, make, batch):
    """The propose program of a verify batch's width K = T // S - 1 (the drafts it proposes
    per row: fewer when K shrank under load), made by ``make(K)`` once and kept in ``cache``."""
    width = batch.tokens.shape[0] // batch.slot_ids.shape[0] - 1
    if width not in cache:
        cache[width] = make(width)
    return cache[width]


def replace_drafts(tokens: jax.Array, token_rows: jax.Array, cu_q_lens: jax.Array, real: jax.Array,
                   drafts: jax.Array) -> jax.Array:
    """[T] int32 a verify batch's tokens with each row's placeholder drafts replaced by
    ``drafts`` [S, K] (traced; inside the verify step)."""
    K = drafts.shape[1]
    off = jnp.arange(tokens.shape[0]) - cu_q_lens[token_rows]
    picked = drafts[token_rows, jnp.clip(off - 1, 0, K - 1)]
    return jnp.where(real & (off >= 1), picked, tokens).astype(tokens.dtype)

