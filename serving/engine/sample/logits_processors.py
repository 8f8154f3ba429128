"""Logit processing before sampling, per row: logit_bias, min_tokens, penalties.

Applied on device to the raw float32 logits in vLLM's order (the contract of
``serving.contract.engine_client.SamplingParams``)::

    raw logits [R, V] float32      (log probabilities are taken here: serving.engine.sample.logprobs)
      -> logit_bias                 logits[i, id] += bias           (OpenAI's logit_bias)
      -> min_tokens                 logits[i, stop id] = -inf while fewer than min_tokens were generated
      -> repetition penalty         seen in prompt or output: logit > 0 ? logit / p : logit * p
      -> frequency, presence        logit - count * frequency - (count > 0) * presence
      -> (structured-output mask, temperature, top-k, top-p, min-p, sample: serving.engine.sample.sampling)

Greedy rows get every processor too (their token is the argmax of the processed
logits), as in vLLM. Each processor is the identity for a row at its neutral
setting (bias ids -1, no suppressed ids, penalties 0 / 0 / 1), and no row's
result depends on another row.

Sources: the frequency and presence penalties are OpenAI's (platform docs,
"Parameter details" of the text-generation guide: ``mu[j] -> mu[j] - c[j] *
alpha_frequency - float(c[j] > 0) * alpha_presence``, c[j] counting how often
token j was generated so far); the repetition penalty is CTRL's (Keskar et al.
2019, section 4.1) as vLLM applies it: over the tokens of the prompt *and* the
output, a positive logit is divided by the penalty and a negative one
multiplied by it.

The counts come from the engine's per-slot device state
(``serving.engine.sample.token_counts``): ``output_counts [slots, V]`` and ``prompt_seen
[slots, V]``; the batch's rows are gathered from them only inside the
processing branch, and the whole processing is skipped by ``lax.cond`` when no row of the
batch has a bias, a suppressed id or a penalty (:func:`sample_processed`), so
a plain batch pays a few reductions over the [R, L] settings only. The bias and
the suppression are scatters of at most ``R * MAX_LOGIT_BIAS`` and
``R * MAX_SUPPRESS_IDS`` elements (ids -1 are dropped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.engine.sample.sampling import SamplingArrays, sample


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Adds each row's bias values at its ids.

    Args:
      logits: [R, V] float32.
      bias_ids: [R, L] int32 token ids; -1 (or any id outside [0, V)) is ignored.
      bias_values: [R, L] float32.

    Returns:
      [R, V] float32. An id named twice in a row gets both values.
    """
    rows, vocab = logits.shape
    ids = jnp.where((bias_ids >= 0) & (bias_ids < vocab), bias_ids, vocab)
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], ids.shape)
    return logits.at[r, ids].add(bias_values, mode="drop")


def suppress_tokens(logits: jax.Array, suppress_ids: jax.Array) -> jax.Array:
    """Sets each row's ``suppress_ids`` to -inf (min_tokens: the stop ids while unmet).

    Args:
      logits: [R, V] float32.
      suppress_ids: [R, M] int32; -1 is ignored.

    Returns:
      [R, V] float32.
    """
    rows, vocab = logits.shape
    ids = jnp.where((suppress_ids >= 0) & (suppress_ids < vocab), suppress_ids, vocab)
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], ids.shape)
    return logits.at[r, ids].set(-jnp.inf, mode="drop")


