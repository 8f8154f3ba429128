"""Logit processors, token counts, min-p and log probabilities as pure device functions.

Each processor is checked against its formula written out in numpy on a known
distribution (OpenAI's presence/frequency penalties, CTRL/vLLM's repetition
penalty), and the neutral settings against the raw logits bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serving.contract.engine_client import MAX_LOGIT_BIAS, MAX_LOGPROBS
from serving.core.sched.step_plan import SamplingSettings
from serving.engine.sample import token_counts
from serving.engine.sample.logits_processors import apply_penalties, process_logits
from serving.engine.sample.logprobs import prompt_logprobs, token_logprobs
from serving.engine.sample.sampling import MAX_SUPPRESS_IDS, SamplingArrays, sample

V = 64
R = 4


def known_logits() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (R, V)).astype(np.float32)
    x[:, :4] = [3.0, -2.0, 0.5, -0.25]  # positive and negative logits at known tokens
    return x


def arrays(rows: list[SamplingSettings], generated=None) -> SamplingArrays:
    return SamplingArrays.from_rows(rows, R, generated)


def counts_for(outputs: list[list[int]], prompts: list[list[int]]):
    counts = np.zeros((R, V), np.int32)
    seen = np.zeros((R, V), bool)
    for i, toks in enumerate(outputs):
        for t in toks:
            counts[i, t] += 1
    for i, toks in enumerate(prompts):
        seen[i, toks] = True
    return counts, seen


PROCESS = jax.jit(process_logits)


def test_frequency_and_presence_penalties_follow_openais_formula():
    x = known_logits()
    counts, seen = counts_for([[0, 0, 0, 1], [1, 2], [], [3, 3]], [[5], [], [0], []])
    rows = [SamplingSettings(frequency_penalty=0.5, presence_penalty=0.25),
            SamplingSettings(frequency_penalty=-1.0),
            SamplingSettings(presence_penalty=2.0),
            SamplingSettings(presence_penalty=-0.5, frequency_penalty=1.5)]
    got = np.asarray(PROCESS(x, arrays(rows), counts, seen, np.arange(R, dtype=np.int32)))
    freq = np.array([0.5, -1.0, 0.0, 1.5], np.float32)[:, None]
    pres = np.array([0.25, 0.0, 2.0, -0.5], np.float32)[:, None]
    want = x - counts * freq - (counts > 0) * pres
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert got[0, 0] == pytest.approx(3.0 - 3 * 0.5 - 0.25)  # three times generated
    np.testing.assert_array_equal(got[2], x[2])  # row 2: nothing generated, prompt does not count


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    x = known_logits()
    counts, seen = counts_for([[0], [1], [], []], [[1], [0, 2], [], []])
    rows = [SamplingSettings(repetition_penalty=2.0), SamplingSettings(repetition_penalty=0.5),
            SamplingSettings(repetition_penalty=1.3), SamplingSettings()]
    got = np.asarray(PROCESS(x, arrays(rows), counts, seen, np.arange(R, dtype=np.int32)))
    # row 0: token 0 (output, 3.0 -> 1.5) and token 1 (prompt, -2.0 -> -4.0)
    assert got[0, 0] == 1.5 and got[0, 1] == -4.0
    np.testing.assert_array_equal(got[0, 2:], x[0, 2:])
    # row 1, penalty 0.5 (< 1 favours repeats): token 0 3.0 -> 6.0, token 1 -2.0 -> -1.0, token 2 0.5 -> 1.0
    np.testing.assert_array_equal(got[1, :3], [6.0, -1.0, 1.0])
    np.testing.assert_array_equal(got[1, 3:], x[1, 3:])
    np.testing.assert_array_equal(got[2:], x[2:])  # nothing seen / neutral


def test_penalties_order_repetition_before_frequency():
    x = np.zeros((1, V), np.float32)
    x[0, 0] = 4.0
    counts = np.zeros((1, V), np.int32)
    counts[0, 0] = 2
    got = np.asarray(apply_penalties(x, counts, np.zeros((1, V), bool), np.float32([2.0]),
                                     np.float32([1.0]), np.float32([0.5])))
    assert got[0, 0] == 4.0 / 2.0 - 2 * 1.0 - 0.5


def test_logit_bias_and_min_tokens_suppression():
    x = known_logits()
    rows = [SamplingSettings(logit_bias=((5, 10.0), (7, -100.0), (5, 1.0))),
            SamplingSettings(min_tokens=3, suppress_ids=(1, 2)),
            SamplingSettings(min_tokens=3, suppress_ids=(1, 2)),
            SamplingSettings(logit_bias=((V - 1, 0.5),), min_tokens=1, suppress_ids=(0,))]
    got = np.asarray(PROCESS(x, arrays(rows, generated=[0, 2, 3, 0])))
    want = x.copy()
    want[0, 5] += 11.0  # named twice: both values
    want[0, 7] -= 100.0
    want[1, [1, 2]] = -np.inf  # 2 generated < 3: the stop ids cannot be sampled
    want[3, V - 1] += 0.5  # bias first, then suppression
    want[3, 0] = -np.inf
    np.testing.assert_array_equal(got, want)  # row 2: 3 generated, min_tokens met
    # greedy takes the argmax of the processed logits
    toks = np.asarray(jax.jit(sample)(got, np.zeros(R, np.int32), arrays(rows)))
    np.testing.assert_array_equal(toks, got.argmax(-1))


def test_neutral_settings_leave_logits_bit_for_bit():
    x = known_logits()
    counts, seen = counts_for([[0, 1, 1], [2], [3], [0]], [[4], [5], [6], [7]])
    got = np.asarray(PROCESS(x, arrays([SamplingSettings()] * R), counts, seen, np.arange(R, dtype=np.int32)))
    np.testing.assert_array_equal(got, x)
    s = arrays([SamplingSettings(), SamplingSettings(presence_penalty=1.0)] + [SamplingSettings()] * 2)
    got = np.asarray(PROCESS(x, s, counts, seen, np.arange(R, dtype=np.int32)))
    np.testing.assert_array_equal(np.delete(got, 1, 0), np.delete(x, 1, 0))  # only row 1 changes
    assert got[1, 2] == x[1, 2] - 1.0


def test_from_rows_bounds_and_padding():
    s = arrays([SamplingSettings(logit_bias=((3, 1.0),), min_tokens=2, suppress_ids=(9,), logprobs=5)])
    assert s.bias_ids.shape == (R, MAX_LOGIT_BIAS) and s.suppress_ids.shape == (R, MAX_SUPPRESS_IDS)
    assert s.bias_ids[0, 0] == 3 and (s.bias_ids[0, 1:] == -1).all() and (s.bias_ids[1:] == -1).all()
    assert s.suppress_ids[0, 0] == 9 and list(s.num_logprobs) == [5, -1, -1, -1]
    with pytest.raises(ValueError, match="suppressed"):
        arrays([SamplingSettings(min_tokens=1, suppress_ids=tuple(range(MAX_SUPPRESS_IDS + 1)))])


def test_min_p_keeps_only_tokens_within_the_ratio():
    n = 512
    logits = np.full((n, V), -5.0, np.float32)
    logits[:, 0] = 2.0
    logits[:, 1] = 2.0 + np.log(0.3)  # p1 / p0 = 0.3
    logits[:, 2] = 2.0 + np.log(0.1)  # p2 / p0 = 0.1
    rows = SamplingArrays.from_rows([SamplingSettings(temperature=1.0, min_p=0.2, seed=i) for i in range(n)], n)
    toks = np.asarray(jax.jit(sample)(logits, np.zeros(n, np.int32), rows))
    assert set(toks.tolist()) == {0, 1}  # 2 (ratio 0.1) and the rest are dropped
    off = SamplingArrays.from_rows([SamplingSettings(temperature=1.0, seed=i) for i in range(n)], n)
    assert 2 in set(np.asarray(jax.jit(sample)(logits, np.zeros(n, np.int32), off)).tolist())


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_token_logprobs_are_the_raw_log_softmax_with_top_ids():
    x = known_logits()
    tokens = np.array([3, 10, 0, 63], np.int32)
    out = jax.jit(token_logprobs)(x, tokens, np.array([2, -1, 0, MAX_LOGPROBS], np.int32))
    ref = log_softmax64(x)
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(R), tokens], atol=1e-5)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(ref, order, 1), atol=1e-5)
    off = jax.jit(token_logprobs)(x, tokens, np.full(R, -1, np.int32))
    assert not np.asarray(off.logprob).any() and not np.asarray(off.top_ids).any()
    np.testing.assert_array_equal(np.asarray(off.tokens), tokens)


def test_prompt_logprobs_score_each_successor():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 3, (32, V)).astype(np.float32)
    nxt = rng.integers(0, V, 32).astype(np.int32)
    nxt[[5, 31]] = -1
    out = jax.jit(prompt_logprobs)(x, nxt)
    ref = log_softmax64(x)
    want = np.where(nxt >= 0, ref[np.arange(32), np.maximum(nxt, 0)], 0.0)
    np.testing.assert_allclose(np.asarray(out.logprob), want, atol=1e-5)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)


def test_token_counts_prefill_and_decode():
    counts, seen = token_counts.zeros(3, V)
    counts = counts.at[1, 9].set(4)  # stale counts of a previous request in slot 1
    # two rows: slot 1 starts at 0 (prompt of 3, then a recomputed output token at position 3),
    # slot 2 continues at position 5 with prompt length 4 (all output); then padding
    tokens = np.array([7, 8, 7, 11, 12, 12, 0, 0], np.int32)
    positions = np.array([0, 1, 2, 3, 5, 6, 0, 0], np.int32)
    rows = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    real = np.arange(8) < 6
    counts, seen = jax.jit(token_counts.count_prefill)(
        counts, seen, tokens, positions, rows, real, np.array([1, 2], np.int32), np.array([3, 4], np.int32),
        np.array([True, False]))
    counts, seen = np.asarray(counts), np.asarray(seen)
    assert seen[1].nonzero()[0].tolist() == [7, 8] and not seen[[0, 2]].any()
    assert counts[1].nonzero()[0].tolist() == [11] and counts[1, 11] == 1  # slot 1 cleared first
    assert counts[2, 12] == 2 and counts[2].sum() == 2 and not counts[0].any()
    counts = np.asarray(jax.jit(token_counts.count_decode)(counts, np.array([2, 3], np.int32), np.array([True, False]),
                                                  np.array([12, 5], np.int32)))
    assert counts[2, 12] == 3 and counts.sum() == 4  # the padding row (slot 3, out of range) is dropped
