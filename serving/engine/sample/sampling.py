"""Token sampling on device, per row: greedy, temperature, top-k, top-p, min-p.

Every row has its own settings, and its random stream is keyed by
``(seed, position)`` (``fold_in(PRNGKey(seed), position)``), so a row's sample
depends only on its own logits, seed and position: never on batch neighbours
or on which slot it occupies.

Top-k and top-p are applied exactly without sorting the 262k-entry vocabulary:
each finds its logit threshold by bisection (32 halvings of the uint32 space of
order-preserving float32 keys, i.e. exact up to float32 ties whatever the value
range), which is O(vocab) per halving instead of a sort. When every row is
greedy the sampling branch is skipped entirely (``lax.cond``), so a greedy
batch pays only an argmax. min-p keeps a token when its probability is at least
``min_p`` times the most likely one's, i.e. when its scaled logit is at least
``max + log(min_p)`` (vLLM's min_p, after top-k and top-p: renormalising does
not change a ratio of probabilities). Logit processing before sampling (bias,
min_tokens, penalties) is ``serving.engine.sample.logits_processors``'s. How the argmax runs (``jnp.argmax`` or in blocks,
:func:`argmax_rows`) is the backend policy's choice (``argmax_block``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from serving.contract.engine_client import MAX_LOGIT_BIAS
from serving.core.sched.step_plan import SamplingSettings
from serving.engine.sample.token_bitmask import apply_token_bitmask, argmax_allowed

_BISECT_STEPS = 32

MAX_SUPPRESS_IDS = 32
"""Most stop ids (EOS included) one row can mask while its ``min_tokens`` is unmet."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings, as device arrays.

    Every field has a fixed shape (``L = MAX_LOGIT_BIAS``, ``M = MAX_SUPPRESS_IDS``,
    id padding -1), so no request mix compiles a new program. The fields after
    ``seed`` may be None (statically off for every row: the unit tests' form);
    the engine always passes them all.

    Attributes:
      temperature: [R] float32; 0 = greedy.
      top_k: [R] int32; 0 = off.
      top_p: [R] float32; 1.0 = off.
      seed: [R] uint32.
      min_p: [R] float32; 0.0 = off.
      presence_penalty: [R] float32; 0.0 = off.
      frequency_penalty: [R] float32; 0.0 = off.
      repetition_penalty: [R] float32; 1.0 = off.
      bias_ids: [R, L] int32 token ids whose logits get ``bias_values`` added; -1 = none.
      bias_values: [R, L] float32.
      suppress_ids: [R, M] int32 ids masked to -inf this step (the stop ids while the
        row's ``min_tokens`` is unmet, decided on the host); -1 = none.
      num_logprobs: [R] int32 alternatives wanted with the sampled token's log
        probability; -1 = no log probabilities for the row.
      token_mask: [R, ceil(vocab / 32)] int32 structured-output bitmask
        (``serving.engine.sample.token_bitmask``; -1 rows unconstrained), or None: none.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    min_p: jax.Array | None = None
    presence_penalty: jax.Array | None = None
    frequency_penalty: jax.Array | None = None
    repetition_penalty: jax.Array | None = None
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    suppress_ids: jax.Array | None = None
    num_logprobs: jax.Array | None = None
    token_mask: jax.Array | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingSettings], size: int,
                  num_generated: Sequence[int] | None = None,
                  token_mask: np.ndarray | None = None) -> "SamplingArrays":
        """Host-side builder, one row per settings record; rows past len(rows) are
        greedy padding. Seeds are taken modulo 2**32. Returns numpy arrays.

        Args:
          rows: the rows' settings.
          size: R, the batch bucket.
          num_generated: per row, tokens generated before the one sampled now
            (None: 0 each); a row's ``suppress_ids`` apply while it is below
            ``min_tokens``.
          token_mask: [size, W] int32 structured-output bitmask (the engine pads
            it), or None.

        Raises:
          ValueError: more than MAX_LOGIT_BIAS bias pairs or MAX_SUPPRESS_IDS
            suppressed ids in a row (the engine loop rejects such requests first).
        """
        t = np.zeros(size, np.float32)
        k = np.zeros(size, np.int32)
        p = np.ones(size, np.float32)
        s = np.zeros(size, np.uint32)
        min_p = np.zeros(size, np.float32)
        presence = np.zeros(size, np.float32)
        frequency = np.zeros(size, np.float32)
        repetition = np.ones(size, np.float32)
        bias_ids = np.full((size, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((size, MAX_LOGIT_BIAS), np.float32)
        suppress = np.full((size, MAX_SUPPRESS_IDS), -1, np.int32)
        logprobs = np.full(size, -1, np.int32)
        for i, row in enumerate(rows):
            t[i], k[i], p[i], s[i] = row.temperature, row.top_k, row.top_p, row.seed & 0xFFFFFFFF
            min_p[i], logprobs[i] = row.min_p, row.logprobs
            presence[i], frequency[i] = row.presence_penalty, row.frequency_penalty
            repetition[i] = row.repetition_penalty
            if row.logit_bias:
                if len(row.logit_bias) > MAX_LOGIT_BIAS:
                    raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries per row")
                ids, values = zip(*row.logit_bias)
                bias_ids[i, :len(ids)] = ids
                bias_values[i, :len(ids)] = values
            generated = 0 if num_generated is None else num_generated[i]
            if row.suppress_ids and generated < row.min_tokens:
                if len(row.suppress_ids) > MAX_SUPPRESS_IDS:
                    raise ValueError(f"at most {MAX_SUPPRESS_IDS} suppressed ids per row")
                suppress[i, :len(row.suppress_ids)] = row.suppress_ids
        return cls(t, k, p, s, min_p, presence, frequency, repetition, bias_ids, bias_values,
                   suppress, logprobs, token_mask)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (a < b iff key(a) < key(b), -inf..+inf; -0.0 < +0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key(lo: jax.Array, hi: jax.Array, ok) -> jax.Array:
    """Largest t in [lo, hi] with ok(t), per row; ok is monotone (true then false) and lo counts as ok.

    Bisects the uint32 key space, so _BISECT_STEPS = 32 halvings always reach a
    single key: exact whatever the value range (-inf, -1e30 or a tiny temperature
    included), unlike halving the float range, whose resolution is range / 2**32.
    """

    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # upper middle, no uint32 overflow
        good = ok(mid) | (mid == lo)  # only once lo == hi: converged, never step below lo
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))
    return lo


def _threshold_for_count(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Largest key t with count(keys >= t) >= k, per row. keys [R, V] (ordered keys of the logits), k [R]."""
    return _largest_key(
        jnp.min(keys, axis=-1), jnp.max(keys, axis=-1), lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)


def _threshold_for_mass(probs: jax.Array, keys: jax.Array, top_p: jax.Array) -> jax.Array:
    """Largest key t with sum(probs[keys >= t]) >= top_p, per row.

    probs [R, V]; keys [R, V], their ordered keys; top_p [R]. If rounding leaves
    the total mass below top_p, the minimum key comes back: every token is kept.
    """
    return _largest_key(
        jnp.min(keys, axis=-1), jnp.max(keys, axis=-1),
        lambda t: jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= top_p)


def argmax_rows(x: jax.Array, block: int | None = 2048) -> jax.Array:
    """First index of each row's maximum, like ``jnp.argmax(x, -1)``, in two blocked passes.

    A max per block of ``block`` columns, the first block holding the row max,
    then the first index inside that block. Where the variadic (value, index)
    reduce of ``argmax`` is slow (XLA:CPU runs it over a 262144-wide row at
    under 1 GB/s: 37 ms for 32 rows, against 0.7 ms blocked; benchmarks/RESULTS.md,
    2026-11-30) the backend policy asks for this form.

    Args:
      x: [R, V] float.
      block: columns per block; used when it divides V and V > block (None: plain argmax).

    Returns:
      [R] int32.
    """
    rows, vocab = x.shape
    if block is None or vocab <= block or vocab % block:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    xb = x.reshape(rows, vocab // block, block)
    block_max = jnp.max(xb, axis=-1)  # [R, V / block]
    first_block = jnp.argmax(block_max, axis=-1)  # first block holding the row max
    row_max = jnp.take_along_axis(block_max, first_block[:, None], axis=1)  # [R, 1]
    inside = jnp.take_along_axis(xb, first_block[:, None, None], axis=1)[:, 0]  # [R, block]
    offset = jnp.argmax(inside == row_max, axis=-1)
    return (first_block * block + offset).astype(jnp.int32)


def sample(logits: jax.Array, positions: jax.Array, s: SamplingArrays,
           argmax_block: int | None = None) -> jax.Array:
    """Samples one token per row.

    Args:
      logits: [R, vocab] float32, already processed (``serving.engine.sample.logits_processors``).
      positions: [R] int32, the position the sampled token will occupy (keys the random stream).
      s: per-row settings.
      argmax_block: see :func:`argmax_rows` (None: ``jnp.argmax``); the same token either way.

    Returns:
      [R] int32 token ids.
    """
    # The structured-output mask (serving.engine.sample.token_bitmask): after the logit processors, before
    # temperature, greedy rows too; in each branch, where it is cheapest.
    greedy = argmax_allowed(logits, s.token_mask, lambda x: argmax_rows(x, argmax_block))

    def sampled(_):
        vocab = logits.shape[-1]
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(row_keys(s.seed, positions))
        drawn = argmax_rows(sampling_logits(logits, s) + gumbel, argmax_block)
        return jnp.where(s.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda _: greedy, None)


def row_keys(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """[R] PRNG keys ``fold_in(PRNGKey(seed), position)``: each row's random stream."""
    return jax.vmap(lambda sd, pos: jax.random.fold_in(jax.random.PRNGKey(sd), pos))(seed, positions)


def sampling_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """[R, V] float32 the logits a temperature row samples from: the token mask, temperature
    (greedy rows: 1), top-k, top-p and min-p applied (excluded tokens -inf), so that
    ``softmax`` of them is the row's sampling distribution. ``logits``: [R, V] processed."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
    scaled = apply_token_bitmask(logits, s.token_mask) / temp[:, None]
    vocab = logits.shape[-1]
    use_k = (s.top_k > 0) & (s.top_k < vocab)
    scaled_keys = _ordered_keys(scaled)
    kth = _threshold_for_count(scaled_keys, jnp.where(use_k, s.top_k, 1))
    scaled = jnp.where(use_k[:, None] & (scaled_keys < kth[:, None]), -jnp.inf, scaled)
    use_p = s.top_p < 1.0
    probs = jax.nn.softmax(scaled, axis=-1)
    prob_keys = _ordered_keys(probs)
    pth = _threshold_for_mass(probs, prob_keys, s.top_p)
    scaled = jnp.where(use_p[:, None] & (prob_keys < pth[:, None]), -jnp.inf, scaled)
    if s.min_p is not None:  # p / p_max >= min_p  <=>  scaled >= max + log(min_p)
        floor = jnp.max(scaled, axis=-1) + jnp.log(jnp.where(s.min_p > 0, s.min_p, 1.0))
        scaled = jnp.where((s.min_p > 0)[:, None] & (scaled < floor[:, None]), -jnp.inf, scaled)
    return scaled
