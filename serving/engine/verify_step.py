"""The verify step of speculative decoding: its batch, its output, and the jitted function.

Built on the prefill program's attention (``AttentionMetadata`` mode
"prefill": each row is a chunk of consecutive positions after its cached
tokens), with logits and sampling at every token instead of one per row.
Shapes (S = a decode batch bucket of rows, K = the step's drafts-per-row width: the
``SpeculativeConfig.draft_bucket`` of its longest row, at most ``num_speculative_tokens``,
so a step whose K shrank under load computes fewer tokens; T = S * (K + 1), P a page-table
bucket)::

    tokens [T]  positions [T]        row i's [last token, drafts...] back to back, then padding
    cu_q_lens [S + 1]  kv_lens [S]   row i owns tokens cu_q_lens[i]:cu_q_lens[i + 1]
    page_table [S, P]  num_seqs []   rows past num_seqs are padding (kv_lens 0)
    slot_ids [S]                     the slot each row's last emitted token is written to
    sampling [T]                     each token's row settings (padding: greedy)

The step (``verify_step``) runs the model over the T tokens (writing their
K/V), samples after every token exactly as a decode step samples after the
same input at the same position (``serving.engine.sample.logits_processors``, random key
``(seed, position + 1)``), counts each row's accepted drafts (the rule of
``serving.core.sched.speculative``), and writes each row's last emitted token into
``slot_tokens`` so that a plain decode step can follow it. It returns
:class:`VerifyOutput`: [T] sampled tokens (with log probabilities where asked)
and [S] accepted counts. The per-slot penalty counts are left alone: rows with
penalties never speculate.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention_metadata import AttentionMetadata
from serving.config.engine_config import EngineConfig, batch_bucket, page_bucket
from serving.core.sched.step_plan import DecodeRow
from serving.engine.draft_model import replace_drafts
from serving.engine.sample.logits_processors import process_logits, sample_processed
from serving.engine.sample.logprobs import StepOutput, token_logprobs
from serving.engine.sample.rejection import ACCEPT_STREAM, RESIDUAL_STREAM, accept_and_residual, stream_keys
from serving.engine.sample.sampling import SamplingArrays, sampling_logits


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """One verify step: S rows of 1 + d_i tokens (d_i <= K drafts) packed into T = S * (K + 1).

    Attributes:
      tokens: [T] int32 each row's last token then its drafts; padding after cu_q_lens[num_seqs].
      positions: [T] int32 absolute positions.
      cu_q_lens: [S + 1] int32 cumulative row lengths.
      kv_lens: [S] int32 tokens in the cache for each row after the step (0: padding row).
      page_table: [S, P] int32 each row's pages (covering its drafts).
      num_seqs: [] int32 real rows.
      slot_ids: [S] int32 each row's slot (padding rows: ``max_slots``, dropped).
      sampling: [T] each token's sampling settings (its row's).
      prev_tokens: [S] int32 each row's token before its last one (0: none; a draft model's
        first step refeeds it, ``serving.engine.draft_model``).
    """

    tokens: jax.Array
    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    num_seqs: jax.Array
    slot_ids: jax.Array
    sampling: SamplingArrays
    prev_tokens: jax.Array

    kind: ClassVar[str] = "verify"

    @classmethod
    def from_rows(cls, rows: Sequence[DecodeRow], cfg: EngineConfig, num_speculative_tokens: int,
                  token_mask: np.ndarray | None = None) -> "VerifyBatch":
        """Packs verify rows (``DecodeRow`` with ``last_token`` and ``draft_ids``) into numpy
        arrays of the step's buckets (`token_mask`: [T, W] int32 or None).

        Raises:
          ValueError: no rows, more than ``max_slots``, a row without its last token or
            with more than ``num_speculative_tokens`` drafts.
        """
        K = num_speculative_tokens
        if not rows or len(rows) > cfg.max_slots:
            raise ValueError(f"a verify step takes 1..{cfg.max_slots} rows, got {len(rows)}")
        if any(r.last_token < 0 or len(r.draft_ids) > K for r in rows):
            raise ValueError(f"verify rows need their last token and at most {K} drafts")
        S = batch_bucket(len(rows), cfg)
        T = S * (K + 1)
        P = page_bucket(_pages_for(max(r.position + 1 + len(r.draft_ids) for r in rows), cfg.page_size),
                        cfg)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        cu = np.zeros(S + 1, np.int32)
        kv_lens = np.zeros(S, np.int32)
        page_table = np.zeros((S, P), np.int32)
        slot_ids = np.full(S, cfg.max_slots, np.int32)
        prev = np.zeros(S, np.int32)
        settings, generated = [], []
        off = 0
        for i, r in enumerate(rows):
            n = 1 + len(r.draft_ids)
            tokens[off:off + n] = (r.last_token,) + tuple(r.draft_ids)
            positions[off:off + n] = np.arange(r.position, r.position + n)
            cu[i] = off
            kv_lens[i] = r.position + n
            used = _pages_for(r.position + n, cfg.page_size)
            page_table[i, :used] = r.page_ids[:used]
            slot_ids[i] = r.slot
            prev[i] = max(r.prev_token, 0)
            settings += [r.sampling] * n
            generated += [r.num_generated + j for j in range(n)]
            off += n
        cu[len(rows):] = off
        sampling = SamplingArrays.from_rows(settings, T, generated, token_mask)
        return cls(tokens, positions, cu, kv_lens, page_table, np.int32(len(rows)), slot_ids, sampling, prev)

    @property
    def shape_key(self) -> tuple:
        """("verify", S, T, P): which compiled program runs this batch."""
        return (self.kind, self.slot_ids.shape[0], self.tokens.shape[0], self.page_table.shape[1])

    @property
    def token_rows(self) -> jax.Array:
        """[T] int32 the row of each token (padding tokens: the last row; traced)."""
        T = self.tokens.shape[0]
        seq = jnp.searchsorted(self.cu_q_lens[1:], jnp.arange(T), side="right")
        return jnp.minimum(seq, self.page_table.shape[0] - 1)

    @property
    def real_tokens(self) -> jax.Array:
        """[T] bool: tokens that are not padding."""
        return jnp.arange(self.tokens.shape[0]) < self.cu_q_lens[self.num_seqs]

    def attention_metadata(self, page_size: int) -> AttentionMetadata:
        """The model's attention metadata: a prefill of the rows' chunks (traced)."""
        rows, real = self.token_rows, self.real_tokens
        page = self.page_table[rows, self.positions // page_size]
        slot_mapping = jnp.where(real, page * page_size + self.positions % page_size, 0).astype(jnp.int32)
        return AttentionMetadata(slot_mapping=slot_mapping, page_table=self.page_table,
                                 kv_lens=self.kv_lens, cu_q_lens=self.cu_q_lens,
                                 num_seqs=self.num_seqs, mode="prefill")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """What a verify step returns (device arrays).

    Attributes:
      sampled: [T] the token sampled after each input token, with log probabilities
        where its row asked (``serving.engine.sample.logprobs.StepOutput``).
      accepted: [S] int32 each row's accepted drafts a: its emitted tokens are
        ``sampled.tokens[cu_q_lens[i]:cu_q_lens[i] + a + 1]``.
    """

    sampled: StepOutput
    accepted: jax.Array


def count_accepted(tokens: jax.Array, sampled: jax.Array, cu_q_lens: jax.Array, max_drafts: int) -> jax.Array:
    """[S] int32 leading drafts of each row equal to the token sampled before them.

    Args:
      tokens: [T] int32 the step's input tokens (row i: last token, then its drafts).
      sampled: [T] int32 the token sampled after each input token.
      cu_q_lens: [S + 1] int32 row bounds (row i has cu[i + 1] - cu[i] - 1 drafts).
      max_drafts: K (static).
    """
    T = tokens.shape[0]
    starts = cu_q_lens[:-1]
    drafts = cu_q_lens[1:] - starts - 1  # [S]
    j = jnp.arange(max_drafts)
    idx = starts[:, None] + j[None, :]  # [S, K]: sampled idx should equal input idx + 1
    match = ((j[None, :] < drafts[:, None])
             & (sampled[jnp.minimum(idx, T - 1)] == tokens[jnp.minimum(idx + 1, T - 1)]))
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _speculative_sampling(logits, tokens, sampled, batch: VerifyBatch, state, token_slots, q, argmax_block):
    """([T] emitted tokens, [S] accepted counts) under speculative sampling's rule for
    temperature rows, the exact rule for greedy rows (``serving.engine.sample.rejection``).
    Token t of row r at offset o emits: the draft after it while o < accepted, then the
    residual sample (a rejection) or plain sampling's token (all drafts accepted)."""
    T = tokens.shape[0]
    K = q.shape[1]
    s = batch.sampling
    rows = batch.token_rows
    off = jnp.arange(T) - batch.cu_q_lens[rows]
    num_drafts = (batch.cu_q_lens[1:] - batch.cu_q_lens[:-1] - 1)[rows]
    has_next = batch.real_tokens & (off < num_drafts)
    nxt = tokens[jnp.minimum(jnp.arange(T) + 1, T - 1)]
    temp = s.temperature > 0

    def rejection(_):
        processed = process_logits(logits, s, state.output_counts, state.prompt_seen, token_slots)
        p = jax.nn.softmax(sampling_logits(processed, s), axis=-1)
        q_tok = q[rows, jnp.clip(off, 0, K - 1)]  # [T, V]
        pos = batch.positions + 1
        return accept_and_residual(p, q_tok, nxt, stream_keys(s.seed, pos, ACCEPT_STREAM),
                                   stream_keys(s.seed, pos, RESIDUAL_STREAM), argmax_block)

    accept, residual = jax.lax.cond(jnp.any(temp & has_next), rejection,
                                    lambda _: (jnp.zeros(T, bool), sampled), None)
    ok = has_next & jnp.where(temp, accept, sampled == nxt)
    accepted = leading_true(ok, batch.cu_q_lens, K)
    a_tok = accepted[rows]
    emitted = jnp.where(off < a_tok, nxt, jnp.where(temp & (off < num_drafts), residual, sampled))
    return emitted.astype(jnp.int32), accepted


