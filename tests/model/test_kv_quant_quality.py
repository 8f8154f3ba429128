"""Quantized KV pages on the real Gemma 3 270M: int8 and fp8 KV against bfloat16 KV (bfloat16
weights and activations, the golden tests' engine shapes): teacher-forced margins of the golden
ids, free-running greedy ids against the goldens, held-out perplexity on the prose prompts
(``tests.support.kv_quality``; the numbers: benchmarks/RESULTS.md, "Quantized KV pages").

One engine per format, each built, measured and stopped once for the module (the three engines
and the int8 / fp8 programs' compilation take ~2 minutes on the 2-core bench)."""

from __future__ import annotations

import pytest

from tests.support.kv_quality import greedy_agreement, margin_change, measure, prose_texts

pytestmark = [pytest.mark.gemma, pytest.mark.slow(240)]

FORMATS = ("int8", "fp8")
# How far the golden ids' teacher-forced margins (logprob units) may move from bf16 KV's, over the
# 8 golden prompts x 24 steps: measured 2026-12-07 on the 2-core Sapphire Rapids bench, int8 at most
# 0.552 (0.159 root mean square), fp8 at most 1.210 (0.169): the bounds sit above them.
MARGIN_BOUND = {"int8": 0.75, "fp8": 1.5}
MARGIN_RMS_BOUND = {"int8": 0.25, "fp8": 0.25}
# Free-running greedy ids equal the goldens up to the first step where the format's own
# teacher-forced margin of the golden id (same prefix) is below this: a decode step's logits
# differ from a prefill row's by rounding only, so no id can flip where the margin exceeds it.
TIE = 0.25
PERPLEXITY_RATIO = 0.01  # the rule: within 1% of bf16 KV's perplexity


@pytest.fixture(scope="module")
def short_golden(golden):
    """The golden prompts of one prefill chunk (all but the 712-token sliding-window one, which
    ``python -m benchmarks.kv_dtype quality`` scores with the rest): every scored request is one
    chunk, so each format compiles a few prompt-logprobs programs instead of one per page width
    the long prompt's chunks reach."""
    return {**golden, "prompts": [p for p in golden["prompts"] if p["num_tokens"] + 24 <= 256]}


@pytest.fixture(scope="module")
def quality(gemma_params, short_golden, gemma_tokenizer):
    prose = [gemma_tokenizer.encode(t, add_bos=True) for t in prose_texts()]
    # bf16 KV's free-running ids are not compared with anything here (the benchmark prints them)
    return {fmt: measure(gemma_params, short_golden, prose, fmt, greedy=fmt != "bfloat16")
            for fmt in ("bfloat16",) + FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_margins_move_within_the_bound_of_bf16_kv(quality, fmt):
    """Teacher-forced margins of the golden ids move from bf16 KV's by at most the format's bound.

    Slow: the module's three engines (see the module docstring)."""
    worst, rms = margin_change(quality[fmt], quality["bfloat16"])
    print(f"{fmt}: margins moved by at most {worst:.4f}, {rms:.4f} root mean square")
    assert 0 < worst <= MARGIN_BOUND[fmt], f"{fmt}: a margin moved by {worst:.3f}"
    assert rms <= MARGIN_RMS_BOUND[fmt], f"{fmt}: margins moved by {rms:.3f} root mean square"


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_ids_follow_the_goldens_until_a_near_tie(quality, short_golden, fmt):
    """Free-running greedy ids equal the goldens up to a step where the format's own margin is a tie.

    Slow: the module's three engines (see the module docstring)."""
    q = quality[fmt]
    golden = short_golden
    n = len(golden["prompts"])
    same, lead = greedy_agreement(q, golden)
    print(f"{fmt}: greedy ids equal the goldens in {same}/{n} prompts, {lead}/{24 * n} leading ids")
    assert n == 7
    for ids, margins, p in zip(q.greedy, q.margins, golden["prompts"]):
        assert len(ids) == 24
        step = next((i for i, (a, b) in enumerate(zip(ids, p["greedy"]["ids"])) if a != b), None)
        if step is not None:
            assert margins[step] < TIE, (f"{p['name']} step {step}: greedy {ids[step]}, golden "
                                         f"{p['greedy']['ids'][step]}, teacher-forced margin {margins[step]:.3f}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_perplexity_within_one_percent_of_bf16_kv(quality, fmt):
    """Held-out perplexity of the prose texts within 1% of bf16 KV's.

    Slow: the module's three engines (see the module docstring)."""
    ref, q = quality["bfloat16"], quality[fmt]
    assert q.tokens == ref.tokens > 800
    print(f"{fmt}: perplexity {q.perplexity:.4f} vs bf16 KV {ref.perplexity:.4f} over {q.tokens} tokens")
    assert abs(q.perplexity / ref.perplexity - 1) <= PERPLEXITY_RATIO
