"""serving.engine.sample.sampling.sample: greedy, temperature, top-k, top-p, and the (seed, position) streams.

Statistical checks draw thousands of samples in one call (one row per draw,
distinct seeds or positions); two batch shapes are used in the whole file, so
``sample`` compiles twice.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.core.sched.step_plan import SamplingSettings
from serving.engine.sample.sampling import SamplingArrays, sample

V = 64  # vocabulary
R = 64  # rows of the small batch
N = 4096  # rows (= draws) of the big batch

SAMPLE = jax.jit(sample)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
SEEDS = st.integers(0, 2**32 - 1)


def arrays(rows, temperature=1.0, top_k=0, top_p=1.0, seed=None):
    """SamplingArrays with each field broadcast to `rows` (seed defaults to 0..rows-1)."""
    seed = np.arange(rows) if seed is None else seed
    return SamplingArrays(
        np.broadcast_to(np.asarray(temperature, np.float32), (rows,)).copy(),
        np.broadcast_to(np.asarray(top_k, np.int32), (rows,)).copy(),
        np.broadcast_to(np.asarray(top_p, np.float32), (rows,)).copy(),
        (np.broadcast_to(np.asarray(seed, np.int64), (rows,)) & 0xFFFFFFFF).astype(np.uint32),
    )


def draw(logits, positions, s):
    logits = np.asarray(logits, np.float32)
    out = np.asarray(SAMPLE(logits, np.asarray(positions, np.int32), s))
    assert out.shape == (logits.shape[0],) and out.dtype == np.int32
    assert ((out >= 0) & (out < V)).all()
    return out


def softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def random_logits(rng, rows, scale=3.0):
    return (scale * rng.standard_normal((rows, V))).astype(np.float32)


# --------------------------------------------------------------------------
# greedy


@SETTINGS
@given(seed=SEEDS, ties=st.booleans())
def test_greedy_is_argmax(seed, ties):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, R)
    if ties:  # few distinct values: argmax must pick the first maximum, like numpy
        logits = np.round(logits / 3).astype(np.float32)
    s = arrays(R, 0.0, rng.integers(0, V, R), rng.uniform(0.1, 1.0, R), rng.integers(0, 2**32, R))
    np.testing.assert_array_equal(draw(logits, rng.integers(0, 1000, R), s), logits.argmax(-1))


@SETTINGS
@given(seed=SEEDS)
def test_temperature_zero_rows_are_greedy_in_a_sampling_batch(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, R, scale=1.0)
    greedy = rng.random(R) < 0.5
    greedy[0] = False  # at least one row samples, so the sampling branch runs
    temp = np.where(greedy, 0.0, rng.uniform(0.5, 5.0, R))
    s = arrays(R, temp, rng.integers(0, V, R), rng.uniform(0.2, 1.0, R), rng.integers(0, 2**32, R))
    out = draw(logits, rng.integers(0, 1000, R), s)
    np.testing.assert_array_equal(out[greedy], logits.argmax(-1)[greedy])
    # Sampling rows do sample at these temperatures (not silently greedy).
    assert (out[~greedy] != logits.argmax(-1)[~greedy]).any()


@SETTINGS
@given(seed=SEEDS)
def test_top_k_1_is_greedy_at_any_temperature(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, R, scale=rng.choice([1e-3, 1.0, 1e3]))
    temp = 10.0 ** rng.uniform(-4, 4, R)
    s = arrays(R, temp, 1, rng.choice([1.0, 0.5, 0.01], R), rng.integers(0, 2**32, R))
    np.testing.assert_array_equal(draw(logits, rng.integers(0, 1000, R), s), logits.argmax(-1))


# --------------------------------------------------------------------------
# top-k


def _kth_largest(logits, k):
    return np.take_along_axis(np.sort(logits, -1)[:, ::-1], (np.asarray(k) - 1)[:, None], -1)[:, 0]


@SETTINGS
@given(seed=SEEDS)
def test_top_k_samples_fall_in_the_top_k(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, R, scale=1.0)
    k = rng.integers(1, 8, R)
    s = arrays(R, rng.uniform(2.0, 50.0, R), k, 1.0, rng.integers(0, 2**32, R))  # hot: spread over the k
    out = draw(logits, rng.integers(0, 10**6, R), s)
    assert (logits[np.arange(R), out] >= _kth_largest(logits, k)).all()


@pytest.mark.parametrize("fill", [-np.inf, -1e30, np.finfo(np.float32).min])
def test_top_k_with_masked_logits(fill):
    """Banned tokens (-inf or a huge negative mask value) must not switch top-k off.

    Regression: the threshold bisection halved the float range [min, max], which
    never leaves -inf and, over [-1e30, max], cannot resolve ordinary logits, so
    every unmasked token stayed in play.
    """
    rng = np.random.default_rng(0)
    logits = np.tile(random_logits(rng, 1, scale=1.0), (N, 1))
    logits[:, rng.permutation(V)[: V // 2]] = fill
    k = 3
    out = draw(logits, np.zeros(N), arrays(N, 1.0, k, 1.0))
    top = set(np.argsort(-logits[0], kind="stable")[:k])
    assert set(out) == top  # only the top k, and each of them (N draws)
    # top-p over such a row is exact too.
    probs = softmax64(logits[0])
    order = np.argsort(-probs, kind="stable")
    top_p = probs[order[0]] + 0.5 * probs[order[1]]  # keeps exactly the two most likely tokens
    out = draw(logits, np.zeros(N), arrays(N, 1.0, 0, top_p))
    assert set(out) == set(order[:2])


def test_top_k_at_or_above_vocab_and_top_p_1_are_off():
    """top_k 0 / >= vocab and top_p 1 filter nothing: the same draws as no filter at all."""
    rng = np.random.default_rng(3)
    logits = random_logits(rng, R, scale=1.0)
    pos = rng.integers(0, 10**6, R)
    base = draw(logits, pos, arrays(R, 1.0, 0, 1.0))
    for k in (V, V + 5, 10**6):
        np.testing.assert_array_equal(draw(logits, pos, arrays(R, 1.0, k, 1.0)), base)


# --------------------------------------------------------------------------
# top-p


@settings(SETTINGS, max_examples=12)
@given(seed=SEEDS, m=st.integers(1, 12), temp=st.sampled_from([0.7, 1.0, 1.5]))
def test_top_p_keeps_exactly_the_smallest_prefix(seed, m, temp):
    """Only the smallest prefix of sorted probs with mass >= top_p is ever drawn, and all of it is.

    top_p is put halfway into the m-th probability, so the kept set is the top m
    tokens with a wide margin against float32 rounding.
    """
    rng = np.random.default_rng(seed)
    row = (-0.25 * rng.permutation(V) + rng.normal(0, 0.05, V) + rng.uniform(-5, 5)).astype(np.float32)
    probs = softmax64(row.astype(np.float64) / np.float32(temp))
    order = np.argsort(-probs, kind="stable")
    sorted_p = probs[order]
    top_p = sorted_p[: m - 1].sum() + 0.5 * sorted_p[m - 1]
    keep = set(order[:m].tolist())
    # Mixed streams: distinct seeds at one position for half the rows, one seed at many positions for the rest.
    seeds = np.where(np.arange(N) < N // 2, rng.integers(0, 2**32, N), seed)
    pos = np.where(np.arange(N) < N // 2, 17, np.arange(N))
    out = draw(np.tile(row, (N, 1)), pos, arrays(N, temp, 0, top_p, seeds))
    assert set(out.tolist()) == keep


# --------------------------------------------------------------------------
# the sampled distribution


def _chi_square_ok(counts, expected):
    """Pearson chi-square, bins with expected < 5 pooled; passes if below mean + 6 sd of the chi2 law."""
    assert counts[expected == 0].sum() == 0, "drew a token of probability 0"
    small = expected < 5
    obs = np.concatenate([counts[~small], [counts[small].sum()]])
    exp = np.concatenate([expected[~small], [expected[small].sum()]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return stat, dof, stat < dof + 6 * np.sqrt(2 * dof)


def _filtered_softmax(row, temp, top_k, top_p):
    p = softmax64(row.astype(np.float64) / temp)
    if 0 < top_k < V:
        p[np.argsort(-p, kind="stable")[top_k:]] = 0
        p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        m = int(np.searchsorted(cum, top_p)) + 1
        p[order[m:]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("temp,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 10, 1.0), (1.0, 0, 0.8), (1.5, 20, 0.9)])
@pytest.mark.parametrize("stream", ["seeds", "positions"])
def test_empirical_distribution_matches_softmax(temp, top_k, top_p, stream):
    """N draws (distinct seeds at one position, or one seed at N positions) follow the filtered softmax."""
    rng = np.random.default_rng(11)
    row = rng.normal(0, 1.0, V).astype(np.float32)
    # Keep the top-p boundary away from a cumulative sum so float32 vs float64 cannot disagree.
    if top_p < 1:
        p = _filtered_softmax(row, temp, top_k, 1.0)
        cum = np.cumsum(np.sort(p)[::-1])
        assert np.abs(cum - top_p).min() > 1e-3
    if stream == "seeds":
        seeds, pos = np.arange(N) * 7919 + 1, np.full(N, 5)
    else:
        seeds, pos = np.full(N, 1234), np.arange(N)
    out = draw(np.tile(row, (N, 1)), pos, arrays(N, temp, top_k, top_p, seeds))
    expected = N * _filtered_softmax(row, temp, top_k, top_p)
    stat, dof, ok = _chi_square_ok(np.bincount(out, minlength=V), expected)
    assert ok, f"chi2 {stat:.1f} with {dof} dof"


# --------------------------------------------------------------------------
# random streams


def _random_batch(rng):
    logits = random_logits(rng, R, scale=1.0)
    temp = np.where(rng.random(R) < 0.2, 0.0, rng.uniform(0.5, 3.0, R))
    top_k = np.where(rng.random(R) < 0.5, 0, rng.integers(1, V, R))
    top_p = np.where(rng.random(R) < 0.5, 1.0, rng.uniform(0.3, 1.0, R))
    return logits, rng.integers(0, 10**6, R), arrays(R, temp, top_k, top_p, rng.integers(0, 2**32, R))


def _take(s: SamplingArrays, idx):
    return SamplingArrays(*(np.asarray(getattr(s, f))[idx] for f in ("temperature", "top_k", "top_p", "seed")))


@SETTINGS
@given(seed=SEEDS)
def test_same_seed_and_position_give_the_same_token_in_any_row_and_batch(seed):
    """A row's token depends on its own logits, settings, seed and position only."""
    rng = np.random.default_rng(seed)
    logits, pos, s = _random_batch(rng)
    out = draw(logits, pos, s)
    np.testing.assert_array_equal(draw(logits, pos, s), out)  # repeatable
    # Move the rows around and replace about half of them with unrelated rows.
    perm = rng.permutation(R)
    kept = rng.random(R) < 0.5
    o_logits, o_pos, o_s = _random_batch(rng)
    logits2 = np.where(kept[:, None], logits[perm], o_logits)
    pos2 = np.where(kept, pos[perm], o_pos)
    s_perm = _take(s, perm)
    s2 = SamplingArrays(*(np.where(kept, getattr(s_perm, f), getattr(o_s, f))
                          for f in ("temperature", "top_k", "top_p", "seed")))
    out2 = draw(logits2, pos2, s2)
    np.testing.assert_array_equal(out2[kept], out[perm][kept])
    # A sampling row alone among greedy padding rows draws the same token too.
    i = int(np.flatnonzero(s.temperature > 0)[0])
    lone = arrays(R, 0.0, 0, 1.0, 0)
    for f in ("temperature", "top_k", "top_p", "seed"):
        getattr(lone, f)[R - 1] = getattr(s, f)[i]
    lone_logits = random_logits(rng, R)
    lone_logits[R - 1] = logits[i]
    lone_pos = np.zeros(R)
    lone_pos[R - 1] = pos[i]
    assert draw(lone_logits, lone_pos, lone)[R - 1] == out[i]


