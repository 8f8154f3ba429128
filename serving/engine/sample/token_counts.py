"""Per-slot token counts on device, for the penalties (``serving.engine.sample.logits_processors``).

Two arrays live in the engine's ``DeviceState``, one row per slot::

    output_counts [slots, V] int32   times each token was generated (positions >= prompt length)
    prompt_seen   [slots, V] bool    tokens of the prompt (positions < prompt length)

Both jitted steps update them before sampling, from the tokens they *feed*
(not the tokens they sample), so a slot's rows always describe exactly the
tokens whose logits come next:

  * prefill: a row starting at position 0 first clears its slot; then each
    chunk token at a position below the row's prompt length marks
    ``prompt_seen``, and one at or past it (a generated token recomputed after
    a preemption) adds to ``output_counts``;
  * decode: the input token (the previous step's sample, always past the
    prompt) adds to ``output_counts``.

So the counts after a preemption and recompute equal those before it. A
request whose penalties read these rows must have every token fed through
its slot since position 0: the engine loop makes such requests skip the
prefix cache (``SchedRequest.prefix_cache``). Other requests may start
mid-sequence (a prefix hit); their rows are stale but never read.

Memory: ``slots * V * 5`` bytes, e.g. 32 slots of Gemma 3's 262144-entry
vocabulary: 40 MiB; 256 slots: 320 MiB. Padding rows scatter out of range
and are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros(num_slots: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Fresh ``(output_counts [slots, V] int32, prompt_seen [slots, V] bool)``."""
    return jnp.zeros((num_slots, vocab), jnp.int32), jnp.zeros((num_slots, vocab), jnp.bool_)


def count_prefill(output_counts: jax.Array, prompt_seen: jax.Array, tokens: jax.Array,
                  positions: jax.Array, token_rows: jax.Array, real_tokens: jax.Array,
                  slot_ids: jax.Array, prompt_lens: jax.Array, reset_rows: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Counts one prefill step's tokens into their slots.

    Args:
      output_counts: [slots, V] int32.
      prompt_seen: [slots, V] bool.
      tokens: [T] int32 the step's tokens.
      positions: [T] int32 their positions.
      token_rows: [T] int32 the batch row each token belongs to.
      real_tokens: [T] bool, False for padding.
      slot_ids: [S] int32 each row's slot.
      prompt_lens: [S] int32 each row's prompt length.
      reset_rows: [S] bool rows whose slot is cleared first (real rows starting at 0).

    Returns:
      the updated (output_counts, prompt_seen).
    """
    n_slots = output_counts.shape[0]
    cleared = jnp.where(reset_rows, slot_ids, n_slots)
    output_counts = output_counts.at[cleared].set(0, mode="drop")
    prompt_seen = prompt_seen.at[cleared].set(False, mode="drop")
    slots = slot_ids[token_rows]
    in_prompt = positions < prompt_lens[token_rows]
    prompt_seen = prompt_seen.at[jnp.where(real_tokens & in_prompt, slots, n_slots), tokens].set(
        True, mode="drop")
    output_counts = output_counts.at[jnp.where(real_tokens & ~in_prompt, slots, n_slots), tokens].add(
        1, mode="drop")
    return output_counts, prompt_seen


def count_decode(output_counts: jax.Array, slot_ids: jax.Array, real_rows: jax.Array,
                 tokens: jax.Array) -> jax.Array:
    """Adds each decode row's input token to its slot's output counts.

    Args:
      output_counts: [slots, V] int32.
      slot_ids: [B] int32.
      real_rows: [B] bool, False for padding.
      tokens: [B] int32 the input tokens.

    Returns:
      the updated output_counts.
    """
    slots = jnp.where(real_rows, slot_ids, output_counts.shape[0])
    return output_counts.at[slots, tokens].add(1, mode="drop")