def leading_true(ok: jax.Array, cu_q_lens: jax.Array, max_drafts: int) -> jax.Array:
    """[S] int32 each row's count of leading True in ``ok`` [T] over its first ``max_drafts``
    tokens (row i: tokens cu_q_lens[i]...)."""
    T = ok.shape[0]
    idx = cu_q_lens[:-1, None] + jnp.arange(max_drafts)[None, :]
    m = ok[jnp.minimum(idx, T - 1)] & (idx < cu_q_lens[1:, None])
    return jnp.sum(jnp.cumprod(m.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify_step(graphdef, compute, argmax_block, max_drafts: int, params, state, batch: VerifyBatch,
                drafts: jax.Array | None = None, draft_probs: jax.Array | None = None, *, aux_layers=None):
    """The jitted verify step (``state`` donated): (state, batch) -> (state, VerifyOutput);
    with ``aux_layers`` (static: an EAGLE-3 head's target layers, ``model.eagle3``)
    (state, (VerifyOutput, aux [T, 3 * D] f32)), the served model's hidden states there.

    ``state`` is the engine's ``DeviceState`` (rebuilt with its own type, so this
    module does not import the engine). ``drafts``: [S, K] int32 a draft model's
    proposals (``serving.engine.draft_model``), which replace the batch's placeholder
    drafts; None: the batch's drafts are the host's (n-gram). ``draft_probs``: [S, K, V]
    float32 the distributions they were drawn from: temperature rows then take speculative
    sampling's rule (``serving.engine.sample.rejection``), greedy rows the exact one.
    """
    model = nnx.merge(graphdef, params)
    T = batch.tokens.shape[0]
    tokens = batch.tokens
    if drafts is not None:
        tokens = replace_drafts(tokens, batch.token_rows, batch.cu_q_lens, batch.real_tokens, drafts)
    md = batch.attention_metadata(state.kv_cache.page_size)
    logits, kv_cache, *aux = model(tokens, batch.positions, state.kv_cache, md, jnp.arange(T, dtype=jnp.int32),
                                   compute=compute, **({} if aux_layers is None else {"aux_layers": aux_layers}))
    token_slots = batch.slot_ids[batch.token_rows]
    sampled = sample_processed(logits, batch.positions + 1, batch.sampling, state.output_counts,
                               state.prompt_seen, token_slots, argmax_block)
    if draft_probs is None:
        accepted = count_accepted(tokens, sampled, batch.cu_q_lens, max_drafts)
    else:
        sampled, accepted = _speculative_sampling(logits, tokens, sampled, batch, state, token_slots,
                                                  draft_probs, argmax_block)
    out = token_logprobs(logits, sampled, batch.sampling.num_logprobs)
    last = sampled[jnp.minimum(batch.cu_q_lens[:-1] + accepted, T - 1)]
    real = jnp.arange(batch.slot_ids.shape[0]) < batch.num_seqs
    slots = jnp.where(real, batch.slot_ids, state.slot_tokens.shape[0])
    slot_tokens = state.slot_tokens.at[slots].set(last, mode="drop")
    out = VerifyOutput(out, accepted)
    return dataclasses.replace(state, kv_cache=kv_cache, slot_tokens=slot_tokens), (out, aux[0]) if aux else out


def verify_treedef():
    """The pytree structure of a VerifyBatch (the multi-host lockstep rebuilds batches from leaves)."""
    dummy = {f.name: 0 for f in dataclasses.fields(VerifyBatch)}
    dummy["sampling"] = SamplingArrays(*[0] * len(dataclasses.fields(SamplingArrays)))
    return jax.tree.structure(VerifyBatch(**dummy))
