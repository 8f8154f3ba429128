"""The engine's step programs: the pure functions it jits, and the device state they update.

The step contract (the current form of the one drawn in the project's architecture
notes)::

    prefill_step(params, state: DeviceState, batch: PrefillBatch) -> (state, StepOutput [S])
    prefill_step(params, state, batch: PromptLogprobsBatch)
                                                    -> (state, (StepOutput [S], PromptLogprobs [T]))
    decode_step(params, state: DeviceState, batch: DecodeBatch)   -> (state, StepOutput [B])
        each of these as two programs (below): the forward, returning the rows'
        logits [R, V] f32 in place of the StepOutput, then
        sample_step(slot_tokens, counts, seen, logits, positions, sampling, slot_ids)
                                                    -> (slot_tokens, StepOutput [R])
        and a prompt-logprobs prefill as three: the plain prefill forward, whose
        final-norm hidden states [T, D] of every token it also returns, the sampler, and
        score_step(params, hidden, next_ids)        -> PromptLogprobs [T]
    verify_step(params, state, batch: VerifyBatch)  -> (state, VerifyOutput)   speculative decoding:
                      rows of [last token, drafts] sampled at every token (serving.engine.verify_step)

    DeviceState   kv_cache: KVCache    k, v [layers, kv_heads, num_pages, page_size, head_dim]
                  slot_tokens [slots]  int32: each slot's last sampled token
                  output_counts, prompt_seen [slots, V]: token counts for the penalties
                                       (serving.engine.sample.token_counts)
    StepOutput    tokens [R], the sampled tokens' log probabilities and top ids
                  (serving.engine.sample.logprobs; computed only when a row asks)

Each step turns its rows' raw float32 logits into tokens in vLLM's order:
logit processors (``serving.engine.sample.logits_processors``: bias, min_tokens, penalties),
then ``serving.engine.sample.sampling.sample``; log probabilities come from the raw logits.
The prefill and decode steps are two programs each, dispatched back to back: the forward
(the model, the KV write and the token counts; returns the rows' logits [R, V] f32) and the
sampler (``sample_step``: logits -> tokens, log probabilities, ``slot_tokens``). The sampler's
shapes are only (R, slots, V), so one compiled sampler serves every prefill and decode bucket
of that row count, where a fused step compiled it again in each (the sampler was about half of
a step's compile on CPU, tiny models and Gemma 3 270M alike: benchmarks/RESULTS.md, 2026-12-06);
the logits it reads are in memory either way (the sampler reads them several times). Prompt
log probabilities (echo, ``prompt_logprobs``) split the same way: the prefill forward always
returns every token's final-norm hidden state ([T, D], a small output beside the KV writes),
and the scoring program (``score_step``: the LM head at all T tokens, then
``serving.engine.sample.logprobs.prompt_logprobs``) has only the shapes (T, D, V), so one
program per token bucket serves every page-table width and row bucket, where a fused
prompt-logprobs forward compiled the whole model again for each (T, P, S).
    PrefillBatch, DecodeBatch: serving.engine.step_batch (shapes and buckets there and in
                  serving.config.engine_config)

The prefill step first copies the batch's pages for forked requests (``n``
choices sharing one prompt: ``PrefillBatch.copy_src``/``copy_dst``), so the
copy is ordered after every earlier step's writes and before this step's.

Each is jitted by ``serving.engine.engine.Engine`` once per shape bucket, ``state`` donated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from model.compute import Compute
from model.kv_cache import KVCache
from model.lora import LoraInputs
from serving.engine.sample import token_counts
from serving.engine.sample.logits_processors import sample_processed
from serving.engine.sample.logprobs import StepOutput, prompt_logprobs, token_logprobs
from serving.engine.sample.sampling import SamplingArrays
from serving.engine.step_batch import DecodeBatch, PrefillBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """What the steps update in place (donated).

    Attributes:
      kv_cache: the paged KV cache of all layers, in the policy's storage dtype.
      slot_tokens: [max_slots] int32, each slot's last sampled token.
      output_counts: [max_slots, V] int32 generated-token counts per slot (``serving.engine.sample.token_counts``).
      prompt_seen: [max_slots, V] bool prompt tokens per slot.
    """

    kv_cache: KVCache
    slot_tokens: jax.Array
    output_counts: jax.Array
    prompt_seen: jax.Array


def write_slots(slot_tokens: jax.Array, slot_ids: jax.Array, real: jax.Array,
                 tokens: jax.Array) -> jax.Array:
    """slot_tokens with tokens[i] written to slot slot_ids[i] for real rows (padding rows
    scatter out of bounds and are dropped)."""
    return slot_tokens.at[jnp.where(real, slot_ids, slot_tokens.shape[0])].set(tokens, mode="drop")


def sample_step(argmax_block, slot_tokens: jax.Array, output_counts: jax.Array, prompt_seen: jax.Array,
                logits: jax.Array, positions: jax.Array, s: SamplingArrays,
                slot_ids: jax.Array) -> tuple[jax.Array, StepOutput]:
    """The sampler program (``slot_tokens`` donated): raw logits -> processed -> sampled tokens,
    with log probabilities of the raw ones; each real row's token written to its slot.

    Args:
      argmax_block: the backend policy's argmax block (static).
      slot_tokens: [slots] int32 each slot's last sampled token.
      output_counts: [slots, V] int32, prompt_seen: [slots, V] bool (the penalties' inputs,
        already counting this step's tokens).
      logits: [R, V] float32 the rows' raw logits.
      positions: [R] int32 the position each sampled token will occupy, which is the row's
        tokens in the cache after its step (a prefill's ``kv_lens``, a decode's ``lengths``):
        0 marks a padding row, whose token is not written.
      s: [R] the rows' sampling settings; slot_ids: [R] int32.

    Returns:
      (slot_tokens [slots] int32, StepOutput [R]).
    """
    tokens = sample_processed(logits, positions, s, output_counts, prompt_seen, slot_ids, argmax_block)
    return write_slots(slot_tokens, slot_ids, positions > 0, tokens), token_logprobs(logits, tokens, s.num_logprobs)


def lora_inputs(stacks, token_slots) -> LoraInputs | None:
    return None if stacks is None else LoraInputs(stacks, token_slots)


def prefill_step(graphdef, compute: Compute, params, state: DeviceState, batch: PrefillBatch,
                  lora_stacks=None, *, aux_layers=None):
    """The prefill forward: (state, batch) -> (state, (the rows' logits [S, V] f32, every
    token's final-norm hidden state [T, D], the input of :func:`score_step`)); with
    ``aux_layers`` (static) a third element, aux [T, A * D] f32: the target's hidden states
    for an EAGLE-3 head."""
    model = nnx.merge(graphdef, params)
    md = batch.attention_metadata(state.kv_cache.page_size)
    kv_cache = state.kv_cache.copy_pages(batch.copy_src, batch.copy_dst)  # forked requests' pages
    lora = lora_inputs(lora_stacks, batch.token_lora_slots)
    extra = {} if lora is None else {"lora": lora}
    if batch.image_embeds is not None:
        extra["image_embeds"] = batch.image_embeds
    if aux_layers is not None:  # an EAGLE-3 head's features (serving.engine.eagle3_draft)
        extra["aux_layers"] = aux_layers
    row_logits, kv_cache, hidden, *aux = model(batch.tokens, batch.positions, kv_cache, md, batch.logits_indices,
                                               compute=compute, hidden_states=True, **extra)
    starts = batch.positions[jnp.minimum(batch.cu_q_lens[:-1], batch.tokens.shape[0] - 1)]
    counts, seen = token_counts.count_prefill(
        state.output_counts, state.prompt_seen, batch.tokens, batch.positions, batch.token_rows,
        batch.real_tokens, batch.slot_ids, batch.prompt_lens, batch.real_rows & (starts == 0))
    return DeviceState(kv_cache, state.slot_tokens, counts, seen), (row_logits, hidden, *aux)


def score_step(graphdef, compute: Compute, params, hidden: jax.Array, next_ids: jax.Array):
    """The prompt-logprobs program: the LM head at every token of a prefill step, then each
    token's successor scored.

    Args:
      hidden: [T, D] the prefill forward's final-norm hidden states (compute dtype).
      next_ids: [T] int32 each token's successor in its prompt (``PrefillBatch.next_ids``).

    Returns:
      PromptLogprobs [T] (``serving.engine.sample.logprobs.prompt_logprobs``).
    """
    return prompt_logprobs(nnx.merge(graphdef, params).head(hidden, compute), next_ids)


def decode_step(graphdef, compute: Compute, params, state: DeviceState, batch: DecodeBatch,
                 lora_stacks=None, *, aux_layers=None):
    """The decode forward: (state, batch) -> (state, the rows' logits [B, V] f32); with
    ``aux_layers`` wrapped as :func:`prefill_step`'s (aux [B, A * D])."""
    model = nnx.merge(graphdef, params)
    rows = batch.slot_ids.shape[0]
    tokens = state.slot_tokens[jnp.minimum(batch.slot_ids, state.slot_tokens.shape[0] - 1)]
    md = batch.attention_metadata(state.kv_cache.page_size)
    lora = lora_inputs(lora_stacks, batch.lora_slots)
    extra = {} if lora is None else {"lora": lora}
    if aux_layers is not None:
        extra["aux_layers"] = aux_layers
    logits, kv_cache, *aux = model(tokens, batch.positions, state.kv_cache, md,
                                   jnp.arange(rows, dtype=jnp.int32), compute=compute, **extra)
    counts = token_counts.count_decode(state.output_counts, batch.slot_ids, batch.real_rows, tokens)
    state = DeviceState(kv_cache, state.slot_tokens, counts, state.prompt_seen)
    return state, (logits, aux[0]) if aux else logits