def test_different_positions_and_seeds_give_different_streams():
    flat = np.zeros((N, V), np.float32)  # uniform: every token equally likely
    seed = 42
    by_pos = draw(flat, np.arange(N), arrays(N, 1.0, 0, 1.0, seed))
    # N uniform draws over V tokens: all of them show up, none dominates.
    counts = np.bincount(by_pos, minlength=V)
    assert counts.min() > 0 and counts.max() < 3 * N / V
    assert (by_pos[1:] != by_pos[:-1]).mean() > 0.9  # consecutive positions are not stuck
    # Another seed at the same positions: an independent stream (agreement ~ 1/V).
    other = draw(flat, np.arange(N), arrays(N, 1.0, 0, 1.0, seed + 1))
    assert (other == by_pos).mean() < 3 / V
    # Seeds differing only in the top bit of the uint32 are distinct streams as well.
    high = draw(flat, np.arange(N), arrays(N, 1.0, 0, 1.0, seed | 1 << 31))
    assert (high == by_pos).mean() < 3 / V
    # Distinct seeds at one position also spread over the vocabulary.
    by_seed = draw(flat, np.zeros(N), arrays(N, 1.0, 0, 1.0, np.arange(N)))
    assert np.bincount(by_seed, minlength=V).min() > 0


def test_from_rows_pads_with_greedy_rows_and_wraps_seeds():
    s = SamplingArrays.from_rows([SamplingSettings(0.7, 5, 0.9, -1),
                                  SamplingSettings(1.0, 0, 1.0, 2**32 + 3)], 4)
    np.testing.assert_array_equal(s.temperature, np.array([0.7, 1.0, 0, 0], np.float32))
    np.testing.assert_array_equal(s.top_k, [5, 0, 0, 0])
    np.testing.assert_array_equal(s.top_p, np.array([0.9, 1, 1, 1], np.float32))
    assert s.seed.dtype == np.uint32
    np.testing.assert_array_equal(s.seed, [2**32 - 1, 3, 0, 0])


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.sampled_from([4096, 8192, 300]), st.integers(0, 6))
def test_blocked_argmax_is_argmax_with_ties(seed, vocab, ties):
    """argmax_rows == jnp.argmax (first index of the max), including ties across blocks and -inf rows."""
    from serving.engine.sample.sampling import argmax_rows

    rng = np.random.default_rng(seed)
    x = rng.integers(-5, 5, (5, vocab)).astype(np.float32)  # small ints: many ties
    x[0, rng.integers(0, vocab, ties)] = 10.0  # several maxima, possibly in different blocks
    x[1] = -np.inf
    got = np.asarray(jax.jit(lambda a: argmax_rows(a, block=1024))(x))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