def apply_penalties(logits: jax.Array, output_counts: jax.Array, prompt_seen: jax.Array,
                    repetition: jax.Array, frequency: jax.Array, presence: jax.Array) -> jax.Array:
    """Repetition (CTRL / vLLM), then frequency and presence (OpenAI) penalties.

    Args:
      logits: [R, V] float32.
      output_counts: [R, V] int32, times each token was generated so far in the row's sequence.
      prompt_seen: [R, V] bool, tokens of the row's prompt.
      repetition: [R] float32 (> 0; 1.0 = off).
      frequency: [R] float32 (0.0 = off).
      presence: [R] float32 (0.0 = off).

    Returns:
      [R, V] float32: ``x = seen ? (x > 0 ? x / rep : x * rep) : x``, then
      ``x - count * frequency - (count > 0) * presence``; rows at the neutral
      settings are returned bit for bit.
    """
    rep = repetition[:, None]
    seen = prompt_seen | (output_counts > 0)
    x = jnp.where(seen & (rep != 1.0), jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    penalised = x - counts * frequency[:, None] - (output_counts > 0) * presence[:, None]
    on = (frequency != 0.0) | (presence != 0.0)
    return jnp.where(on[:, None], penalised, x)


def needs_processing(s: SamplingArrays) -> jax.Array:
    """[] bool: some row of the batch has a logit bias, a suppressed id or a penalty."""
    used = jnp.bool_(False)
    if s.bias_ids is not None:
        used |= jnp.any(s.bias_ids >= 0)
    if s.suppress_ids is not None:
        used |= jnp.any(s.suppress_ids >= 0)
    if s.repetition_penalty is not None:
        used |= jnp.any((s.repetition_penalty != 1.0) | (s.frequency_penalty != 0.0)
                        | (s.presence_penalty != 0.0))
    return used


def process_logits(logits: jax.Array, s: SamplingArrays, output_counts: jax.Array | None = None,
                   prompt_seen: jax.Array | None = None, slot_ids: jax.Array | None = None) -> jax.Array:
    """Every processor before the structured-output mask, in vLLM's order (unconditionally:
    see :func:`sample_processed` for the form that skips them).

    Args:
      logits: [R, V] float32 raw logits.
      s: the rows' settings; fields that are None are off for every row.
      output_counts: [slots, V] int32 the engine's per-slot generated-token counts
        (None: no penalties).
      prompt_seen: [slots, V] bool the per-slot prompt-token presence.
      slot_ids: [R] int32 each row's slot (padding rows may hold ``slots``: clamped,
        their settings are neutral).

    Returns:
      [R, V] float32 processed logits.
    """
    if s.bias_ids is not None:
        logits = apply_logit_bias(logits, s.bias_ids, s.bias_values)
    if s.suppress_ids is not None:
        logits = suppress_tokens(logits, s.suppress_ids)
    if s.repetition_penalty is not None and output_counts is not None:
        slots = jnp.minimum(slot_ids, output_counts.shape[0] - 1)
        logits = apply_penalties(logits, output_counts[slots], prompt_seen[slots], s.repetition_penalty,
                                 s.frequency_penalty, s.presence_penalty)
    return logits


def sample_processed(logits: jax.Array, positions: jax.Array, s: SamplingArrays,
                     output_counts: jax.Array | None = None, prompt_seen: jax.Array | None = None,
                     slot_ids: jax.Array | None = None, argmax_block: int | None = None) -> jax.Array:
    """Processes the logits (:func:`process_logits`) and samples (``serving.engine.sample.sampling.sample``).

    When no row of the batch uses a processor (:func:`needs_processing`), the
    processing is skipped by ``lax.cond``. Both branches return only the [R]
    tokens: a branch that returned the [R, V] logits cost a copy of them (7-10
    ms per step at R = 8, V = 262144 on CPU, against 0.5 ms for the whole plain
    sampling).

    Args: as :func:`process_logits`, plus ``positions`` [R] int32 and ``argmax_block``
      (see ``serving.engine.sample.sampling.sample``).

    Returns:
      [R] int32 token ids.
    """

    def plain(_):
        return sample(logits, positions, s, argmax_block)

    def processed(_):
        return sample(process_logits(logits, s, output_counts, prompt_seen, slot_ids), positions, s,
                      argmax_block)

    return jax.lax.cond(needs_processing(s), processed, plain, None)
