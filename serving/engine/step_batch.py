"""Typed inputs of the two jitted steps: :class:`PrefillBatch` and :class:`DecodeBatch`.

Each is a registered pytree dataclass of fixed-shape arrays, built on the host
(numpy) from the scheduler's plan rows (``serving.core.sched.step_plan``) and the
engine's shape buckets (``serving.config.engine_config``), then passed whole to the
jitted step, to the multi-host lockstep (as its leaves) and to the model
(through the attention metadata it derives). Shapes (S, T, B and P are buckets)::

    prefill   tokens [T]  positions [T]            the rows' chunks packed back to back, then padding
              cu_q_lens [S + 1]  kv_lens [S]       row i owns tokens cu_q_lens[i]:cu_q_lens[i + 1]
              page_table [S, P]  num_seqs []       rows past num_seqs are padding (kv_lens 0)
              logits_indices [S]  slot_ids [S]     the token whose logits sample, the slot it goes to
              sampling [S]  prompt_lens [S]        (token counts: positions >= prompt_lens are output)
              next_ids [T]                         each token's successor in its prompt, -1 = none
                                                   (read by the prompt-logprobs variant only)
              copy_src [S]  copy_dst [S]           pages copied before the model call (forked
                                                   requests' partial pages; unused: 0 onto 0)
              lora_slots [S]                       each row's LoRA adapter slot (0: the base model)
    decode    slot_ids [B]  positions [B]          padding rows: slot max_slots (dropped), length 0
              page_table [B, P]  lengths [B]       lengths = position + 1
              sampling [B]  lora_slots [B]
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.attention_metadata import AttentionMetadata
from serving.config.engine_config import (EngineConfig, batch_bucket, page_bucket, prefill_page_bucket,
                                          prefill_rows_bucket, token_bucket)
from serving.core.sched.step_plan import DecodeRow, PrefillRow
from serving.engine.sample.sampling import SamplingArrays


def _pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def _slot_mapping(page_table, rows, positions, real, page_size: int) -> jax.Array:
    """[N] int32 flat cache slots (page * page_size + offset) of tokens at ``positions``
    of sequences ``rows``; tokens that are not ``real`` point into the null page 0."""
    page = page_table[rows, positions // page_size]
    return jnp.where(real, page * page_size + positions % page_size, 0).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """One prefill step: up to S prompt chunks packed into T tokens.

    Attributes:
      tokens: [T] int32 token ids; padding after cu_q_lens[num_seqs].
      positions: [T] int32 absolute positions.
      cu_q_lens: [S + 1] int32 cumulative chunk lengths.
      kv_lens: [S] int32 tokens in the cache for each row after this step (0: padding row).
      page_table: [S, P] int32 each row's pages, in order (0: the null page).
      num_seqs: [] int32 real rows.
      logits_indices: [S] int32 the token of each row whose logits are sampled (its last).
      slot_ids: [S] int32 the slot each row's sampled token is written to.
      sampling: [S] per-row sampling settings.
      prompt_lens: [S] int32 each row's prompt length.
      next_ids: [T] int32 the prompt token that follows each token (-1: none known).
      copy_src, copy_dst: [S] int32 page copies run before the model call
        (``PrefillRow.page_copy``; at most one per row); unused entries are 0, 0.
      lora_slots: [S] int32 each row's LoRA adapter slot (``model.lora``; 0: none).
      image_embeds: [T, D] float32 or None: image soft tokens at the image tokens
        (``serving.engine.vision_inputs.pack_images``); an engine with a vision tower
        always sends them (zeros without images), one without never does.
      image_spans: [T, 2] int32 or None: each token's image span (``model.attention_metadata``).
    """

    tokens: jax.Array
    positions: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    slot_ids: jax.Array
    sampling: SamplingArrays
    prompt_lens: jax.Array
    next_ids: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    lora_slots: jax.Array
    image_embeds: jax.Array | None = None
    image_spans: jax.Array | None = None

    kind: ClassVar[str] = "prefill"

    @classmethod
    def from_rows(cls, rows: Sequence[PrefillRow], cfg: EngineConfig,
                  token_mask: np.ndarray | None = None, images=None) -> "PrefillBatch":
        """Packs plan rows into numpy arrays of the step's buckets (`token_mask`:
        [S, W] int32, S = ``prefill_rows_bucket(len(rows))``, see ``SamplingArrays``;
        `images`: None, or a function
        ``(rows, T) -> (image_embeds, image_spans)``: ``vision_inputs.pack_images``).

        Raises:
          ValueError: no rows, more than ``max_prefill_seqs`` rows or more than
            ``prefill_chunk`` tokens.
        """
        n_tok = sum(len(r.token_ids) for r in rows)
        if not rows or len(rows) > cfg.max_prefill_seqs or n_tok > cfg.prefill_chunk:
            raise ValueError(f"a prefill step takes 1..{cfg.max_prefill_seqs} rows and <= {cfg.prefill_chunk} "
                             f"tokens, got {len(rows)} rows of {n_tok} tokens")
        S = prefill_rows_bucket(len(rows), cfg)
        T = token_bucket(n_tok, cfg)
        P = prefill_page_bucket(_pages_for(max(r.end for r in rows), cfg.page_size), cfg)
        tokens = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        cu = np.full(S + 1, n_tok, np.int32)
        kv_lens = np.zeros(S, np.int32)
        page_table = np.zeros((S, P), np.int32)
        logits_indices = np.zeros(S, np.int32)
        slot_ids = np.zeros(S, np.int32)
        prompt_lens = np.zeros(S, np.int32)
        next_ids = np.full(T, -1, np.int32)
        copy_src = np.zeros(S, np.int32)
        copy_dst = np.zeros(S, np.int32)
        lora_slots = np.zeros(S, np.int32)
        off = 0
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            tokens[off:off + n] = r.token_ids
            prompt_lens[i] = r.prompt_len
            if r.wants_prompt_logprobs:  # token at p is followed by prompt[p + 1] while p + 1 < prompt_len
                k = min(r.end, r.prompt_len) - r.start  # chunk tokens inside the prompt
                next_ids[off:off + k - 1] = r.token_ids[1:k]
                next_ids[off + k - 1] = r.next_prompt_id if r.end < r.prompt_len else -1
            positions[off:off + n] = np.arange(r.start, r.end)
            cu[i] = off
            kv_lens[i] = r.end
            used = _pages_for(r.end, cfg.page_size)
            page_table[i, :used] = r.page_ids[:used]
            logits_indices[i] = off + n - 1
            slot_ids[i] = r.slot
            lora_slots[i] = r.lora_slot
            if r.page_copy is not None:
                copy_src[i], copy_dst[i] = r.page_copy.src, r.page_copy.dst
            off += n
        cu[len(rows)] = off
        sampling = SamplingArrays.from_rows([r.sampling for r in rows], S, [r.num_generated for r in rows],
                                            token_mask)
        embeds, spans = images(rows, T) if images is not None else (None, None)
        return cls(tokens, positions, cu, kv_lens, page_table, np.int32(len(rows)), logits_indices,
                   slot_ids, sampling, prompt_lens, next_ids, copy_src, copy_dst, lora_slots, embeds, spans)

    @property
    def shape_key(self) -> tuple:
        """(kind, T, P, S): which compiled program runs this batch."""
        return (self.kind, self.tokens.shape[0], self.page_table.shape[1], self.page_table.shape[0])

    def as_prefill(self) -> "PrefillBatch":
        """This batch as a plain :class:`PrefillBatch` (the same arrays): the pytree the prefill
        forward program takes, whichever kind the batch is."""
        if type(self) is PrefillBatch:
            return self
        return PrefillBatch(**{f.name: getattr(self, f.name) for f in dataclasses.fields(PrefillBatch)})

    def attention_metadata(self, page_size: int) -> AttentionMetadata:
        """The model's attention metadata (traced; inside the step)."""
        seq, real = self.token_rows, self.real_tokens
        return AttentionMetadata(
            slot_mapping=_slot_mapping(self.page_table, seq, self.positions, real, page_size),
            page_table=self.page_table, kv_lens=self.kv_lens, cu_q_lens=self.cu_q_lens,
            num_seqs=self.num_seqs, image_spans=self.image_spans, mode="prefill")

    @property
    def token_lora_slots(self) -> jax.Array:
        """[T] int32: each token's LoRA slot, its row's (traced; padding tokens: the last row's)."""
        return self.lora_slots[self.token_rows]

    @property
    def token_rows(self) -> jax.Array:
        """[T] int32: the row each token belongs to (traced; padding tokens: the last row)."""
        T = self.tokens.shape[0]
        seq = jnp.searchsorted(self.cu_q_lens[1:], jnp.arange(T), side="right")
        return jnp.minimum(seq, self.page_table.shape[0] - 1)

    @property
    def real_tokens(self) -> jax.Array:
        """[T] bool: tokens that are not padding."""
        return jnp.arange(self.tokens.shape[0]) < self.cu_q_lens[self.num_seqs]

    @property
    def real_rows(self) -> jax.Array:
        """[S] bool: rows that are not padding."""
        return jnp.arange(self.slot_ids.shape[0]) < self.num_seqs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobsBatch(PrefillBatch):
    """A prefill step that also scores every prompt token (echo / ``prompt_logprobs``).

    The same fields as :class:`PrefillBatch`. The engine runs it through the plain prefill
    forward (:meth:`PrefillBatch.as_prefill`), then its scoring program on the forward's
    hidden states: the logits at all T tokens (``[T, V]`` float32: 256 MiB for Gemma 3 at
    T = 256) and the log probability of each token's ``next_ids`` successor. The engine runs
    a prefill as this kind when a row has prompt tokens to score
    (``PrefillRow.wants_prompt_logprobs``).
    """

    kind: ClassVar[str] = "prefill_logprobs"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step: one token for each of B rows (running slots, then padding).

    Attributes:
      slot_ids: [B] int32 the slot of each row; its input token is the slot's last
        sampled token on device. Padding rows hold ``max_slots`` (out of range).
      positions: [B] int32 the input token's position.
      page_table: [B, P] int32 each row's pages.
      lengths: [B] int32 tokens in the cache after this step (position + 1; 0: padding).
      sampling: [B] per-row sampling settings.
      lora_slots: [B] int32 each row's LoRA adapter slot (0: none; padding rows 0).
    """

    slot_ids: jax.Array
    positions: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    sampling: SamplingArrays
    lora_slots: jax.Array

    kind: ClassVar[str] = "decode"

    @classmethod
    def from_rows(cls, rows: Sequence[DecodeRow], cfg: EngineConfig,
                  token_mask: np.ndarray | None = None) -> "DecodeBatch":
        """Packs plan rows into numpy arrays of the step's buckets
        (``cfg.min_decode_batch`` resolved by the engine; `token_mask`: [B, W]
        int32, see ``SamplingArrays``).

        Raises:
          ValueError: no rows or more than ``max_slots`` rows.
        """
        if not rows or len(rows) > cfg.max_slots:
            raise ValueError(f"a decode step takes 1..{cfg.max_slots} rows, got {len(rows)}")
        B = batch_bucket(len(rows), cfg)
        P = page_bucket(_pages_for(max(r.position + 1 for r in rows), cfg.page_size), cfg)
        slot_ids = np.full(B, cfg.max_slots, np.int32)
        positions = np.zeros(B, np.int32)
        lengths = np.zeros(B, np.int32)
        page_table = np.zeros((B, P), np.int32)
        lora_slots = np.zeros(B, np.int32)
        for i, r in enumerate(rows):
            slot_ids[i] = r.slot
            lora_slots[i] = r.lora_slot
            positions[i] = r.position
            lengths[i] = r.position + 1
            used = _pages_for(r.position + 1, cfg.page_size)
            page_table[i, :used] = r.page_ids[:used]
        return cls(slot_ids, positions, page_table, lengths,
                   SamplingArrays.from_rows([r.sampling for r in rows], B, [r.num_generated for r in rows],
                                           token_mask), lora_slots)

    @property
    def shape_key(self) -> tuple:
        """("decode", B, P): which compiled program runs this batch."""
        return (self.kind, self.slot_ids.shape[0], self.page_table.shape[1])

    def attention_metadata(self, page_size: int) -> AttentionMetadata:
        """The model's attention metadata (traced; inside the step)."""
        B = self.slot_ids.shape[0]
        rows = jnp.arange(B)
        return AttentionMetadata(
            slot_mapping=_slot_mapping(self.page_table, rows, self.positions, self.real_rows, page_size),
            page_table=self.page_table, kv_lens=self.lengths,
            cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32), num_seqs=jnp.asarray(B, jnp.int32),
            mode="decode")

    @property
    def real_rows(self) -> jax.Array:
        """[B] bool: rows that are not padding."""
        return self.lengths > 0


STEP_BATCHES = {cls.kind: cls for cls in (PrefillBatch, PromptLogprobsBatch, DecodeBatch)}


def batch_treedef(kind: str):
    """The pytree structure of a ``kind`` ("prefill", "prefill_logprobs" or "decode") batch,
    to rebuild one from its leaves (the multi-host lockstep sends leaves)."""
    cls = STEP_BATCHES[kind]
    fields = [f.name for f in dataclasses.fields(cls)]
    dummy = {name: 0 for name in fields}
    dummy["sampling"] = SamplingArrays(*[0] * len(dataclasses.fields(SamplingArrays)))
    if "image_embeds" in dummy:  # text batches (a multi-host engine serves no images)
        dummy["image_embeds"] = dummy["image_spans"] = None
    return jax.tree.structure(cls(**dummy))
